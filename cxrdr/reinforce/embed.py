"""Teacher forwards of a batch of prepared records: every teacher's img, syn and txt rows.

With a captioner (``--captioner``) the image forwards come first: the captioner turns its teacher's
image rows into each sample's captions (and the text of a record without a report), then the texts
are embedded. A sample's number of captions may then differ from the others'."""
from __future__ import annotations

import numpy as np
import torch

from cxrdr.reinforce.captioners.views import attach_view_captions
from cxrdr.reinforce.captions.from_labels import TEXT_SOURCE_RETRIEVED


def _forward(fn, inputs, chunk: int = 512):
    outs = [fn(inputs[i:i + chunk]) for i in range(0, len(inputs), chunk)]
    return torch.cat(outs).numpy() if outs else None


def embed_batch(teachers, samples: list[dict], images: bool, crops: dict | None = None,
                captioner=None, n_captions: int | None = None) -> list[dict]:
    """Teacher forwards for a batch: per sample {teacher: {'img': (K,D), 'syn': (S,D), 'txt': (D,)}}.

    ``crops``: the samples' crops already concatenated per teacher size ({size: (B*K, 1, S, S)},
    from :func:`collate_prepared`); default: each sample's own ``sample["crops"][size]`` (K, 1, S, S).
    ``captioner`` (with ``n_captions`` per view): captions the samples from the image rows first.
    """
    out = [{} for _ in samples]
    if not samples:
        return out
    img_of: dict[str, np.ndarray] = {}
    for teacher in teachers:
        if images and teacher.has_images:
            if crops is not None:
                x = crops[teacher.image_size]
            else:
                x = torch.cat([s["crops"][teacher.image_size] for s in samples])
            img = _forward(teacher.encode_images, x)
            img_of[teacher.name] = img.reshape(len(samples), x.shape[0] // len(samples), -1)
    if captioner is not None:
        caption_samples(captioner, samples, img_of[captioner.teacher], n_captions)
    counts = [len(s["texts"]) - 1 for s in samples]
    ends = np.cumsum(counts)
    texts = [s["texts"][0] for s in samples] + [t for s in samples for t in s["texts"][1:]]
    for teacher in teachers:
        tokens = _batch_tokens(samples, teacher.name)
        txt_all = _forward(teacher.encode_texts, texts) if tokens is None else _forward(teacher.encode_tokens, tokens)
        txt, syn = txt_all[:len(samples)], txt_all[len(samples):]
        for i in range(len(samples)):
            parts = {"syn": syn[ends[i] - counts[i]:ends[i]], "txt": txt[i]}
            if teacher.name in img_of:
                parts["img"] = img_of[teacher.name][i]
            out[i][teacher.name] = parts
    return out


def worker_tokenizers(teachers) -> tuple:
    """(name, tokenizer) of the teachers that tokenize apart from their forward (``Teacher.text_tokenizer``):
    the build's workers tokenize each record's texts, so the build's process, which feeds the teachers, does not.
    (open_clip's BPE tokenizer took 0.8 ms of that process a K = 10, S = 5 sample: ~a third of a ViT-B/16
    teacher's forward time on an H100.)"""
    return tuple((t.name, tok) for t in teachers if (tok := t.text_tokenizer()) is not None)


def _batch_tokens(samples: list[dict], name: str) -> torch.Tensor | None:
    """The samples' tokens for teacher ``name`` in the order of the batch's texts (every report, then every
    caption), or None where a sample has none (prepared without the tokenizer, or captioned after)."""
    if not all(name in s.get("tokens", {}) for s in samples):
        return None
    rows = [s["tokens"][name][:1] for s in samples] + [s["tokens"][name][1:] for s in samples]
    return torch.from_numpy(np.concatenate(rows))


def caption_samples(captioner, samples: list[dict], image_rows: np.ndarray, n_captions: int) -> None:
    """Each sample's captions from its views' image rows (B, K, D); a record without a report
    (``text_source: retrieved``) gets its text from the captioner too."""
    for sample, rows in zip(samples, image_rows):
        report = captioner.report_for(rows, n_captions) if not (sample["report"] or "").strip() else None
        if report is not None and sample.get("text_source") != TEXT_SOURCE_RETRIEVED:
            raise ValueError(f"record {sample['id']!r} has no report text and is not marked text_source: retrieved")
        attach_view_captions(sample, captioner.view_captions(rows, n_captions), captioner.caption_source, report)
