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
    """``fn`` over ``inputs`` in chunks, the rows left on the teacher's device (``QueuedBatch`` copies a batch's
    rows back together: a GPU teacher is waited for once a batch, not after every chunk)."""
    outs = [fn(inputs[i:i + chunk], on_device=True) for i in range(0, len(inputs), chunk)]
    return torch.cat(outs) if outs else None


def _copy_back(rows: torch.Tensor) -> torch.Tensor:
    """Queue the copy of ``rows`` to the CPU: on CUDA into pinned memory without waiting, so the copy runs right
    after the forwards that made the rows, ahead of whatever the stream gets next; elsewhere the rows as they are."""
    if rows.device.type != "cuda":
        return rows
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    return host.copy_(rows, non_blocking=True)


class QueuedBatch:
    """One batch's teacher forwards, queued with the copies of their rows to the CPU behind them (``queue_batch``);
    ``result()`` waits for this batch's work alone (one CUDA event a device) and returns ``embed_batch``'s
    per-sample dicts. Between the two the caller may queue the next batch, so a GPU teacher is never left
    waiting for the host between batches."""

    def __init__(self, teachers, samples: list[dict], img_rows: dict, txt_rows: dict, counts: list[int]):
        self.teachers, self.samples, self.counts = teachers, samples, counts
        self.img = {name: _copy_back(rows) for name, rows in img_rows.items()}
        self.txt = {name: _copy_back(rows) for name, rows in txt_rows.items()}
        devices = {r.device for r in [*img_rows.values(), *txt_rows.values()] if r.device.type == "cuda"}
        self.events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.events.append(event)

    def result(self) -> list[dict]:
        for event in self.events:
            event.synchronize()
        n = len(self.samples)
        if not n:  # no forward ran (``queue_batch``)
            return []
        ends = np.cumsum(self.counts)
        out = [{} for _ in self.samples]
        for teacher in self.teachers:
            txt_all = self.txt[teacher.name].numpy()
            txt, syn = txt_all[:n], txt_all[n:]
            img = self.img.get(teacher.name)
            img = None if img is None else np.asarray(img).reshape(n, -1, img.shape[-1])
            for i in range(n):
                parts = {"syn": syn[ends[i] - self.counts[i]:ends[i]], "txt": txt[i]}
                if img is not None:
                    parts["img"] = img[i]
                out[i][teacher.name] = parts
        return out


def queue_batch(teachers, samples: list[dict], images: bool, crops: dict | None = None,
                captioner=None, n_captions: int | None = None) -> QueuedBatch:
    """Queue a batch's teacher forwards (``embed_batch`` without the wait; see there). With a captioner the image
    rows are copied back first: its captions, which the text forwards embed, need them."""
    if not samples:  # every record of the batch skipped: nothing to embed
        return QueuedBatch(teachers, [], {}, {}, [])
    img_rows: dict[str, torch.Tensor] = {}
    for teacher in teachers:
        if images and teacher.has_images:
            x = crops[teacher.image_size] if crops is not None else \
                torch.cat([s["crops"][teacher.image_size] for s in samples])
            img_rows[teacher.name] = _forward(teacher.encode_images, x)
    if captioner is not None:
        img_rows = {name: rows.cpu() for name, rows in img_rows.items()}
        rows = img_rows[captioner.teacher]
        caption_samples(captioner, samples, rows.numpy().reshape(len(samples), -1, rows.shape[-1]), n_captions)
    counts = [len(s["texts"]) - 1 for s in samples]
    texts = [s["texts"][0] for s in samples] + [t for s in samples for t in s["texts"][1:]]
    txt_rows = {}
    for teacher in teachers:
        tokens = _batch_tokens(samples, teacher.name)
        txt_rows[teacher.name] = _forward(teacher.encode_texts, texts) if tokens is None else \
            _forward(teacher.encode_tokens, tokens)
    return QueuedBatch(teachers, samples, img_rows, txt_rows, counts)


def embed_batch(teachers, samples: list[dict], images: bool, crops: dict | None = None,
                captioner=None, n_captions: int | None = None) -> list[dict]:
    """Teacher forwards for a batch: per sample {teacher: {'img': (K,D), 'syn': (S,D), 'txt': (D,)}}.

    ``crops``: the samples' crops already concatenated per teacher size ({size: (B*K, 1, S, S)},
    from :func:`collate_prepared`); default: each sample's own ``sample["crops"][size]`` (K, 1, S, S).
    ``captioner`` (with ``n_captions`` per view): captions the samples from the image rows first.
    """
    return queue_batch(teachers, samples, images, crops, captioner, n_captions).result()


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
