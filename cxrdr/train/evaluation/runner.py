"""`evaluate(model, shards_dir, split, out_dir)`: the whole evaluation suite on one shard split.

What is evaluated, and on which rows (all written to ``eval_ids.json`` so numbers reproduce):
- retrieval: one frontal image per study (first frontal by key order, else its first image)
  with that study's text; the text section is ``text_section`` ('both' = findings +
  impression, falling back to the stored report when a study has neither);
- linear probe: every image of ``train_split`` (at most ``probe_max_train``, an even stride
  over the split, so a fixed shard folder always gives the same rows) -> every image of ``split``;
- zero-shot AUC: every image of ``split``; 5x200-style accuracy on a seeded subset;
- geometry: every image of ``split`` by subject;
- localisation: the first ``n_localisation`` images of ``split`` with boxes (student only);
- faithfulness: the first ``n_faithfulness`` images of ``split`` (student only);
- efficiency: synthetic inputs at the model's size.
All images are the full stored image (identity view) at the model's input size, except for the
cross-view consistency which replays the first two stored augmentations.

``model`` is a PatchIBStudent, a loaded Teacher, or a spec: a checkpoint path / ``ckpt:PATH``
(loaded as the student, every metric) or any teacher spec (``openclip:...``, ``biomedclip``):
global metrics only (retrieval, probe, zero-shot, geometry, inference cost).
"""
from __future__ import annotations

import io
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from cxrdr.common import augment
from cxrdr.train.evaluation import faithfulness as faith
from cxrdr.train.evaluation import localisation as loc
from cxrdr.train.evaluation.efficiency import efficiency_metrics, image_encoder_metrics
from cxrdr.train.evaluation.geometry import distance_ratio
from cxrdr.train.evaluation.probe import linear_probe
from cxrdr.train.evaluation.retrieval import retrieval_metrics
from cxrdr.train.evaluation.zeroshot import (encode_prompts, load_prompts, multiclass_accuracy,
                                       select_5x200, zeroshot_auc)

TEXT_SECTIONS = ("both", "report", "findings", "impression")
FRONTAL_VIEWS = {"PA", "AP", "FRONTAL", "AP AXIAL", "PA LLD", "AP LLD"}
IMAGE_EXTS = ("png", "jpg", "jpeg")


# --------------------------------------------------------------------------- models


