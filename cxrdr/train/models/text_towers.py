"""Text towers (transformers BERT family) and their tokenizers, all loaded without network.

- ``tiny``: a small BertModel from a BertConfig, with a built-in WordPiece vocabulary generated in
  code (radiology words + characters) and written deterministically to a cache file.
- ``minilm``: all-MiniLM-L6-v2 from the ``all_minilm_l6_v2`` package (extracted by
  ``cxrdr.common.pretrained.minilm_path()``, shared with the ``text:minilm`` teacher).
- a local directory holding an HF model (config.json + weights + tokenizer files).
- ``biomedclip``: the PubMedBERT text tower of an open_clip BiomedCLIP snapshot given as ``init_from``.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import string
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel, BertTokenizerFast
from transformers.utils import logging as hf_logging

from cxrdr.common.atomic import write_text_atomic
from cxrdr.common.pretrained import cache_root, minilm_path
from cxrdr.train.models.packed_text import encode_packed, packed_layer, packing_index, supports_packing
from cxrdr.train.models.init import create_open_clip

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# Common report words; includes the phantom vocabulary (findings, anatomy, severity, negation).
RADIOLOGY_WORDS = """
a an the and or of in on at to with without within from for by as is are was were be been has have
had no not none neither nor any there this that these those it its which who than then also but
however may might could can likely unlikely possible possibly probable probably suggest suggests
suggestive concerning consistent compatible representing represent due secondary given
evidence sign signs finding findings impression comparison compared prior previous interval
unchanged stable new newly improved improving worsened worsening increased increasing decreased
decreasing resolved resolution persistent persists again seen noted demonstrated identified
present absent clear clearly well otherwise remain remains remaining since today study exam
examination radiograph radiographs view views frontal lateral pa ap portable upright supine semi
erect chest thorax thoracic lung lungs pulmonary lobe lobes lobar zone zones field fields
segment segmental left right bilateral bilaterally unilateral upper lower mid middle base bases
basal basilar apex apices apical hilar hila hilum perihilar central peripheral lingula
lingular retrocardiac costophrenic angle angles hemithorax hemidiaphragm diaphragm
diaphragmatic mediastinum mediastinal cardiac heart cardio silhouette contour contours size
normal abnormal enlarged enlargement borderline top upper-normal cardiomegaly cardiomediastinal
aorta aortic arch tortuous tortuosity calcified calcification calcifications knob trachea
midline deviation shift pleural pleura effusion effusions fluid thickening pneumothorax
pneumothoraces pneumomediastinum air airspace airspaces disease opacity opacities opacification
opacified density densities consolidation consolidations consolidative infiltrate infiltrates
infiltration atelectasis atelectatic collapse volume loss scarring scar fibrosis fibrotic
edema oedema congestion vascular vasculature venous pressure interstitial alveolar markings
prominence prominent engorgement cephalization kerley nodule nodules nodular mass masses
lesion lesions granuloma granulomas pneumonia infection aspiration emphysema hyperinflation
hyperinflated hyperexpanded copd bronchiectasis bronchial wall cavity cavitary lymphadenopathy
adenopathy fracture fractures rib ribs clavicle spine vertebral degenerative osseous bony
structures soft tissue tissues subcutaneous emphysema hernia free gas subdiaphragmatic
line lines tube tubes wire wires catheter catheters device devices support pacemaker pacer
lead leads defibrillator icd picc central venous ij internal jugular subclavian endotracheal
et enteric ng nasogastric og orogastric feeding chest drain drains sternotomy median clips
surgical postoperative post status tip terminates terminating projects projecting overlying
positioned position placement appropriate appropriately satisfactory malpositioned removed
removal small moderate large mild mildly severe severely minimal minimally trace tiny
slight slightly marked markedly extensive diffuse diffusely focal focally patchy
patchy streaky linear plate-like platelike subsegmental multifocal scattered
round rounded ill-defined well-defined irregular smooth sharp blunting blunted
acute chronic cardiopulmonary process processes abnormality abnormalities cardiac_abnormality
pleural_abnormality parenchymal_opacity lung_opacity pleural_effusion support_device
enlarged_cardiac_silhouette fracture lesion category associated associated_with has_location
has_severity is_a location severity right_hemithorax left_hemithorax left_lung_base
right_lung_base right_upper_zone left_upper_zone right_mid_zone left_mid_zone right_lower_zone
left_lower_zone bilateral_perihilar cm mm measuring measures approximately about
patient patients history clinical indication question rule out evaluate evaluation
followup follow up recommend recommended recommendation correlation ct further imaging
limited technique low lung volumes inspiration poor rotated rotation motion artifact
findings: impression: comparison: indication: technique: one two three four five
first second third fourth level above below near adjacent along between both each either
side sided side-by-side more less most least much many few several some other only
limits displaced intrathoracic single hazy haziness band over suggested stomach cardiothoracic ratio
meniscus moderately visible visceral courses into carina bibasilar superior vena cava svc monitoring place ecg
overlie ray shows regions hemithoraces active unremarkable
""".split()


@functools.lru_cache(maxsize=1)  # ~3 ms to make, asked twice for every tiny text tower built
def _vocab_tokens() -> tuple[str, ...]:
    """Deterministic vocabulary: specials, characters (+ '##' continuations), then words and '##' suffixes."""
    chars = list(string.ascii_lowercase + string.digits + string.punctuation)
    suffixes = ["s", "es", "ed", "ing", "ly", "al", "ic", "ity", "ion", "ions", "ment", "ness", "er", "ers",
                "ate", "ated", "ial", "ary", "ous", "ive", "ize", "ized", "ia", "osis", "itis", "ectomy"]
    words: list[str] = []
    for w in RADIOLOGY_WORDS:
        for piece in w.replace("_", " _ ").replace("-", " - ").replace(":", " : ").split():
            if piece not in words:
                words.append(piece)
    tokens = SPECIALS + chars + ["##" + c for c in string.ascii_lowercase + string.digits]
    tokens += ["##" + s for s in suffixes]
    tokens += [w for w in words if w not in tokens]
    return tuple(dict.fromkeys(tokens))


def tiny_vocab_file() -> Path:
    """Write the built-in vocabulary once (content-addressed name, atomic) and return its path."""
    text = "\n".join(_vocab_tokens()) + "\n"
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    path = cache_root() / f"tiny-vocab-{digest}.txt"
    if not path.is_file():
        write_text_atomic(path, text)
    return path


TOKEN_CACHE = 1 << 16  # texts whose ids a TextTokenizer keeps (~25 MB at 64 tokens), per process


def bucket_length(used: int, context_length: int, bucket: int) -> int:
    """The padded length of a batch whose longest text has ``used`` tokens: the next multiple of
    ``bucket``, at most ``context_length``."""
    bucket = max(1, int(bucket))
    return min(int(context_length), max(bucket, -(-int(used) // bucket) * bucket))


def default_bucket(context_length: int) -> int:
    """Tokens per padding bucket: a quarter of the context (at least 8), so a batch takes one of four
    lengths. Why buckets and not the longest text: a compiled step meets only those few shapes, and a
    short report still skips most of the context on CPU."""
    return max(8, int(context_length) // 4)


def trim_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 bucket: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the trailing columns that no row of the batch uses, keeping a multiple of ``bucket``.

    The attention mask already hides those columns from every real token, so the states of the real
    tokens are unchanged (to float rounding). It reads the mask's values, so it runs where the
    tokens are made (on the CPU, in the tokenizer), never inside the step on a GPU: there it would be
    a host sync (and a graph break under torch.compile). Left-padded batches are returned as given.
    """
    used = attention_mask.bool().any(0).nonzero()
    length = bucket_length(int(used.max()) + 1 if used.numel() else 1, input_ids.shape[1], bucket)
    if length >= input_ids.shape[1]:
        return input_ids, attention_mask
    return input_ids[:, :length], attention_mask[:, :length]


