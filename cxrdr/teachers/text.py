"""Text-only teachers: a sentence-transformer (BERT-family) embedding texts by mean pooling.

``text:minilm`` uses the all-MiniLM-L6-v2 weights shipped in a package (``cxrdr.common.pretrained``);
``text:PATH`` any local sentence-transformer / HF encoder directory. We use transformers
directly (AutoModel + AutoTokenizer + attention-mask mean pooling, exactly what
sentence-transformers' Pooling(mean) does) to avoid another framework in the loop.
Their text-text affinities are soft targets for the student's text side.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cxrdr.common.pretrained import minilm_path

from .base import Teacher, TeacherError, file_safe_name, weights_fingerprint

DEFAULT_CONTEXT_LENGTH = 256
# Texts per forward, grouped by token length: large enough to keep the matrix products efficient.
LENGTH_GROUP = 32
# all-MiniLM-L6-v2 was trained with MultipleNegativesRankingLoss, scale 20: its own "logit scale".
SENTENCE_TRANSFORMER_SCALE = 20.0


@dataclass
class TextTeacher(Teacher):
    model: Any = field(default=None, repr=False)
    tokenizer: Any = field(default=None, repr=False)

    def _encode_texts(self, texts: list[str]) -> torch.Tensor:
        # A build's batch mixes long reports with short captions: padding all to the longest wastes
        # most of the forward. Texts of similar token length go through together instead (what
        # sentence-transformers' encode does), and the rows come back in the order given.
        ids = self.tokenizer(texts, truncation=True, max_length=self.context_length)["input_ids"]
        order = sorted(range(len(texts)), key=lambda i: len(ids[i]))
        out = [None] * len(texts)
        for start in range(0, len(order), LENGTH_GROUP):
            group = order[start:start + LENGTH_GROUP]
            batch = self.tokenizer.pad({"input_ids": [ids[i] for i in group]}, return_tensors="pt").to(self.device)
            hidden = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            for i, row in zip(group, (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)):
                out[i] = row
        return torch.stack(out)


def _context_length(model_dir: Path, model, tokenizer) -> int:
    """sentence_bert_config.json's max_seq_length, else 256, never beyond the position table."""
    length = DEFAULT_CONTEXT_LENGTH
    st_cfg = model_dir / "sentence_bert_config.json"
    if st_cfg.is_file():
        length = int(json.loads(st_cfg.read_text()).get("max_seq_length", length))
    limit = getattr(model.config, "max_position_embeddings", None)
    return min(length, limit) if limit else length


def load_text_teacher(arg: str, spec: str, device: str = "cpu", model_cache: str | None = None,
                      options: dict | None = None) -> TextTeacher:
    from transformers import AutoModel, AutoTokenizer

    options = options or {}
    if arg == "minilm":
        try:
            model_dir, name = minilm_path(), "minilm"
        except FileNotFoundError as err:
            raise TeacherError(f"teacher {spec!r}: {err}") from err
    else:
        model_dir = Path(arg).expanduser()
        if not model_dir.is_dir() and model_cache and (Path(model_cache) / arg).is_dir():
            model_dir = Path(model_cache) / arg
        if not model_dir.is_dir() or not (model_dir / "config.json").is_file():
            looked = dict.fromkeys([str(model_dir)] + ([str(Path(model_cache) / arg)] if model_cache else []))
            raise TeacherError(f"teacher {spec!r}: no local text model (config.json + weights) at "
                               f"{', '.join(looked)}; give a sentence-transformer/BERT directory or use text:minilm")
        name = "text-" + file_safe_name(model_dir.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        model = AutoModel.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as err:
        raise TeacherError(f"teacher {spec!r}: cannot load text model from {model_dir}: "
                           f"{str(err).splitlines()[0]}") from err
    model.eval().to(device)
    context_length = int(options.get("context_length", _context_length(model_dir, model, tokenizer)))
    embed_dim = int(model.config.hidden_size)
    return TextTeacher(
        name=name, spec=spec, kind="text", embed_dim=embed_dim,
        logit_scale=SENTENCE_TRANSFORMER_SCALE,
        context_length=context_length, fingerprint=weights_fingerprint(model), device=str(device),
        notes={"model_dir": str(model_dir), "pooling": "mean"}, model=model, tokenizer=tokenizer)