@dataclass
class EvalModel:
    """One interface over a cxrdr student and a reinforce Teacher."""

    name: str
    module: object
    is_student: bool
    image_size: int
    device: torch.device

    def embed_images(self, images: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            if self.is_student:
                out = self.module.encode_image(images.to(self.device))
            else:
                out = self.module.encode_images(images)
        return torch.nn.functional.normalize(out.float(), dim=-1).cpu().numpy()

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        with torch.no_grad():
            if self.is_student:
                tok = self.module.tokenize(list(texts))
                out = self.module.encode_text(tok["input_ids"].to(self.device),
                                              tok["attention_mask"].to(self.device))
            else:
                out = self.module.encode_texts(list(texts))
        return torch.nn.functional.normalize(out.float(), dim=-1).cpu().numpy()

    def forward(self, images: torch.Tensor, texts: list[str]):
        tok = self.module.tokenize(list(texts))
        with torch.no_grad():
            out = self.module(images.to(self.device), tok["input_ids"].to(self.device),
                              tok["attention_mask"].to(self.device), step=None)
        return out, tok


def as_eval_model(model, device: str | None = None) -> EvalModel:
    """Wrap a student / teacher, or load one from a spec or checkpoint path."""
    if isinstance(model, EvalModel):
        return model
    if isinstance(model, (str, Path)):
        spec = str(model)
        path = spec[5:] if spec.startswith("ckpt:") else spec
        if spec.startswith("ckpt:") or Path(path).suffix in (".pt", ".pth") or Path(path).is_file():
            from cxrdr.train.checkpoint import load_checkpoint  # (not `cxrdr.train.load_checkpoint`: see report)

            if not Path(path).is_file():
                raise FileNotFoundError(f"checkpoint not found: {path}")
            student = load_checkpoint(path, device=device or "cpu")
            student.eval()
            return EvalModel(f"ckpt:{path}", student, True, int(student.image_size),
                             _device_of(student))
        from cxrdr.teachers import load_teacher

        teacher = load_teacher(spec, device=device or "cpu")
        return as_eval_model(teacher)
    if hasattr(model, "encode_images") and hasattr(model, "encode_texts"):  # a Teacher
        if not getattr(model, "has_images", True):
            raise ValueError(f"teacher {model.spec!r} is text-only: it cannot be evaluated on images")
        return EvalModel(model.spec, model, False, int(model.image_size), torch.device(model.device))
    if hasattr(model, "encode_image") and hasattr(model, "tokenize"):
        model.eval()
        name = getattr(getattr(model, "config", None), "name", "") or type(model).__name__
        return EvalModel(name, model, True, int(model.image_size), _device_of(model))
    raise TypeError(f"cannot evaluate a {type(model).__name__}: expected a student, a Teacher or a spec")


def _device_of(module) -> torch.device:
    try:
        return next(module.parameters()).device
    except StopIteration:
        return torch.device("cpu")


# --------------------------------------------------------------------------- shard reading


@dataclass
class EvalSample:
    key: str
    meta: dict
    report: str
    image_bytes: bytes

    @property
    def image(self) -> Image.Image:
        return Image.open(io.BytesIO(self.image_bytes)).convert("L")

    @property
    def labels(self) -> list[float]:
        return list(self.meta.get("label_vector") or [0.0] * 14)

    def text(self, section: str) -> tuple[str, bool]:
        """(retrieval text, whether it fell back to the stored report)."""
        findings = (self.meta.get("findings") or "").strip()
        impression = (self.meta.get("impression") or "").strip()
        if section == "report":
            return self.report, False
        chosen = {"findings": findings, "impression": impression,
                  "both": " ".join(t for t in (findings, impression) if t)}[section]
        return (chosen, False) if chosen else (self.report, True)


def iter_samples(shards_dir, split: str):
    """Raw samples of one split in shard order (single process, deterministic)."""
    import webdataset as wds

    from cxrdr.train.data import read_info, split_shards

    urls, _ = split_shards(shards_dir, split, read_info(shards_dir))
    if not urls:
        return
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls),
                                wds.tarfile_to_samples(handler=wds.reraise_exception))
    for raw in pipeline:
        meta = raw.get("json")
        meta = json.loads(meta) if isinstance(meta, (bytes, bytearray)) else meta
        if not isinstance(meta, dict) or meta.get("split") != split:
            continue
        image = next((raw[e] for e in IMAGE_EXTS if e in raw), None)
        if image is None:
            raise ValueError(f"sample {raw.get('__key__')!r} in {raw.get('__url__')}: no image")
        text = raw.get("txt")
        text = text.decode("utf-8") if isinstance(text, (bytes, bytearray)) else (text or meta.get("report", ""))
        yield EvalSample(str(raw.get("__key__", meta.get("key"))), meta, text, image)


def load_split(shards_dir, split: str, max_samples: int | None = None) -> list[EvalSample]:
    samples = []
    for s in iter_samples(shards_dir, split):
        samples.append(s)
        if max_samples and len(samples) >= max_samples:
            break
    return samples


def full_view(sample: EvalSample, size: int) -> tuple[torch.Tensor, dict]:
    image = sample.image
    params = augment.full_image_params(*image.size)
    return augment.replay(image, params, size), params


def embed_images(model: EvalModel, samples, batch_size: int, progress: bool, desc: str) -> np.ndarray:
    from tqdm.auto import tqdm

    out = []
    batch: list[torch.Tensor] = []
    for s in tqdm(samples, desc=desc, disable=not progress, leave=False):
        batch.append(full_view(s, model.image_size)[0])
        if len(batch) == batch_size:
            out.append(model.embed_images(torch.stack(batch)))
            batch = []
    if batch:
        out.append(model.embed_images(torch.stack(batch)))
    return np.concatenate(out) if out else np.zeros((0, 1), np.float32)


