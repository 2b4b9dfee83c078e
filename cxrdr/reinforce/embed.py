"""Teacher forwards of a batch of prepared records: every teacher's img, syn and txt rows.

With a captioner (``--captioner``) the image forwards come first: the captioner turns its teacher's
image rows into each sample's captions (and the text of a record without a report), then the texts
are embedded. A sample's number of captions may then differ from the others'."""
from __future__ import annotations

import numpy as np
import torch

from cxrdr.reinforce.captioners.views import attach_view_captions
from cxrdr.reinforce.captions.from_labels import TEXT_SOURCE_RETRIEVED


def _forward(fn, inputs, chunk: int = 512) -> torch.Tensor | None:
    """``fn`` over ``inputs`` in chunks, the rows left on the teacher's device: the caller copies a batch's rows
    to the CPU at once (``_to_numpy``), so a GPU teacher is waited for once a batch, not after every chunk (each
    wait left the GPU idle while the next chunk's kernels were being queued)."""
    outs = [fn(inputs[i:i + chunk], on_device=True) for i in range(0, len(inputs), chunk)]
    return torch.cat(outs) if outs else None


def _to_numpy(rows: dict) -> dict:
    """{name: device tensor} -> {name: float32 array}: the first copy waits for the GPU's work, the rest do not."""
    return {name: t.cpu().numpy() for name, t in rows.items()}


def embed_batch(teachers, samples: list[dict], images: bool, crops: dict | None = None,
                captioner=None, n_captions: int | None = None) -> list[dict]:
    """Teacher forwards for a batch: per sample {teacher: {'img': (K,D), 'syn': (S,D), 'txt': (D,)}}.

    ``crops``: the samples' crops already concatenated per teacher size ({size: (B*K, 1, S, S)},
    from :func:`collate_prepared`); default: each sample's own ``sample["crops"][size]`` (K, 1, S, S).
    ``captioner`` (with ``n_captions`` per view): captions the samples from the image rows first.
    Every forward of the batch is queued before any row is copied back (one wait for a GPU teacher), except with
    a captioner, whose captions need the image rows before the texts' forwards.
    """
    out = [{} for _ in samples]
    if not samples:
        return out
    img_rows: dict[str, torch.Tensor] = {}
    for teacher in teachers:
        if images and teacher.has_images:
            x = crops[teacher.image_size] if crops is not None else \
                torch.cat([s["crops"][teacher.image_size] for s in samples])
            img_rows[teacher.name] = _forward(teacher.encode_images, x)
    img_of: dict[str, np.ndarray] = {}
    if captioner is not None:
        img_of = {k: v.reshape(len(samples), -1, v.shape[-1]) for k, v in _to_numpy(img_rows).items()}
        img_rows = {}
        caption_samples(captioner, samples, img_of[captioner.teacher], n_captions)
    counts = [len(s["texts"]) - 1 for s in samples]
    ends = np.cumsum(counts)
    texts = [s["texts"][0] for s in samples] + [t for s in samples for t in s["texts"][1:]]
    txt_rows = {}
    for teacher in teachers:
        tokens = _batch_tokens(samples, teacher.name)
        txt_rows[teacher.name] = _forward(teacher.encode_texts, texts) if tokens is None else \
            _forward(teacher.encode_tokens, tokens)
    img_of.update({k: v.reshape(len(samples), -1, v.shape[-1]) for k, v in _to_numpy(img_rows).items()})
    txt_of = _to_numpy(txt_rows)
    for teacher in teachers:
        txt, syn = txt_of[teacher.name][:len(samples)], txt_of[teacher.name][len(samples):]
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
