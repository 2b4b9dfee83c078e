"""Stream reinforced shards into training batches (and plain/eval views of the same shards).

One WebDataset pipeline over the shard folder written by ``reinforce build``:

    shard list (only the requested split's tars, from dataset.json)
      -> resampled (step-based training) or shuffled/ordered shard list
      -> split_by_node -> split_by_worker -> tar samples
      -> filter on the sample json's split -> sample shuffle buffer
      -> per-sample view (pick one stored augmentation or sample a fresh one) -> batched + collated in workers
         (the collate replays the batch's views together: the per-sample replay's bits, a third of its time)

Modes:
- ``reinforced``: pick one of the K stored augmentation parameter sets (at random, or
  ``epoch % K`` with ``pick='sequential'``), replay it with :func:`cxrdr.common.augment.replay` at the
  student's resolution, pick one of the S stored synthetic captions the same way, and carry the
  teachers' stored embeddings of exactly that crop and caption (plus the report's). This is
  MobileCLIP's B_real (aug image, report) and B_syn (aug image, synthetic caption).
- ``plain``: the same shards, no teacher embeddings, a fresh augmentation sampled from the
  dataset's own AugConfig with a per-sample RNG (:func:`sample_rng`), then replayed by the same function,
  so "reinforced vs plain" differs only in what the experiment compares.
- ``eval`` (:func:`make_eval_loader`): no shuffle, deterministic, the full stored image.

Tokenisation happens in the collate function inside the workers. Workers are forked on Linux;
the tokenizer callable is taken from the student (see :func:`student_tokenizer`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import webdataset as wds
from torch.utils.data import DataLoader

from cxrdr.common import augment
from cxrdr.common.shards import Sample, decode_sample, read_dataset_info
from cxrdr.train.integrity import CheckedTarSamples, CorruptPolicy, Guarded, check_embedding

MODES = ("reinforced", "plain")
PICKS = ("random", "sequential")


# --------------------------------------------------------------------------- dataset info




def split_shards(shards_dir: str | Path, split: str, info: dict | None = None) -> tuple[list[str], int]:
    """Tar paths holding ``split`` and their sample count (shards never mix splits)."""
    shards_dir = Path(shards_dir)
    info = info if info is not None else read_dataset_info(shards_dir)
    chosen = [e for e in info["shards"] if e["split"] == split]
    urls = [str(shards_dir / e["name"]) for e in chosen]
    count = sum(int(e["samples"]) for e in chosen)
    missing = [u for u in urls if not Path(u).is_file()]
    if missing:
        raise FileNotFoundError(f"{missing[0]}: shard listed in dataset.json is missing")
    return urls, count


def teacher_names(info: dict) -> list[str]:
    return [t["name"] for t in info.get("teachers", [])]


def select_teachers(info: dict, names: str | list[str] | None) -> list[str]:
    """The shards' teachers, or the requested subset (error naming what the shards hold)."""
    available = teacher_names(info)
    if names is None or names == "" or names == []:
        return available
    wanted = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    unknown = [n for n in wanted if n not in available]
    if unknown:
        raise ValueError(f"teacher(s) {', '.join(unknown)} not in the shards; they hold: "
                         f"{', '.join(available) or 'none'}")
    return wanted


def teacher_scales(info: dict, names: list[str]) -> dict[str, float]:
    """Each teacher's logit scale as stored in dataset.json (default 100, CLIP's usual value)."""
    by_name = {t["name"]: t for t in info.get("teachers", [])}
    return {n: float(by_name.get(n, {}).get("logit_scale") or 100.0) for n in names}


def teacher_dims(info: dict, names: list[str]) -> dict[str, int]:
    """Each teacher's embedding width as stored in dataset.json (error naming a teacher without one)."""
    by_name = {t["name"]: t for t in info.get("teachers", [])}
    missing = [n for n in names if not by_name.get(n, {}).get("embed_dim")]
    if missing:
        raise ValueError(f"dataset.json records no embed_dim for teacher(s) {', '.join(missing)}")
    return {n: int(by_name[n]["embed_dim"]) for n in names}