def embed_texts(model: EvalModel, texts: list[str], batch_size: int) -> np.ndarray:
    return np.concatenate([model.embed_texts(texts[i:i + batch_size])
                           for i in range(0, len(texts), batch_size)])


def one_per_study(samples: list[EvalSample]) -> list[int]:
    """Row indices: the first frontal image of each study by key (else its first image)."""
    chosen: dict = {}
    for i in sorted(range(len(samples)), key=lambda i: samples[i].key):
        meta = samples[i].meta
        study = str(meta.get("study_id") or samples[i].key)
        view = meta.get("view")
        frontal = view is None or str(view).upper() in FRONTAL_VIEWS
        if study not in chosen or (frontal and not chosen[study][1]):
            chosen[study] = (i, frontal)
    return sorted(i for i, _ in chosen.values())


# --------------------------------------------------------------------------- student-only parts


def _grid(out) -> tuple[int, int]:
    gh, gw = out.grid_size
    return int(gh), int(gw)


def _patch_index(out, b: int, n: int):
    index = getattr(out, "patch_index", None)
    return np.arange(n) if index is None else index[b].cpu().numpy()


def _mask_heat(out, b: int) -> np.ndarray | None:
    """z ranking map on the full grid (soft scores z is made from; dropped patches NaN)."""
    scores = getattr(out, "mask_scores", None)
    scores = scores if scores is not None else getattr(out, "mask", None)
    if scores is None:
        return None
    values = scores[b].float().cpu().numpy()
    return loc.scatter_to_grid(values, _patch_index(out, b, len(values)), _grid(out))


def _mask_z(out, b: int) -> np.ndarray | None:
    z = getattr(out, "mask", None)
    if z is None:
        return None
    values = z[b].float().cpu().numpy()
    return loc.scatter_to_grid(values, _patch_index(out, b, len(values)), _grid(out), fill=0.0)


def _attn_heat(out, b: int, positions: list[int]) -> np.ndarray | None:
    attn = getattr(out, "local_attn", None)
    if attn is None:
        return None
    heat = loc.attention_heatmap(attn[b].float().cpu().numpy(), positions)
    if heat is None:
        return None
    return loc.scatter_to_grid(heat, _patch_index(out, b, len(heat)), _grid(out))


class PhraseTokens:
    """Token ids of a phrase without the tokenizer's special tokens (cached)."""

    def __init__(self, student):
        self.student = student
        empty = student.tokenize([""])
        ids, mask = empty["input_ids"][0], empty["attention_mask"][0].bool()
        self.special = set(ids[mask].tolist())
        self.cache: dict[str, list[int]] = {}

    def __call__(self, phrase: str) -> list[int]:
        if phrase not in self.cache:
            tok = self.student.tokenize([phrase])
            ids = tok["input_ids"][0][tok["attention_mask"][0].bool()].tolist()
            self.cache[phrase] = [i for i in ids if i not in self.special]
        return self.cache[phrase]


