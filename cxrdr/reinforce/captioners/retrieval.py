"""``retrieval:BANK``: each stored view's captions are the S bank sentences nearest its image embedding.

The build's image-text teacher (the first ``clip`` teacher, or ``?teacher=NAME``) embeds the bank once
with its text tower (``bank``); each view's image embedding (the very row stored in the shard) ranks the
bank by cosine, ties broken by bank order, so the captions are a pure function of the stored embeddings
and the bank. A record without a report gets as its text the S sentences nearest the mean of its views'
embeddings, joined (``text_source: retrieved``). ``?max_sentences=N`` keeps the bank's first N sentences.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cxrdr.common.errors import UserError
from cxrdr.reinforce.captioners.bank import SentenceBank, embed_sentences, file_sentences, train_split_sentences

CAPTION_SOURCE = "retrieved"
_OPTIONS = ("teacher", "max_sentences")


class RetrievalCaptioner:
    name = "retrieval"
    caption_source = CAPTION_SOURCE

    def __init__(self, spec: str, bank: SentenceBank):
        self.spec, self.bank, self.teacher = spec, bank, bank.teacher
        self._bank_t = np.ascontiguousarray(bank.embeddings.T)  # (D, N): one matmul a batch of views

    def describe(self) -> dict:
        return {"name": self.name, "spec": self.spec, "caption_source": self.caption_source,
                "teacher": self.teacher, "bank": self.bank.describe()}

    def write(self, out_dir: Path) -> None:
        self.bank.write(out_dir)

    def retrieve(self, queries: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(M, n) bank indexes and cosines of the ``n`` sentences nearest each of ``queries`` (M, D),
        best first; equal cosines in bank order."""
        sims = np.asarray(queries, dtype=np.float32) @ self._bank_t
        top = np.argpartition(-sims, n - 1, axis=1)[:, :n] if n < sims.shape[1] else \
            np.tile(np.arange(sims.shape[1]), (sims.shape[0], 1))
        scores = np.take_along_axis(sims, top, axis=1)
        order = np.lexsort((top, -scores), axis=1)  # by score descending, then bank index
        top, scores = np.take_along_axis(top, order, axis=1), np.take_along_axis(scores, order, axis=1)
        return top, scores

    def view_captions(self, image_rows: np.ndarray, n: int) -> list[list[tuple[str, float, int]]]:
        top, scores = self.retrieve(image_rows, n)
        return [[(self.bank.sentences[i], float(s), int(i)) for i, s in zip(ids, row)]
                for ids, row in zip(top, scores)]

    def report_for(self, image_rows: np.ndarray, n: int) -> str:
        mean = np.asarray(image_rows, dtype=np.float32).mean(axis=0, keepdims=True)
        mean /= max(float(np.linalg.norm(mean)), 1e-12)
        top, _ = self.retrieve(mean, n)
        return " ".join(self.bank.sentences[i] for i in top[0])


def caption_teacher(teachers: list, wanted: str | None, spec: str):
    """The image-text teacher the captioner reads (one-line UserError when there is none)."""
    clip = [t for t in teachers if t.has_images]
    if not clip:
        raise UserError(f"--captioner {spec} needs an image-text teacher (kind clip: random:tiny, openclip:..., "
                        f"ckpt:..., biomedclip); --teachers has only text teachers "
                        f"({', '.join(t.spec for t in teachers)})")
    if wanted is None:
        return clip[0]
    for t in clip:
        if t.name == wanted:
            return t
    raise UserError(f"--captioner {spec}: teacher={wanted} is not an image-text teacher of this build "
                    f"({', '.join(t.name for t in clip)})")


def load_retrieval_captioner(arg: str, spec: str, teachers: list, records: list,
                             options: dict | None = None) -> RetrievalCaptioner:
    options = dict(options or {})
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise UserError(f"--captioner {spec}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(_OPTIONS)}")
    teacher = caption_teacher(teachers, options.get("teacher"), spec)
    if arg == "train":
        sentences, provenance = train_split_sentences(records)
    else:
        sentences, provenance = file_sentences(Path(arg).expanduser())
    if "max_sentences" in options:
        try:
            limit = int(options["max_sentences"])
        except ValueError:
            raise UserError(f"--captioner {spec}: max_sentences must be an integer") from None
        provenance["max_sentences"] = limit
        sentences = sentences[:max(1, limit)]
    if not sentences:
        raise UserError(f"--captioner {spec}: the sentence bank is empty ({provenance}); the source's train "
                        f"records hold no report text: give a report file, e.g. retrieval:reports.jsonl")
    bank = SentenceBank(sentences, embed_sentences(teacher, sentences), teacher.name, teacher.fingerprint,
                        {"source": "train" if arg == "train" else "file", **provenance})
    return RetrievalCaptioner(spec, bank)