# --------------------------------------------------------------------------- tokenizer


def student_tokenizer(student) -> Callable[[list[str]], dict]:
    """A picklable callable texts -> {input_ids, attention_mask} for the student's text tower.

    PatchIBStudent keeps its (picklable, fixed-length) TextTokenizer as ``.tokenizer``; we hand
    that to the workers rather than the bound ``tokenize`` method, which would drag the model along.
    """
    tokenizer = getattr(student, "tokenizer", None)
    return tokenizer if callable(tokenizer) else student.tokenize


# --------------------------------------------------------------------------- per-sample view


def sample_rng(seed: int, epoch: int, draw: int, key: str) -> np.random.Generator:
    """The RNG of one sample's view and caption in one epoch: a pure function of (seed, epoch, draw,
    key), so a stream resumed at any position picks what the uninterrupted stream picked, whatever
    process or worker reads the sample (``draw``: which copy, when a shard is read twice an epoch)."""
    return np.random.default_rng(augment.stable_seed("view", seed, epoch, draw, key))


@dataclass
class SampleView:
    """Turns one raw WebDataset sample (bytes per extension) into a training/eval example."""

    split: str
    image_size: int
    mode: str = "reinforced"
    teachers: list[str] = field(default_factory=list)
    pick: str = "random"
    epoch: int = 0
    seed: int = 0
    aug_config: augment.AugConfig | None = None
    teacher_image_size: int | None = None  # also return the crop at this size (online teacher)
    full_image: bool = False  # evaluation: whole stored image, no randomness
    return_boxes: bool = False
    aug_limit: int | None = None  # use only the first k of the K stored views (ablation of K)
    caption_sources: tuple | None = None  # use only captions of these sources (rdf, normal, report)
    # the loaders' views: "image" (and "teacher_image") as PendingView, replayed by the collate with the rest of
    # the batch (augment.replay_each: the same bits as one at a time, a third of the time)
    replay_in_collate: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"unknown data mode {self.mode!r}; expected one of {MODES}")
        if self.pick not in PICKS:
            raise ValueError(f"unknown pick {self.pick!r}; expected one of {PICKS}")

    def _index(self, n: int, rng: np.random.Generator, epoch: int) -> int:
        if n <= 0:
            raise ValueError("sample has no stored augmentations/captions to pick from")
        if self.pick == "sequential":
            return epoch % n
        return int(rng.integers(n))

    def _caption(self, captions: list, report: str, rng: np.random.Generator,
                 epoch: int = 0, candidates: list[int] | None = None) -> tuple[int, str]:
        """One stored caption (its index into the stored rows); a sample with none of the wanted
        sources falls back to its report (index -1: the report's own embedding). ``candidates``: the
        caption indexes to pick from (a captioner build's captions of the picked view), default all."""
        indexes = range(len(captions)) if candidates is None else candidates
        usable = [i for i in indexes
                  if self.caption_sources is None or captions[i].get("source") in self.caption_sources]
        if not usable:
            return -1, report
        index = usable[self._index(len(usable), rng, epoch)]
        return index, captions[index]["text"]

    def keep(self, sample: Sample) -> bool:
        return sample.split == self.split

    def __call__(self, sample: Sample, epoch: int | None = None, draw: int = 0) -> dict:
        """The example of ``sample`` in ``epoch`` (default: the view's own epoch)."""
        meta, key = sample.meta, sample.key
        epoch = self.epoch if epoch is None else epoch
        rng = sample_rng(self.seed, epoch, draw, key)
        image = sample.image()
        width, height = image.size
        teachers_out: dict = {}
        if self.full_image:
            aug_index, params = -1, augment.full_image_params(width, height)
        elif self.mode == "plain":
            aug_index = -1
            params = augment.sample_params(rng, width, height, self.aug_config or augment.AugConfig())
        else:
            stored = meta.get("aug") or []
            aug_index = self._index(min(len(stored), self.aug_limit or len(stored)), rng, epoch)
            params = stored[aug_index]
        captions = meta.get("captions") or []
        if self.full_image or not captions:
            caption_index = -1
            caption = sample.report
        else:
            # A captioner build (meta caption_views) captioned each stored view: the replayed view's own
            # captions. A fresh view (plain mode) has none of its own: any caption, as before.
            views = meta.get("caption_views")
            candidates = views[aug_index] if views and aug_index >= 0 else None
            caption_index, caption = self._caption(captions, sample.report, rng, epoch, candidates)
        if self.mode == "reinforced" and not self.full_image:
            for name in self.teachers:
                teachers_out[name] = _teacher_rows(sample, name, aug_index, caption_index)
        view = self._view(image)
        out = {
            "key": key,
            "image": view(params, self.image_size),
            "report_text": sample.report,
            "caption_text": caption,
            "teacher": teachers_out,
            "labels": torch.tensor(meta.get("label_vector") or [0.0] * 14, dtype=torch.float32),
            "subject_id": str(meta.get("subject_id", "")),
            "study_id": str(meta.get("study_id", "")),
            "view": meta.get("view"),
            "aug_index": aug_index,
            "caption_index": caption_index,
            "aug_params": params,
            "image_wh": (width, height),
        }
        if self.teacher_image_size:
            out["teacher_image"] = view(params, self.teacher_image_size)
        if self.return_boxes:
            out["boxes"] = meta.get("boxes") or []
        return out

    def _view(self, image) -> Callable[[dict, int], "torch.Tensor | PendingView"]:
        """(params, size) -> the replayed view now, or with ``replay_in_collate`` the view to replay later."""
        if not self.replay_in_collate:
            return lambda params, size: augment.replay(image, params, size)
        pixels = augment.to_float_image(image)
        return lambda params, size: PendingView(pixels, augment.check_params(params), size)