def localisation_and_faithfulness(model: EvalModel, samples: list[EvalSample], texts: list[str],
                                  n_localisation: int, n_faithfulness: int, steps: int,
                                  top_fraction: float, n_plots: int, seed: int,
                                  progress: bool) -> tuple[dict, dict, dict]:
    """Returns (localisation results, faithfulness results, plot material)."""
    from tqdm.auto import tqdm

    phrase_ids = PhraseTokens(model.module)
    with_boxes = [i for i in range(len(samples)) if samples[i].meta.get("boxes")][:n_localisation]
    faith_rows = list(range(len(samples)))[:n_faithfulness]
    rows = sorted(set(with_boxes) | set(faith_rows))
    mask_scores, attn_scores, per_label, no_tokens = [], [], {}, []
    curves, sparsities, entropies, jaccards, order_sources = [], [], [], [], set()
    random_curves = []
    plots = []
    z_maps, attn_maps, entropies_attn, word_similarity = [], {}, [], []  # collapse diagnostics
    rng = np.random.default_rng(seed)
    for i in tqdm(rows, desc="localisation/faithfulness", disable=not progress, leave=False):
        s = samples[i]
        view, params = full_view(s, model.image_size)
        out, tok = model.forward(view[None], [texts[i]])
        grid = _grid(out)
        z_heat = _mask_heat(out, 0)
        ids = tok["input_ids"][0][tok["attention_mask"][0].bool()].tolist()
        item = {"key": s.key, "image": view[0].numpy(), "z": _mask_z(out, 0) if z_heat is not None else None,
                "boxes": [], "attn": []}
        if i in with_boxes:
            w, h = s.meta.get("image_size") or s.image.size
            targets: dict[str, list] = {}  # label -> patch masks of its boxes (one per lung if bilateral)
            for box in s.meta["boxes"]:
                label = str(box.get("label", "finding"))
                item["boxes"].append((label, _box_in_view(box["box"], w, h, model.image_size)))
                gt = loc.box_patch_mask(box["box"], params, grid)
                if gt.any():
                    targets.setdefault(label, []).append(gt)
            if targets and z_heat is not None:  # class-agnostic z: any box of the image is a hit
                everything = np.any([g for masks in targets.values() for g in masks], axis=0)
                sc = {**loc.localisation_scores(z_heat, everything, top_fraction),
                      "n_boxes": sum(len(m) for m in targets.values())}
                mask_scores.append(sc)
                z_maps.append(z_heat)
                for label, masks in targets.items():  # per label: is z's peak on this finding?
                    per_label.setdefault(label, {"mask": [], "attention": []})["mask"].append(
                        {**loc.localisation_scores(z_heat, np.any(masks, axis=0), top_fraction),
                         "n_boxes": len(masks)})
            for label, masks in targets.items():
                positions = loc.phrase_positions(ids, [phrase_ids(p) for p in loc.label_phrases(label)])
                heat = _attn_heat(out, 0, positions)
                if heat is None:
                    if getattr(out, "local_attn", None) is not None:
                        no_tokens.append(f"{s.key}:{label}")
                    continue
                sc = {**loc.localisation_scores(heat, np.any(masks, axis=0), top_fraction), "n_boxes": len(masks)}
                attn_scores.append(sc)
                per_label.setdefault(label, {"mask": [], "attention": []})["attention"].append(sc)
                attn_maps.setdefault(label, []).append(heat)
                entropies_attn.append(loc.normalised_entropy(heat))
                item["attn"].append((label, heat))
            if len(item["attn"]) >= 2:
                word_similarity.append(loc.map_similarity([heat for _, heat in item["attn"]]))
        if i in faith_rows:
            order_heat, source = z_heat, "mask"
            if order_heat is None and getattr(out, "local_attn", None) is not None:
                valid = [p for p in range(len(ids))]
                order_heat, source = _attn_heat(out, 0, valid), "attention"
            if order_heat is not None:
                order_sources.add(source)
                order = np.argsort(-np.nan_to_num(order_heat.ravel(), nan=-np.inf), kind="stable")
                own = torch.from_numpy(embed_texts(model, [texts[i]], 1)[0])

                def score_fn(images, own=own):
                    return torch.from_numpy(model.embed_images(images)) @ own

                curves.append(faith.deletion_insertion(score_fn, view, order, grid, steps))
                random_curves.append(faith.deletion_insertion(score_fn, view, rng.permutation(order.size),
                                                              grid, steps))
                z_full = _mask_z(out, 0)
                if z_full is not None:
                    sparsities.append(faith.sparsity(z_full))
                    entropies.append(faith.spatial_entropy(z_full))
                stored = s.meta.get("aug") or []
                if len(stored) >= 2 and z_heat is not None:
                    image = s.image
                    heats = []
                    for p in stored[:2]:
                        o2, _ = model.forward(augment.replay(image, p, model.image_size)[None], [texts[i]])
                        heats.append(_mask_heat(o2, 0))
                    k = max(1, math.ceil(top_fraction * grid[0] * grid[1]))
                    j = faith.cross_view_jaccard(heats[0], stored[0], heats[1], stored[1], image.size, k, grid)
                    if not math.isnan(j):
                        jaccards.append(j)
        if item["boxes"] or item["z"] is not None:
            plots.append(item)

    localisation = {
        "mask": {**loc.aggregate(mask_scores), "image_similarity": loc.map_similarity(z_maps),
                 "entropy": _nanmean([loc.normalised_entropy(m) for m in z_maps])},
        "attention": {**loc.aggregate(attn_scores),
                      "image_similarity": _nanmean([loc.map_similarity(m) for m in attn_maps.values()]),
                      "word_similarity": _nanmean(word_similarity), "entropy": _nanmean(entropies_attn)},
        "targets": "pointing game per target: z - any box of the image; attention - the boxes of that label",
        "per_label": {lab: {k: loc.aggregate(v) for k, v in d.items()} for lab, d in sorted(per_label.items())},
        "n_images": len(with_boxes), "top_fraction": top_fraction,
        "boxes_without_finding_tokens": no_tokens,
        "heatmap_z": "soft mask scores (same order as z, no ties)",
    }
    faithfulness = {"n_images": len(curves), "order_source": sorted(order_sources), "steps": steps,
                    "baseline": "image mean grey"}
    if curves:
        fractions = curves[0]["fractions"]
        mean = lambda key, cs: np.mean([c[key] for c in cs], axis=0).tolist()  # noqa: E731
        faithfulness.update({
            "deletion_auc": float(np.mean([c["deletion_auc"] for c in curves])),
            "insertion_auc": float(np.mean([c["insertion_auc"] for c in curves])),
            "random_deletion_auc": float(np.mean([c["deletion_auc"] for c in random_curves])),
            "random_insertion_auc": float(np.mean([c["insertion_auc"] for c in random_curves])),
            "curves": {"fractions": fractions, "deletion": mean("deletion", curves),
                       "insertion": mean("insertion", curves),
                       "random_deletion": mean("deletion", random_curves),
                       "random_insertion": mean("insertion", random_curves)},
        })
    faithfulness["sparsity"] = float(np.mean(sparsities)) if sparsities else None
    faithfulness["spatial_entropy"] = float(np.nanmean(entropies)) if entropies else None
    faithfulness["cross_view_jaccard"] = float(np.mean(jaccards)) if jaccards else None
    faithfulness["cross_view_n"] = len(jaccards)
    ids_used = {"localisation": [samples[i].key for i in with_boxes],
                "faithfulness": [samples[i].key for i in faith_rows]}
    return localisation, faithfulness, {"heatmaps": varied_plots(plots, n_plots), "ids": ids_used}