class TextTokenizer:
    """Wraps an HF tokenizer: list[str] -> {'input_ids', 'attention_mask'} LongTensors (B, L) and
    'token_index' (T,), the flat positions of the real tokens (``packed_text.packing_index``), which lets the
    text tower skip the padding on a GPU without reading the mask there.

    L is the batch's longest text rounded up to a multiple of ``bucket`` tokens (``default_bucket``:
    a quarter of the context length), at most ``context_length``; ``bucket=context_length`` pads
    every batch to the fixed context length (one shape for ``torch.compile``, ``fixed_length``).
    Tokenise whole batches (the loaders' collate does), not single texts that are stacked later.
    Picklable (holds the HF fast tokenizer and the tokens of the texts it has met, ``_tokens``: a run meets
    its reports and captions every epoch, and the HF call was ~5 ms of each demo batch's 32 reports;
    each loader worker keeps its own).
    """

    def __init__(self, hf_tokenizer, context_length: int, bucket: int | None = None):
        self.tokenizer = hf_tokenizer
        self.context_length = int(context_length)
        self.bucket = default_bucket(self.context_length) if bucket is None else int(bucket)
        self._tokens: dict[str, np.ndarray] = {}  # text -> its truncated ids, at most TOKEN_CACHE texts

    def fixed_length(self) -> "TextTokenizer":
        """The same tokenizer, padding every batch to the context length."""
        return TextTokenizer(self.tokenizer, self.context_length, self.context_length)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def word_ids(self, words) -> list[int]:
        """Ids of the words that are single tokens of this vocabulary (others are left out)."""
        unknown = self.tokenizer.unk_token_id
        ids = [self.tokenizer.convert_tokens_to_ids(w) for w in words]
        return sorted({i for i in ids if i is not None and i != unknown})

    def __call__(self, texts: list[str] | str) -> dict[str, torch.Tensor]:
        texts = [texts] if isinstance(texts, str) else list(texts)
        if self.tokenizer.padding_side == "right" and self.tokenizer.pad_token_id is not None:
            ids, mask = self._right_padded(texts)
        else:
            enc = self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.context_length,
                                 return_tensors="pt")
            ids, mask = enc["input_ids"].long(), enc["attention_mask"].long()
        ids, mask = trim_padding(ids, mask, self.bucket)
        return {"input_ids": ids, "attention_mask": mask, "token_index": packing_index(mask)}

    def _right_padded(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), (B, context_length): what the HF call with padding="max_length" returns,
        from each text's ids tokenized once (the texts not met before in one HF call)."""
        new = [t for t in dict.fromkeys(texts) if t not in self._tokens]
        if new:
            if len(self._tokens) + len(new) > TOKEN_CACHE:
                self._tokens.clear()
            rows = self.tokenizer(new, truncation=True, max_length=self.context_length)["input_ids"]
            self._tokens.update((text, np.asarray(row, dtype=np.int64)) for text, row in zip(new, rows))
        ids = np.full((len(texts), self.context_length), self.tokenizer.pad_token_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, text in enumerate(texts):
            row = self._tokens[text]
            ids[i, :len(row)], mask[i, :len(row)] = row, 1
        return torch.from_numpy(ids), torch.from_numpy(mask)


def build_tokenizer(text_tower: str, context_length: int, init_from: str | None = None) -> TextTokenizer:
    """The tokenizer of a text tower, without building the model (used by data loaders too)."""
    if text_tower == "tiny":
        tok = _tiny_tokenizer(BertTokenizerFast)
    elif text_tower == "minilm":
        tok = AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)
    elif text_tower == "biomedclip":
        tok = _biomedclip_parts(init_from)[1]
    else:
        tok = AutoTokenizer.from_pretrained(str(_local_model_dir(text_tower)), local_files_only=True)
    return TextTokenizer(tok, context_length)