@dataclass(frozen=True)
class PendingView:
    """A stored view the collate replays with the rest of its batch (:func:`replay_views`)."""

    pixels: torch.Tensor  # (1, H, W) float in [0, 1]: the decoded stored image
    params: dict
    size: int


def replay_views(views: list) -> torch.Tensor:
    """(B, 1, S, S): the examples' views stacked, replaying PendingViews together (all of one size)."""
    if not isinstance(views[0], PendingView):
        return torch.stack(views)
    return augment.replay_each([v.pixels for v in views], [v.params for v in views], views[0].size)


def _teacher_rows(sample: Sample, name: str, aug_index: int, caption_index: int) -> dict:
    parts = sample.embeddings(name) or {}
    img, syn, txt = parts.get("img"), parts.get("syn"), parts.get("txt")
    if txt is None or syn is None:
        raise ValueError(f"sample {sample.key!r}: teacher {name!r} embeddings missing")
    for part, values in (("img", img), ("syn", syn), ("txt", txt)):
        if values is not None:
            check_embedding(values, f"{name}.{part}")
    # No stored captions: the "caption" is the report itself, so is its embedding.
    syn_row = syn[caption_index] if caption_index >= 0 else txt.reshape(-1)
    return {
        "img": None if img is None else torch.from_numpy(np.ascontiguousarray(img[aug_index])),
        "syn": torch.from_numpy(np.ascontiguousarray(syn_row)),
        "txt": torch.from_numpy(np.ascontiguousarray(txt.reshape(-1))),
    }


# --------------------------------------------------------------------------- collate