def varied_plots(items: list[dict], n: int) -> list[dict]:
    """Up to ``n`` heatmap items, each new one showing a finding not shown yet where possible (the first
    images of a split are often follow-ups of one patient with the same finding), then in order."""
    chosen, shown = [], set()
    for item in items:
        labels = {label for label, _ in item["attn"]} or {label for label, _ in item["boxes"]}
        if len(chosen) < n and labels - shown:
            chosen.append(item)
            shown |= labels
    rest = [item for item in items if all(item is not c for c in chosen)]
    return chosen + rest[:max(0, n - len(chosen))]


def _nanmean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(values)) if values else float("nan")


def _box_in_view(box, w, h, size) -> list[float]:
    """Stored-image box -> pixel box in the full-image view at ``size`` (identity params)."""
    x0, y0, x1, y1 = box
    return [x0 * size / w, y0 * size / h, x1 * size / w, y1 * size / h]


# --------------------------------------------------------------------------- the suite


def evaluate(model, shards_dir, split: str = "test", out_dir=None, *, train_split: str = "train",
             text_section: str = "both", batch_size: int = 64, max_samples: int | None = None,
             probe_max_train: int | None = 10000, prompts=None, min_positives: int = 5,
             n_5x200: int = 200, n_localisation: int = 64, n_faithfulness: int = 16,
             faith_steps: int = 10, top_fraction: float = 0.2, efficiency: bool = True,
             efficiency_batch: int = 32, n_plots: int = 6, seed: int = 0, device: str | None = None,
             progress: bool = True, quiet: bool = False) -> dict:
    """Run every metric on ``split`` of ``shards_dir``; write eval.json/eval.md/PNGs to ``out_dir``.

    Returns the results dict (``results["summary"]`` is the flat row of headline numbers).
    """
    if text_section not in TEXT_SECTIONS:
        raise ValueError(f"text_section must be one of {TEXT_SECTIONS}, got {text_section!r}")
    started = time.perf_counter()
    em = as_eval_model(model, device)
    samples = load_split(shards_dir, split, max_samples)
    if not samples:
        raise ValueError(f"{shards_dir}: split {split!r} has no samples")
    texts, fallbacks = zip(*(s.text(text_section) for s in samples))
    texts = list(texts)
    results: dict = {"meta": {
        "model": em.name, "student": em.is_student, "shards": str(shards_dir), "split": split,
        "n_samples": len(samples), "text_section": text_section,
        "text_section_fallbacks_to_report": int(sum(fallbacks)), "seed": seed,
        "image_view": "full stored image (identity params) at the model input size",
        "image_size": em.image_size}}
    if em.is_student:
        results["meta"]["student_config"] = _config_dict(em.module)
    ids: dict = {"split": split, "text_section": text_section, "seed": seed}

    img = embed_images(em, samples, batch_size, progress, f"embed {split} images")
    rows = one_per_study(samples)
    txt = embed_texts(em, [texts[i] for i in rows], batch_size)
    results["retrieval"] = retrieval_metrics(img[rows], txt, texts=[texts[i] for i in rows])
    results["retrieval"]["candidates"] = "one frontal image per study and its text"
    ids["retrieval"] = [samples[i].key for i in rows]
    ids["all"] = [s.key for s in samples]

    labels = np.asarray([s.labels for s in samples], dtype=np.float64)
    train_rows = _train_split_embeddings(em, shards_dir, train_split, probe_max_train, batch_size, progress)
    if train_rows is None:
        results["probe"] = {"skipped": f"no {train_split!r} split in the shards"}
    else:
        results["probe"] = linear_probe(train_rows["img"], train_rows["labels"], img, labels,
                                        min_positives=min_positives, seed=seed)
        results["probe"]["train_split"] = train_split
        ids["probe_train"] = train_rows["keys"]

    prompt_cfg = prompts if isinstance(prompts, dict) else load_prompts(prompts)
    prompt_emb = encode_prompts(lambda t: embed_texts(em, t, batch_size), prompt_cfg)
    results["zeroshot"] = zeroshot_auc(img, labels, prompt_emb, min_positives=min_positives)
    subset = select_5x200(labels, [s.key for s in samples], tuple(prompt_cfg["multiclass_5x200"]),
                          per_class=n_5x200, seed=seed)
    results["zeroshot_5x200"] = multiclass_accuracy(img, subset, prompt_emb)
    ids["zeroshot_5x200"] = {c: [samples[r].key for r in rs] for c, rs in subset.items()}
    results["geometry"] = distance_ratio(img, [s.meta.get("subject_id", s.key) for s in samples], seed=seed)

    plots: dict = {}
    if em.is_student:
        localisation, faithfulness, plots = localisation_and_faithfulness(
            em, samples, texts, n_localisation, n_faithfulness, faith_steps, top_fraction, n_plots,
            seed, progress)
        results["localisation"], results["faithfulness"] = localisation, faithfulness
        ids.update(plots.get("ids", {}))
    if efficiency:
        results["efficiency"] = (efficiency_metrics(em.module, batch_size=efficiency_batch)
                                 if em.is_student else
                                 image_encoder_metrics(em.module.encode_images, em.image_size,
                                                       efficiency_batch, device=em.device))
    results["meta"]["eval_seconds"] = round(time.perf_counter() - started, 2)
    results["summary"] = summary_row(results)
    if out_dir is not None:
        from cxrdr.train.evaluation.report import write_eval_outputs

        write_eval_outputs(results, ids, plots, Path(out_dir), quiet=quiet)
    return results