def _tiny_tokenizer(cls):
    """BertTokenizerFast over the built-in vocab file (transformers 5 takes a vocab dict, 4.x a file)."""
    path = tiny_vocab_file()
    if "vocab" in inspect.signature(cls.__init__).parameters:
        tokens = path.read_text().splitlines()
        return cls(vocab={t: i for i, t in enumerate(tokens)}, do_lower_case=True)
    return cls(vocab_file=str(path), do_lower_case=True)


def _local_model_dir(path: str) -> Path:
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ValueError(f"text_tower {path!r}: expected 'tiny', 'minilm', 'biomedclip' or a local HF model "
                         f"directory with config.json (not found at {p / 'config.json'})")
    return p


def _biomedclip_parts(init_from: str | None):
    """(HF text transformer, HF tokenizer) of a local open_clip BiomedCLIP snapshot."""
    if not init_from:
        raise ValueError("text_tower 'biomedclip' needs init_from: a local BiomedCLIP open_clip snapshot dir")
    model, tokenizer = create_open_clip(init_from)
    text = getattr(model, "text", None)
    if text is None or not hasattr(text, "transformer"):
        raise ValueError(f"init_from {init_from!r}: open_clip model has no HF text tower (text.transformer)")
    hf_tok = getattr(tokenizer, "tokenizer", None)
    if hf_tok is None:
        raise ValueError(f"init_from {init_from!r}: open_clip tokenizer is not an HF tokenizer")
    return text.transformer, hf_tok


