"""Record preparation, in DataLoader workers: the stored image (encoded, then decoded again so the
teacher sees exactly the pixels stage 2 will decode), K augmentation parameter sets replayed at
every teacher input size, S captions, the sample's metadata and manifest row.

With ``--replay device`` the workers stop at the stored pixels and the parameter sets; the build's
process replays a whole batch's views at once on the teachers' device (:func:`replay_on_device`)."""
from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from cxrdr.common.augment import replay_batch, replay_many, resize_short_side, sample_param_sets
from cxrdr.common.labels import CHEXPERT14
from cxrdr.common.shards import encode_meta
from cxrdr.reinforce.captions import make_captions
from cxrdr.reinforce.records import load_image_for_store


@dataclass
class PrepareSpec:
    """Everything a DataLoader worker needs to prepare one record (picklable)."""

    images: bool
    store_size: int
    image_format: str
    jpeg_quality: int
    n_aug: int
    n_captions: int
    aug: object
    seed: int
    sizes: tuple  # distinct teacher input sizes
    replay: str = "cpu"  # cpu: the workers replay the crops; device: the build's process does (replay_on_device)
    # a --captioner build: the captions are made after the image forwards (captioners), not here
    captioner: bool = False
    # (teacher name, its text_tokenizer()): the record's texts tokenized here, off the build's process
    tokenizers: tuple = ()


def encode_image(image, image_format: str, jpeg_quality: int) -> bytes:
    buf = io.BytesIO()
    if image_format == "png":
        image.save(buf, format="PNG")
    else:
        image.save(buf, format="JPEG", quality=jpeg_quality)
    return buf.getvalue()


def decode_stored_image(data: bytes):
    """Stored image bytes -> PIL 'L', exactly as stage 2 decodes them (PIL)."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("L")


def _scale_boxes(boxes, orig_size, stored_size) -> list[dict]:
    sx, sy = stored_size[0] / orig_size[0], stored_size[1] / orig_size[1]
    out = []
    for b in boxes or []:
        x0, y0, x1, y1 = b["box"]
        out.append({**b, "box": [round(x0 * sx, 2), round(y0 * sy, 2), round(x1 * sx, 2), round(y1 * sy, 2)]})
    return out


def json_safe(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return json.loads(json.dumps(value, default=str))


def prepare_record(shard: int, key: str, record, spec: PrepareSpec) -> dict:
    """Decode/encode/decode, sample + replay augmentations, make captions. Never raises: a record
    that cannot be prepared comes back with ``"skip"`` (its reason)."""
    start = time.perf_counter()
    out = {"shard": shard, "key": key, "id": record.id}
    # CPU seconds per step, of the preparing thread: wall time would count other processes on a busy
    # machine, and process time this process's other threads (the writer, the teacher's OpenMP threads)
    # when the build prepares in its own process. Torch's helper threads of the crops' resampling are
    # not counted; DataLoader workers run torch on one thread, so there it misses nothing.
    stages: dict[str, float] = {}
    cpu = time.thread_time()
    view = {"image": None, "aug": [], "crops": {}, "image_size": None, "boxes": []}
    if spec.images:
        view = _prepare_image(key, record, spec, stages)
        if "skip" in view:
            return {**out, "skip": view["skip"], "prep_seconds": time.perf_counter() - start}
    t = time.thread_time()
    captions, why = ([], None) if spec.captioner else _captions(record, spec)
    if why:
        return {**out, "skip": why, "prep_seconds": time.perf_counter() - start}
    stages["captions"] = time.thread_time() - t
    texts = [record.report] + [c["text"] for c in captions]
    tokens = {}
    if spec.tokenizers:
        t = time.thread_time()
        tokens = {"tokens": {name: np.asarray(tokenize(texts)) for name, tokenize in spec.tokenizers}}
        stages["tokenize"] = time.thread_time() - t
    try:
        meta, row = _sample_meta(key, record, captions, view)
    except ValueError as exc:  # a value that has no place in the json member's types
        return {**out, "skip": f"bad metadata: {exc}", "prep_seconds": time.perf_counter() - start}
    replayed = {"pixels": view["pixels"], "aug": view["aug"], "image_size": view["image_size"]} \
        if "pixels" in view else {}
    return {**out, "image": view["image"], "report": record.report, "meta": meta, "row": row,
            "crops": view["crops"], **replayed, "texts": texts, **tokens,
            "prep_seconds": time.perf_counter() - start, **_text_source(record, spec),
            "stage_seconds": {**stages, "rest": time.thread_time() - cpu - sum(stages.values())}}


def _text_source(record, spec: PrepareSpec) -> dict:
    """A captioner build's samples carry where their report text came from (the captioner fills in a
    record marked ``retrieved``, which has none)."""
    return {"text_source": (record.extra or {}).get("text_source", "report")} if spec.captioner else {}


def _prepare_image(key: str, record, spec: PrepareSpec, stages: dict) -> dict:
    """The stored image bytes, the K parameter sets and their crops at every teacher size (or ``skip``)."""
    cpu = time.thread_time()
    try:
        image, orig_size = load_image_for_store(record, spec.store_size)
    except FileNotFoundError as exc:
        return {"skip": f"missing image: {exc}"}
    except Exception as exc:  # noqa: BLE001 - any decoder error means "unreadable", not a crash
        return {"skip": f"unreadable image: {type(exc).__name__}: {exc}"}
    image = resize_short_side(image, spec.store_size)
    t = time.thread_time()
    stages["load_resize"] = t - cpu
    image_bytes = encode_image(image, spec.image_format, spec.jpeg_quality)
    stored = decode_stored_image(image_bytes)
    stages["encode_decode"] = time.thread_time() - t
    t = time.thread_time()
    size = list(stored.size)
    params = sample_param_sets(key, size[0], size[1], spec.n_aug, spec.aug, spec.seed)
    pixels = np.asarray(stored)  # converted once for every teacher size
    out = {"image": image_bytes, "aug": params, "crops": {}, "image_size": size,
           "boxes": _scale_boxes(record.boxes, orig_size, size)}
    out.update(views_or_pixels(pixels, params, spec.sizes, spec.replay))
    stages["params_replay"] = time.thread_time() - t
    return out


def views_or_pixels(pixels: np.ndarray, params: list[dict], sizes, replay: str) -> dict:
    """What a prepared image hands on for the teachers: ``{"crops": {size: (K, 1, S, S)}}``, its views
    replayed here (``replay`` cpu), or ``{"pixels": (1, H, W) uint8}`` for :func:`replay_on_device`
    (``replay`` device: one byte a pixel instead of K float crops per teacher size); nothing without sizes."""
    if replay == "device":
        return {"pixels": torch.from_numpy(np.array(pixels)).unsqueeze(0)} if sizes else {}
    return {"crops": {s: replay_many(pixels, params, s) for s in sizes}}


def _captions(record, spec: PrepareSpec) -> tuple[list[dict], str | None]:
    """(S captions as JSON, None) or ([], the reason they failed)."""
    try:
        captions = [c.to_json() for c in make_captions(record, n=spec.n_captions, seed=spec.seed)]
    except Exception as exc:  # noqa: BLE001
        return [], f"captions failed: {type(exc).__name__}: {exc}"
    if len(captions) != spec.n_captions:
        return [], f"captions failed: got {len(captions)} captions, expected {spec.n_captions}"
    return captions, None


def _sample_meta(key: str, record, captions: list[dict], view: dict) -> tuple[dict, dict]:
    """The sample's json member, as stored (``encode_meta``: ValueError when a value does not fit),
    and its manifest row."""
    labels = {name: record.labels.get(name) for name in CHEXPERT14}
    meta = {"id": record.id, "key": key, "subject_id": str(record.subject_id),
            "study_id": str(record.study_id), "split": record.split, "view": record.view,
            "findings": record.findings, "impression": record.impression, "labels": labels,
            "label_vector": record.label_vector(), "triples": [list(t) for t in record.triples],
            "captions": captions, "aug": view["aug"], "boxes": view["boxes"], "image_size": view["image_size"]}
    if record.extra:
        meta["extra"] = record.extra
    row = {"key": key, "id": record.id, "split": record.split, "subject_id": str(record.subject_id),
           "study_id": str(record.study_id), "view": record.view, **labels,
           "n_aug": len(view["aug"]), "n_captions": len(captions)}
    return encode_meta(meta), row


class PrepareDataset:
    """Map-style dataset over (shard, key, record) for torch's DataLoader."""

    def __init__(self, items, spec: PrepareSpec):
        self.items, self.spec = items, spec

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        shard, key, record = self.items[i]
        return prepare_record(shard, key, record, self.spec)