@dataclass
class Collate:
    """List of examples -> one batch dict; tokenises reports and captions (runs in workers)."""

    tokenize: Callable[[list[str]], dict] | None

    def __call__(self, examples: list[dict]) -> dict:
        batch: dict = {
            "images": replay_views([e["image"] for e in examples]),
            "labels": torch.stack([e["labels"] for e in examples]),
            "aug_index": torch.tensor([e["aug_index"] for e in examples], dtype=torch.long),
            "caption_index": torch.tensor([e["caption_index"] for e in examples], dtype=torch.long),
        }
        for name in ("key", "report_text", "caption_text", "subject_id", "study_id", "view",
                     "aug_params", "image_wh"):
            batch[name] = [e[name] for e in examples]
        if "teacher_image" in examples[0]:
            batch["teacher_images"] = replay_views([e["teacher_image"] for e in examples])
        if "boxes" in examples[0]:
            batch["boxes"] = [e["boxes"] for e in examples]
        teachers: dict = {}
        for name in examples[0]["teacher"]:
            rows = [e["teacher"][name] for e in examples]
            teachers[name] = {part: (None if rows[0][part] is None
                                     else torch.stack([r[part] for r in rows]))
                              for part in ("img", "txt", "syn")}
        batch["teacher"] = teachers
        if self.tokenize is not None:
            report = self.tokenize(batch["report_text"])
            caption = self.tokenize(batch["caption_text"])
            batch["report_ids"], batch["report_mask"] = report["input_ids"], report["attention_mask"]
            batch["caption_ids"], batch["caption_mask"] = caption["input_ids"], caption["attention_mask"]
            if "token_index" in report:  # the real tokens' positions, for the packed text tower
                batch["report_token_index"] = report["token_index"]
                batch["caption_token_index"] = caption["token_index"]
        return batch


# --------------------------------------------------------------------------- loaders


def already_collated(batch: dict) -> dict:
    """The DataLoaders' collate_fn: a pipeline's batch is collated already. (Their default,
    ``default_convert``, walked every list and dict of it again, lists of parameter dicts included:
    ~2 ms a batch of 32 on the demo's CPU, in the step's own process with ``--workers 0``.)"""
    return batch


def shuffled_shards(urls: list[str], seed: int, epoch: int) -> list[str]:
    urls = list(urls)
    random.Random(augment.stable_seed("shards", seed, epoch)).shuffle(urls)
    return urls


def build_pipeline(urls: list[str], view: SampleView, batch_size: int, *, resampled: bool,
                   shuffle: bool, shuffle_buffer: int, seed: int, epoch: int,
                   collate: Collate, node_split: bool = True, drop_last: bool = True,
                   policy: CorruptPolicy | None = None):
    """The WebDataset pipeline (a torch IterableDataset yielding collated batches).
    ``policy``: what a damaged shard or sample does (default: stop naming shard and key)."""
    policy = policy or CorruptPolicy()

    if resampled:
        # Each worker (and rank: the seed includes rank*1000+worker) draws shards with
        # replacement forever; step-based training decides when to stop.
        stages = [wds.ResampledShards(urls, seed=augment.stable_seed("resample", seed, epoch) % (2**31),
                                      deterministic=True)]
    else:
        ordered = shuffled_shards(urls, seed, epoch) if shuffle else list(urls)
        stages = [wds.SimpleShardList(ordered)]
        if node_split:
            stages.append(wds.split_by_node)
        stages.append(wds.split_by_worker)
    stages.append(CheckedTarSamples(policy))
    stages.append(wds.map(Guarded(decode_sample, policy)))
    stages.append(wds.select(view.keep))
    if shuffle and shuffle_buffer > 1:
        stages.append(wds.detshuffle(shuffle_buffer, initial=min(shuffle_buffer, 64),
                                     seed=augment.stable_seed("samples", seed, epoch) % (2**31)))
    stages.append(wds.map(Guarded(view, policy)))  # None (a skipped sample) is dropped by map
    stages.append(wds.batched(batch_size, collation_fn=collate, partial=not drop_last))
    return wds.DataPipeline(*stages)


@dataclass
class TrainingParts:
    """What every training stream of a split needs: its tars, sample count, the teachers read,
    the per-sample view and the collate function."""

    urls: list[str]
    count: int
    info: dict
    teachers: list[str]
    view: SampleView
    collate: Collate


