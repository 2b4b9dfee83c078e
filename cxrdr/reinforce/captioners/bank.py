"""The sentence bank of the retrieval captioner: which sentences, their text-tower embeddings, on disk.

Sentences come from report text only, never from text a build composed (``text_source`` ``labels`` or
``retrieved``), split with the report splitter and de-duplicated in first-seen order:

- ``train``: the reports of the build's own **train** records. Val and test reports never enter: a val
  or test image would otherwise retrieve sentences of its own report.
- a file: ``.jsonl`` (``findings`` + ``impression``, else ``report``, ``text`` or ``sentence`` per row;
  a row with a ``split`` other than train is left out, so a report set's own val/test stays unseen) or
  ``.txt`` (one report or sentence per line).

On disk beside the shards (``caption-bank/``, read with ``np.load(allow_pickle=False)``):
``sentences.npy`` (N unicode strings), ``embeddings.npy`` ((N, D) float32, L2-normalised, the captioner
teacher's text tower) and ``bank.json`` (what :meth:`SentenceBank.describe` says).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cxrdr.common.atomic import replacing, write_json_atomic
from cxrdr.common.errors import UserError
from cxrdr.reinforce.captions.from_labels import TEXT_SOURCE_REPORT
from cxrdr.reinforce.captions.report import split_sentences, usable_sentence
from cxrdr.reinforce.sources.common import normalize_split, read_jsonl

BANK_DIR = "caption-bank"
SENTENCES_FILE = "sentences.npy"
EMBEDDINGS_FILE = "embeddings.npy"
BANK_JSON = "bank.json"
EMBED_CHUNK = 256  # sentences per text forward


def report_sentences(findings: str, impression: str, report: str) -> list[str]:
    """Usable sentences of one report (findings then impression; the report when both are empty)."""
    parts = [p for p in (findings, impression) if (p or "").strip()] or [report or ""]
    return [s for part in parts for s in split_sentences(part) if usable_sentence(s)]


def _distinct(sentences) -> list[str]:
    return list(dict.fromkeys(s for s in sentences if s))


def train_split_sentences(records) -> tuple[list[str], dict]:
    """(sentences, provenance) of the train records' own reports (see the module docstring)."""
    used = [r for r in records if r.split == "train"
            and (r.extra or {}).get("text_source", TEXT_SOURCE_REPORT) == TEXT_SOURCE_REPORT]
    sentences = _distinct(s for r in used for s in report_sentences(r.findings, r.impression, r.report))
    left_out = sum(1 for r in records if r.split != "train")
    return sentences, {"from": "source train split", "reports": len(used),
                       "left_out_not_train": left_out,
                       "left_out_composed": sum(1 for r in records if r.split == "train") - len(used)}


def file_sentences(path: Path) -> tuple[list[str], dict]:
    """(sentences, provenance) of a report file (.jsonl or .txt; see the module docstring)."""
    if not path.is_file():
        raise UserError(f"sentence bank file not found: {path}")
    if path.suffix == ".txt":
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        sentences = _distinct(s for line in lines for s in report_sentences("", "", line))
        return sentences, {"from": str(path), "reports": len(lines), "left_out_not_train": 0}
    if path.suffix != ".jsonl":
        raise UserError(f"sentence bank file {path} is neither .jsonl nor .txt")
    found, reports, left_out = [], 0, 0
    for _, row in read_jsonl(path):
        if not isinstance(row, dict):
            continue  # a bad line (read_jsonl's Skip): nothing to take from it
        if "split" in row and normalize_split(row.get("split")) != "train":
            left_out += 1
            continue
        text = {k: str(row.get(k) or "") for k in ("findings", "impression", "report", "text", "sentence")}
        report = text["report"] or text["text"] or text["sentence"]
        sentences = report_sentences(text["findings"], text["impression"], report)
        reports += bool(sentences)
        found += sentences
    return _distinct(found), {"from": str(path), "reports": reports, "left_out_not_train": left_out}


@dataclass
class SentenceBank:
    """N sentences and their (N, D) L2-normalised embeddings by ``teacher``'s text tower."""

    sentences: list[str]
    embeddings: np.ndarray
    teacher: str
    fingerprint: str
    provenance: dict = field(default_factory=dict)

    @property
    def sha1(self) -> str:
        return hashlib.sha1("\n".join(self.sentences).encode("utf-8")).hexdigest()

    def describe(self) -> dict:
        return {"dir": BANK_DIR, "sentences": len(self.sentences), "dim": int(self.embeddings.shape[1]),
                "sentences_sha1": self.sha1, "teacher": self.teacher, "teacher_fingerprint": self.fingerprint,
                **self.provenance}

    def write(self, out_dir: Path) -> Path:
        """``caption-bank/`` under ``out_dir``, each file through a temp name + rename."""
        folder = Path(out_dir) / BANK_DIR
        folder.mkdir(parents=True, exist_ok=True)
        _save_npy(folder / SENTENCES_FILE, np.array(self.sentences, dtype=str))
        _save_npy(folder / EMBEDDINGS_FILE, self.embeddings.astype(np.float32))
        write_json_atomic(folder / BANK_JSON, self.describe(), fsync=False)
        return folder


def _save_npy(path: Path, array: np.ndarray) -> None:
    with replacing(path) as tmp, open(tmp, "wb") as fh:
        np.save(fh, array, allow_pickle=False)


def embed_sentences(teacher, sentences: list[str]) -> np.ndarray:
    """(N, D) float32 text embeddings of ``sentences`` (L2-normalised by the teacher)."""
    chunks = [teacher.encode_texts(sentences[i:i + EMBED_CHUNK]).numpy()
              for i in range(0, len(sentences), EMBED_CHUNK)]
    return np.concatenate(chunks).astype(np.float32)


def read_bank(out_dir: Path) -> tuple[list[str], np.ndarray, dict]:
    """(sentences, embeddings, bank.json) of a build's ``caption-bank/`` (no pickle)."""
    folder = Path(out_dir) / BANK_DIR
    sentences = np.load(folder / SENTENCES_FILE, allow_pickle=False)
    embeddings = np.load(folder / EMBEDDINGS_FILE, allow_pickle=False)
    return [str(s) for s in sentences], embeddings, json.loads((folder / BANK_JSON).read_text(encoding="utf-8"))