def _config_dict(student) -> dict:
    cfg = getattr(student, "config", None)
    if cfg is None:
        return {}
    return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))


def _train_split_embeddings(em, shards_dir, split, max_rows, batch_size, progress):
    """Embeddings of an even stride over the train split (at most ``max_rows``), or None."""
    from cxrdr.train.data import read_info

    count = int(read_info(shards_dir).get("counts", {}).get(split, 0) or 0)
    stride = max(1, math.ceil(count / max_rows)) if (max_rows and count) else 1
    chosen = [s for i, s in enumerate(iter_samples(shards_dir, split)) if i % stride == 0]
    if max_rows:
        chosen = chosen[:max_rows]
    if not chosen:
        return None
    return {"img": embed_images(em, chosen, batch_size, progress, f"embed {split} images"),
            "labels": np.asarray([s.labels for s in chosen], dtype=np.float64),
            "keys": [s.key for s in chosen]}


def _get(d: dict, *path, default=None):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def summary_row(results: dict) -> dict:
    """The headline numbers of one evaluation, flat (the row of every table)."""
    r = results.get("retrieval", {})
    return {
        "i2t_R@1": r.get("i2t_R@1"), "i2t_R@5": r.get("i2t_R@5"), "i2t_R@10": r.get("i2t_R@10"),
        "t2i_R@1": r.get("t2i_R@1"), "t2i_R@5": r.get("t2i_R@5"), "t2i_R@10": r.get("t2i_R@10"),
        "mean_recall": r.get("mean_recall"), "chance_mean_recall": r.get("chance_mean_recall"),
        "mean_recall_sametext": r.get("mean_recall_sametext"),
        "n_candidates": r.get("n_candidates"),
        "probe_auc": _get(results, "probe", "mean_auc"), "probe_ap": _get(results, "probe", "mean_ap"),
        "zeroshot_auc": _get(results, "zeroshot", "mean_auc"),
        "zeroshot_5x200_acc": _get(results, "zeroshot_5x200", "accuracy"),
        "pointing_z": _get(results, "localisation", "mask", "pointing_game"),
        "iou_z": _get(results, "localisation", "mask", "iou"),
        "dice_z": _get(results, "localisation", "mask", "dice"),
        "chance_pointing_z": _get(results, "localisation", "mask", "chance_pointing_game"),
        "pointing_attn": _get(results, "localisation", "attention", "pointing_game"),
        "chance_pointing_attn": _get(results, "localisation", "attention", "chance_pointing_game"),
        "iou_attn": _get(results, "localisation", "attention", "iou"),
        "deletion_auc": _get(results, "faithfulness", "deletion_auc"),
        "insertion_auc": _get(results, "faithfulness", "insertion_auc"),
        "sparsity": _get(results, "faithfulness", "sparsity"),
        "cross_view_jaccard": _get(results, "faithfulness", "cross_view_jaccard"),
        "distance_ratio": _get(results, "geometry", "ratio"),
        "inference_img_per_s": _get(results, "efficiency", "inference_img_per_s"),
        "train_step_ms": _get(results, "efficiency", "train_step_ms"),
        "synthetic_train_img_per_s": _get(results, "efficiency", "train_img_per_s"),
        "latency_ms": _get(results, "efficiency", "latency_ms_per_img"),
        "peak_memory_mb": _get(results, "efficiency", "peak_memory_mb"),
        "step_memory_delta_mb": _get(results, "efficiency", "step_memory_delta_mb"),
        "gflops_per_img": _get(results, "efficiency", "gflops_per_img"),
        "patch_usage_pct": _get(results, "efficiency", "patch_usage_pct"),
    }