def training_parts(shards_dir: str | Path, split: str, student, *, mode: str = "reinforced", seed: int = 0,
                   pick: str = "random", epoch: int = 0, teachers: str | list[str] | None = None,
                   teacher_image_size: int | None = None, stored_embeddings: bool = True,
                   image_size: int | None = None, tokenize: Callable | None = None,
                   aug_limit: int | None = None, caption_sources: list[str] | None = None) -> TrainingParts:
    """The parts of a training stream of ``split`` (arguments as :func:`make_loader`'s)."""
    info = read_dataset_info(shards_dir)
    urls, count = split_shards(shards_dir, split, info)
    if not urls:
        raise ValueError(f"{shards_dir}: no shards hold split {split!r} "
                         f"(counts: {info.get('counts', {})})")
    if info.get("images") is False:
        raise ValueError(f"{shards_dir}: a text-only build (dataset.json images: false) cannot train "
                         f"an image-text student; rebuild with images")
    names = (select_teachers(info, teachers) if mode == "reinforced" and stored_embeddings else [])
    if mode == "reinforced" and stored_embeddings and not names:
        raise ValueError(f"{shards_dir}: reinforced mode needs teacher embeddings, but the shards "
                         f"hold none; use mode='plain'")
    aug_cfg = augment.AugConfig.from_json(info["aug"]) if info.get("aug") else augment.AugConfig()
    view = SampleView(split=split, image_size=int(image_size or student.image_size), mode=mode,
                      teachers=names, pick=pick, epoch=epoch, seed=seed, aug_config=aug_cfg,
                      teacher_image_size=teacher_image_size, aug_limit=aug_limit,
                      caption_sources=tuple(caption_sources) if caption_sources else None, replay_in_collate=True)
    collate = Collate(tokenize if tokenize is not None else
                      (student_tokenizer(student) if student is not None else None))
    return TrainingParts(urls, count, info, names, view, collate)


def make_loader(shards_dir: str | Path, split: str, student, batch_size: int, *,
                mode: str = "reinforced", workers: int = 0, resampled: bool = False,
                shuffle_buffer: int = 256, seed: int = 0, pick: str = "random", epoch: int = 0,
                teachers: str | list[str] | None = None, teacher_image_size: int | None = None,
                shuffle: bool = True, drop_last: bool = True, node_split: bool = True,
                image_size: int | None = None, tokenize: Callable | None = None,
                stored_embeddings: bool = True, on_corrupt: str = "stop", corrupt_log: str | None = None,
                aug_limit: int | None = None, caption_sources: list[str] | None = None):
    """A DataLoader of training batches from one split of a shard folder.

    ``student`` supplies ``image_size`` and ``tokenize`` (either can be overridden). With
    ``resampled=True`` the stream is endless (step-based training); otherwise it is one pass
    (``epoch`` seeds the shard/sample order and, with ``pick='sequential'``, which stored view
    and caption are used). ``teachers`` selects a subset of the shards' teachers (reinforced mode);
    ``stored_embeddings=False`` replays the stored views but reads no embeddings (online teacher:
    pass ``teacher_image_size`` to also get each crop at the teacher's input size).
    ``aug_limit`` uses only the first k stored views, ``caption_sources`` only captions of those
    sources (reinforcement ablations at train time, no rebuild).
    Batches: see :class:`Collate`; ``teacher`` maps name -> {"img": (B,D) or None, "txt", "syn"}.
    """
    parts = training_parts(shards_dir, split, student, mode=mode, seed=seed, pick=pick, epoch=epoch,
                           teachers=teachers, teacher_image_size=teacher_image_size,
                           stored_embeddings=stored_embeddings, image_size=image_size, tokenize=tokenize,
                           aug_limit=aug_limit, caption_sources=caption_sources)
    urls, count, names, info = parts.urls, parts.count, parts.teachers, parts.info
    dataset = build_pipeline(urls, parts.view, batch_size, resampled=resampled, shuffle=shuffle,
                             shuffle_buffer=shuffle_buffer, seed=seed, epoch=epoch, collate=parts.collate,
                             node_split=node_split, drop_last=drop_last,
                             policy=CorruptPolicy(on_corrupt, corrupt_log))
    workers = _usable_workers(workers, len(urls), resampled)
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=already_collated,
                        persistent_workers=False, pin_memory=torch.cuda.is_available(),
                        prefetch_factor=2 if workers > 0 else None)
    loader.samples_per_epoch = count  # for epoch bookkeeping in the loop
    loader.teachers = names
    loader.teacher_scales = teacher_scales(info, names)
    return loader