def collate_prepared(batch: list[dict]) -> dict:
    """Worker-side collate: one (sum K, 1, S, S) crop tensor per teacher size for the batch's
    usable samples, so the main process gets one shared-memory tensor per size (not one per
    sample) and does not have to concatenate them before the forward. With ``--replay device``
    instead one (B, 1, H, W) uint8 tensor of their stored pixels (``pixels``, :func:`pad_cat`)."""
    ok = [b for b in batch if "skip" not in b]
    out = {"samples": batch, "crops": {}}
    if ok and ok[0].get("crops"):
        out["crops"] = {size: torch.cat([b["crops"][size] for b in ok]) for size in ok[0]["crops"]}
    if ok and "pixels" in ok[0]:
        out["pixels"] = pad_cat([b.pop("pixels") for b in ok])
    for b in ok:
        b.pop("crops", None)
    return out


def pad_cat(images: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate (n, 1, H, W) or (1, H, W) images along the first axis, each zero-padded at the bottom
    and right to the largest H and W (the canvas :func:`cxrdr.common.augment.replay_batch` reads)."""
    images = [x.unsqueeze(0) if x.ndim == 3 else x for x in images]
    h, w = max(x.shape[-2] for x in images), max(x.shape[-1] for x in images)
    return torch.cat([F.pad(x, (0, w - x.shape[-1], 0, h - x.shape[-2])) for x in images])


def replay_on_device(pixels: torch.Tensor, samples: list[dict], sizes, device) -> dict:
    """``--replay device``: every view of a batch at every teacher size, ``{size: (sum K, 1, S, S)}`` on
    ``device``, replayed in one batch from the samples' stored pixels (``pixels``: (B, 1, H, W) uint8 from
    :func:`collate_prepared`, sample ``i``'s image in its top-left ``image_size``)."""
    images = pixels.to(device, non_blocking=True).float() / 255.0  # as augment.to_float_image converts
    owners = [i for i, b in enumerate(samples) for _ in b["aug"]]
    params = [p for b in samples for p in b["aug"]]
    image_sizes = [tuple(b["image_size"]) for b in samples]
    return {size: replay_batch(images, image_sizes, params, owners, size) for size in sizes}