class HFTextTower(nn.Module):
    """A BERT-family encoder: (input_ids, attention_mask) -> token states (B, L, d) and a pooled (B, d)."""

    def __init__(self, model: nn.Module, pool: str):
        super().__init__()
        self.model = model
        self.pool = pool
        self.width = int(model.config.hidden_size)
        self.depth = int(model.config.num_hidden_layers)
        # run on the real tokens only where a packing index is at hand (packed_text); False: always padded
        self.pack = supports_packing(model)
        self.packed_layer = packed_layer  # compiling.compile_blocks puts its torch.compile here
        self.block_graphs = None  # --cuda-graphs-text: the image tower's BlockGraphs (models/block_graphs.py)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_layer: int | None = None,
                token_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token states, pooled). The token states are those after ``token_layer`` encoder layers
        (0: the embedding layer's output; None: the last layer); the pooled vector is always the last's.
        ``token_index``: the batch's ``packing_index`` (``TextTokenizer`` adds it), to skip the padding; on
        the CPU it is read from the mask where not given (no sync there). Padded token states are zeros then."""
        if token_layer is not None and not 0 <= token_layer <= self.depth:
            raise ValueError(f"token_layer must be in 0..{self.depth}, got {token_layer}")
        if self.pack and token_index is None and attention_mask.device.type == "cpu" \
                and not torch.compiler.is_compiling():
            token_index = packing_index(attention_mask)
        if self.pack and token_index is not None:
            tokens, layer_tokens = encode_packed(self.model, input_ids, attention_mask,
                                                 token_index.to(input_ids.device), token_layer, self.packed_layer,
                                                 self.block_graphs)
        else:
            wanted = token_layer is not None and token_layer < self.depth
            out = self.model(input_ids=input_ids, attention_mask=self._attention_bias(attention_mask),
                             output_hidden_states=wanted)
            tokens = out.last_hidden_state
            layer_tokens = out.hidden_states[token_layer] if wanted else tokens
        if self.pool == "mean":
            m = attention_mask.unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * m).sum(1) / m.sum(1).clamp_min(1.0)
        else:
            pooled = tokens[:, 0]
        return layer_tokens, pooled

    def _attention_bias(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """The padding mask as the 4D mask the encoder's attention takes, made here so transformers
        does not make it: for SDPA it first asks whether any token is padded (``mask.all()``), a host
        sync every text forward. The same values it would build: SDPA a boolean (B, 1, L, L) "may
        attend", eager an additive (B, 1, L, L) bias (0 or the dtype's minimum)."""
        b, length = attention_mask.shape
        keep = attention_mask.bool()[:, None, None, :].expand(b, 1, length, length)
        if getattr(self.model.config, "_attn_implementation", "eager") == "sdpa":
            return keep
        dtype = self.model.get_input_embeddings().weight.dtype
        return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        # transformers >= 5 renamed gradient_checkpointing_* to activation_checkpointing_*
        m = self.model
        if not enable:
            (getattr(m, "activation_checkpointing_disable", None) or m.gradient_checkpointing_disable)()
        elif hasattr(m, "activation_checkpointing_enable"):
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def group_matcher(self, coarse: bool = False) -> dict:
        """timm-format parameter groups of the encoder (as ``ImageTower.group_matcher``): embeddings
        layer 0, encoder layer i layer i + 1, anything after (pooler) layer depth + 1."""
        return dict(stem=r"^embeddings", blocks=[(r"^encoder\.layer\.(\d+)", None)])

    def last_layer(self) -> nn.Module:
        return self.model.encoder.layer[-1]


def _quiet_from_pretrained(cls, path: Path) -> nn.Module:
    """from_pretrained without the pooler (unused; DDP dislikes unused parameters) and without the
    load report about the dropped pooler weights, in float32 whatever the checkpoint holds: a student
    keeps fp32 master weights (autocast does the bf16), and transformers 5 would otherwise keep a
    half-precision checkpoint's dtype."""
    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        try:
            model = cls.from_pretrained(str(path), local_files_only=True, add_pooling_layer=False)
        except TypeError:
            model = cls.from_pretrained(str(path), local_files_only=True)
        return model.float()
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def build_text_tower(text_tower: str, context_length: int, pool: str | None = None,
                     text_kwargs: dict | None = None, init_from: str | None = None) -> HFTextTower:
    if pool is None:
        pool = "mean" if text_tower == "minilm" else "cls"
    if text_tower == "tiny":
        vocab = len(_vocab_tokens())
        cfg = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=128, max_position_embeddings=max(64, int(context_length)))
        cfg.update(text_kwargs or {})
        model = BertModel(BertConfig(**cfg), add_pooling_layer=False)
    elif text_tower == "biomedclip":
        model = _biomedclip_parts(init_from)[0]
    else:
        path = minilm_path() if text_tower == "minilm" else _local_model_dir(text_tower)
        model = _quiet_from_pretrained(AutoModel, path)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and context_length > max_pos:
        raise ValueError(f"context_length {context_length} exceeds text tower {text_tower!r} max positions {max_pos}")
    return HFTextTower(model, pool)