def make_eval_loader(shards_dir: str | Path, split: str, student, batch_size: int = 64, *,
                     workers: int = 0, return_boxes: bool = False, image_size: int | None = None,
                     tokenize: Callable | None = None, teacher_image_size: int | None = None,
                     on_corrupt: str = "stop", corrupt_log: str | None = None):
    """Deterministic one-pass loader over a split: full stored image, report text, no shuffle.

    Every rank sees every sample (no node split): evaluation runs where it is called.
    Batches also carry ``aug_params`` (the identity view) and, with ``return_boxes``, ``boxes``
    in stored-image pixels.
    """
    info = read_dataset_info(shards_dir)
    urls, _ = split_shards(shards_dir, split, info)
    if not urls:
        raise ValueError(f"{shards_dir}: no shards hold split {split!r}")
    view = SampleView(split=split, image_size=int(image_size or student.image_size), mode="plain",
                      full_image=True, return_boxes=return_boxes,
                      teacher_image_size=teacher_image_size, replay_in_collate=True)
    collate = Collate(tokenize if tokenize is not None else
                      (student_tokenizer(student) if student is not None else None))
    dataset = build_pipeline(urls, view, batch_size, resampled=False, shuffle=False,
                             shuffle_buffer=0, seed=0, epoch=0, collate=collate, node_split=False,
                             drop_last=False, policy=CorruptPolicy(on_corrupt, corrupt_log))
    # Ordered output needs one worker per shard at most; with several workers the order of
    # batches interleaves across shards (still deterministic for a fixed worker count).
    workers = _usable_workers(workers, len(urls), False)
    return DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=already_collated,
                      prefetch_factor=2 if workers > 0 else None)


class ReplayedBatches:
    """A deterministic one-pass loader (:func:`make_eval_loader`) read from the shards once and replayed from
    memory after: every validation pass sees the same batches, so decoding, resizing and tokenising them (and
    starting the loader's worker) again each pass bought nothing. A run validates every few steps (the
    efficiency curves: 20-40 passes a run), and the re-reading took 20-30 % of a CPU run.

    ``max_samples``: the passes read at most this many samples (``TrainConfig.eval_max_samples``), so only
    those are kept. ``max_bytes``: a split whose batches hold more tensor bytes is not kept; every pass
    then streams it from the shards, as before (``0``: never keep)."""

    def __init__(self, loader, max_samples: int | None = None, max_bytes: int = 2 << 30):
        self.loader, self.max_samples, self.max_bytes = loader, max_samples, int(max_bytes)
        self.batches: list[dict] | None = None  # the kept batches once a first pass has read them
        self.streaming = self.max_bytes <= 0

    def __iter__(self):
        if self.batches is not None:
            yield from self.batches
            return
        kept, size, seen = [], 0, 0
        for batch in self.loader:
            seen += len(batch["key"])
            last = bool(self.max_samples) and seen >= self.max_samples
            if not self.streaming:
                size += sum(t.numel() * t.element_size() for t in _tensors(batch))
                if size > self.max_bytes:  # too big to keep: stream this and every later pass
                    self.streaming, kept = True, []
                else:
                    kept.append(_unshared(batch))
                    if last:  # kept before the hand-over: the caller stops at this batch
                        self.batches = kept
            yield batch
            if last:
                return
        if not self.streaming:
            self.batches = kept


def _tensors(value):
    """Every tensor in a batch, nested ones included (the stored teacher embeddings: {teacher: {kind: tensor}})."""
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _unshared(value):
    """The batch with its tensors, nested ones included, in this process's own memory: a loader worker's tensors
    arrive in shared memory, one open file each (torch's file_descriptor strategy), and a kept split of many small
    batches would hold thousands of them open."""
    if torch.is_tensor(value):
        return value.clone() if value.is_shared() else value
    if isinstance(value, dict):
        return {k: _unshared(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unshared(v) for v in value)
    return value


def _usable_workers(workers: int, n_shards: int, resampled: bool) -> int:
    """Never start more workers than shards for a one-pass stream (extra ones would idle)."""
    workers = max(0, int(workers))
    if not resampled:
        workers = min(workers, n_shards)
    return workers
