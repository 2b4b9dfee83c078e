"""GPU benchmark suite: every CUDA figure of the project in one call of at most ~8 minutes.

    python benchmarks/gpu_suite.py --device cuda          # writes benchmarks/results/<device>.json and .md
    python benchmarks/gpu_suite.py --tiny                 # the same sections, CPU-sized (the test suite runs it)

Sections (each a function; each reuses the project's own measurement code):
1. build       ``reinforce build`` throughput with an open_clip ViT-B/16 teacher (random weights:
               speed only) against that teacher's pure forward on the same crops
               (``benchmarks/reinforce_throughput.measure``). Target: ratio >= 0.9.
2. students    A-E at ViT-S/16 (configs A..E) and ViT-B/16 (the same configs with
               ``image_tower=vit_base_patch16``, MiniLM text), 224 px, bf16 autocast: train and
               inference img/s, peak VRAM, GFLOPs, E at its target keep rate
               (``cxrdr.train.evaluation.efficiency.efficiency_metrics(step=FAR_STEP)``). Target: E >= 1.5x A
               train img/s (ViT-S/16).
3. train_step  the training loop's step with stored embeddings vs the ViT-B/16 teacher online vs
               no teacher (``benchmarks/train_step.py --size full --teachers openclip:ViT-B-16``) on
               the shards of section 1.
4. table       the seeds' efficiency table (``train experiment ablation`` layout) for A-E: loop step
               ms from the Trainer (``train_step.make_trainer/time_round_robin``) next to section 2's
               synthetic figures.

The suite keeps a total time budget (``--budget``): a section that would not fit is skipped with
a note, and whatever was measured is written. A section that fails is recorded with its error
and the others still run.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # sibling benchmarks and the repository's packages

VARIANTS = "ABCDE"
TARGETS = {"build_ratio": 0.9, "e_over_a_train": 1.5}


def settings(tiny: bool, device: str) -> dict:
    """Sizes of every section: the GPU run, or a CPU-sized run that exercises the same code."""
    if tiny:
        return dict(device=device, teacher="random:tiny", build=dict(n=16, workers=1, batch_size=8, n_aug=2,
                                                                      n_captions=2, store_size=64),
                    families={"tiny": ("tiny-{v}", {}), "cpu": ("cpu-{v}", {})}, batch_size=4, iters=2, warmup=1,
                    step=dict(size="tiny", batch_size=4, steps=2, warmup=1, workers=0), table_family="tiny",
                    reserve={"build": 5, "students": 10, "train_step": 10, "table": 10})
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    return dict(device=device, teacher="openclip:ViT-B-16",
                build=dict(n=1024, workers=workers, batch_size=64, n_aug=10, n_captions=5, store_size=256),
                families={"vit-s16": ("{v}", {}), "vit-b16": ("{v}", {"image_tower": "vit_base_patch16"})},
                batch_size=128, iters=5, warmup=2,
                step=dict(size="full", batch_size=64, steps=10, warmup=3, workers=min(8, workers)),
                table_family="vit-s16", reserve={"build": 90, "students": 120, "train_step": 90, "table": 60})


# --------------------------------------------------------------------------- sections


def section_build(cfg: dict, work: Path, budget) -> dict:
    """Build throughput vs the teacher's pure forward on the same crops (reinforce_throughput)."""
    import reinforce_throughput

    b = cfg["build"]
    m = reinforce_throughput.measure(teachers=cfg["teacher"], device=cfg["device"], out=str(work / "build"),
                                     **b)
    keep = ("source", "device", "teachers", "workers", "batch_size", "n_aug", "n_captions", "store_size",
            "samples", "build_seconds", "build_samples_per_s", "teacher_seconds", "teacher_samples_per_s",
            "ratio", "time_split_seconds", "shards")
    return {k: m[k] for k in keep}


def _autocast(device: str):
    import torch

    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def section_students(cfg: dict, work: Path, budget) -> dict:
    """A-E of each family: efficiency_metrics at the target keep rate, bf16 autocast on CUDA."""
    import torch

    from cxrdr.train.evaluation.efficiency import FAR_STEP, efficiency_metrics
    from cxrdr.train.models.config import StudentConfig
    from cxrdr.train.models import build_student

    rows, skipped = [], []
    for family, (pattern, overrides) in cfg["families"].items():
        for v in VARIANTS:
            name = pattern.format(v=v)
            if budget.left() < 5:
                skipped.append(f"{family} {name}: time budget spent")
                continue
            config = StudentConfig.from_yaml(name, **overrides)
            model = build_student(config).to(cfg["device"])
            with _autocast(cfg["device"]):
                m = efficiency_metrics(model, batch_size=cfg["batch_size"], iters=cfg["iters"],
                                       warmup=cfg["warmup"], step=FAR_STEP)
            rows.append({"family": family, "variant": v, "config": name, "image_tower": config.image_tower,
                         "image_size": config.image_size, "text_tower": config.text_tower,
                         "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                         "autocast": "bf16" if cfg["device"].startswith("cuda") else None, **m})
            del model
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    ratios = {}
    for family in cfg["families"]:
        by = {r["variant"]: r for r in rows if r["family"] == family}
        if "A" in by and "E" in by:
            ratios[family] = {k: by["E"][k] / by["A"][k] for k in ("train_img_per_s", "inference_img_per_s",
                                                                  "gflops_per_img")}
    return {"rows": rows, "E_over_A": ratios, "skipped": skipped,
            "note": "synthetic inputs at the model size; E (and the Top-K mask) at their target rates (FAR_STEP)"}


def section_train_step(cfg: dict, work: Path, budget, shards: str | None) -> dict:
    """benchmarks/train_step.py's own plan: A/E/D stored, D plain, D with the teacher online."""
    import train_step

    s = cfg["step"]
    out = work / "train_step.json"
    argv = ["--size", s["size"], "--teachers", cfg["teacher"], "--batch-size", str(s["batch_size"]),
            "--steps", str(s["steps"]), "--warmup", str(s["warmup"]), "--workers", str(s["workers"]),
            "--device", cfg["device"], "--json-out", str(out)]
    if shards:
        argv += ["--shards", shards]
    train_step.main(argv)
    rows = json.loads(out.read_text())
    by = {r["name"]: r["step_ms"] for r in rows}
    online = next((r["step_ms"] for r in rows if r["name"].startswith("D online")), None)
    stored, plain = by.get("D stored"), by.get("D plain (no teacher)")
    return {"rows": rows, "shards": shards or "train_step's own phantom build",
            "online_over_stored": online / stored if online and stored else None,
            "plain_over_stored": plain / stored if plain and stored else None}


def section_table(cfg: dict, work: Path, budget, shards: str | None, students: dict | None) -> dict:
    """The ablation's cost table for A-E: loop step ms (Trainer, stored embeddings) + synthetic figures."""
    import train_step

    s = cfg["step"]
    family = cfg["table_family"]
    pattern = cfg["families"][family][0]
    if shards is None:
        shards = str(train_step.build_phantom(work / "table-shards", 96, 128))
    base = dict(shards=shards, batch_size=s["batch_size"], workers=s["workers"], device=cfg["device"],
                amp="bf16", steps=10_000, progress=False, eval_every=0, **{"optim.warmup_steps": 1})
    trainers = {v: train_step.make_trainer({**base, "out": str(work / f"table-run-{v}")}, model=pattern.format(v=v))
                for v in VARIANTS}
    loop = {r["name"]: r for r in train_step.time_round_robin(trainers, s["steps"], s["warmup"])}
    synthetic = {r["variant"]: r for r in (students or {}).get("rows", []) if r["family"] == family}
    rows = []
    for v in VARIANTS:
        e = synthetic.get(v, {})
        step_ms = loop[v]["step_ms"]
        # The keys and their meaning are those of train.evaluation.runner's summary (ablation rows).
        rows.append({"run": v, "config": pattern.format(v=v), "inference_img_per_s": e.get("inference_img_per_s"),
                     "train_step_ms": e.get("train_step_ms"), "synthetic_train_img_per_s": e.get("train_img_per_s"),
                     "latency_ms": e.get("latency_ms_per_img"), "peak_memory_mb": e.get("peak_memory_mb"),
                     "step_memory_delta_mb": e.get("step_memory_delta_mb"), "gflops_per_img": e.get("gflops_per_img"),
                     "patch_usage_pct": e.get("patch_usage_pct"), "step_ms": step_ms,
                     "train_img_per_s": 1000.0 * s["batch_size"] / step_ms})
    return {"family": family, "rows": rows, "batch_size": s["batch_size"], "shards": shards}


# --------------------------------------------------------------------------- running, targets, report


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


def device_name(device: str, tiny: bool) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'; CPUs: 'cpu-<model name>'."""
    import torch

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = "cpu"
        try:
            model = next(line.split(":", 1)[1] for line in open("/proc/cpuinfo") if line.startswith("model name"))
            name = f"cpu {model}"
        except (OSError, StopIteration):
            name = f"cpu {platform.processor() or platform.machine()}"
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug + ("-tiny" if tiny else "")


def evaluate_targets(sections: dict, tiny: bool) -> list[dict]:
    build = sections.get("build") or {}
    students = sections.get("students") or {}
    family = "tiny" if tiny else "vit-s16"
    e_over_a = (students.get("E_over_A") or {}).get(family, {}).get("train_img_per_s")
    targets = [("build throughput / teacher forward (ViT-B/16 teacher)", ">= 0.9", build.get("ratio"),
                TARGETS["build_ratio"]),
               (f"E train img/s / A train img/s ({family}{'' if tiny else ', 224 px, bf16'})", ">= 1.5", e_over_a,
                TARGETS["e_over_a_train"])]
    return [{"name": name, "target": text, "value": value,
             "met": None if value is None else bool(value >= threshold)} for name, text, value, threshold in targets]


def run_suite(tiny: bool, device: str, budget_s: float, work: Path, log=print) -> dict:
    import torch

    cfg = settings(tiny, device)
    budget = Budget(budget_s)
    result = {"device": device_name(device, tiny), "device_kind": device, "mode": "tiny" if tiny else "full",
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "budget_s": budget_s,
              "settings": {k: v for k, v in cfg.items() if k != "families"} | {
                  "families": {f: {"configs": p, "overrides": o} for f, (p, o) in cfg["families"].items()}},
              "sections": {}, "skipped": [], "errors": {}, "section_seconds": {}}
    sections = result["sections"]

    def run(name, fn):
        if budget.left() < cfg["reserve"][name]:
            note = f"skipped: {budget.left():.0f} s of the {budget_s:.0f} s budget left, the section needs ~{cfg['reserve'][name]} s"
            result["skipped"].append({"section": name, "reason": note})
            log(f"[{name}] {note}")
            return
        log(f"[{name}] starting ({budget.elapsed():.0f} s elapsed)")
        start = time.perf_counter()
        try:
            sections[name] = fn()
        except Exception as exc:  # noqa: BLE001 - record it, measure the rest
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            log(f"[{name}] failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        result["section_seconds"][name] = round(time.perf_counter() - start, 1)
        log(f"[{name}] done in {result['section_seconds'][name]} s")

    run("build", lambda: section_build(cfg, work, budget))
    shards = (sections.get("build") or {}).get("shards")
    run("students", lambda: section_students(cfg, work, budget))
    run("train_step", lambda: section_train_step(cfg, work, budget, shards))
    run("table", lambda: section_table(cfg, work, budget, shards, sections.get("students")))
    result["targets"] = evaluate_targets(sections, tiny)
    result["elapsed_s"] = round(budget.elapsed(), 1)
    return result


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> list[str]:
    out = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(_fmt(r.get(k)) for k, _ in cols) + " |" for r in rows]
    return out


def markdown(result: dict) -> str:
    from cxrdr.train.evaluation.report import COST_COLUMNS, markdown_table

    s = result["sections"]
    md = [f"# GPU benchmark suite: {result['device']}", "",
          f"- mode **{result['mode']}**, torch {result['torch']}, CUDA {result['cuda']}, {result['date']}",
          f"- command: `python benchmarks/{result['command']}`; {result['elapsed_s']} s of a {result['budget_s']:.0f} s budget",
          ""]
    if result["mode"] == "tiny":
        md += ["*Tiny CPU run (test-sized models and data): it checks that the suite works; its figures say "
               "nothing about the targets, which apply to the GPU run.*", ""]
    md += ["## Targets", "", "| target | required | measured | met |", "|---|---|---|---|"]
    for t in result["targets"]:
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        md.append(f"| {t['name']} | {t['target']} | {_fmt(t['value'])} | {met} |")
    md.append("")
    for item in result["skipped"]:
        md += [f"- section **{item['section']}** {item['reason']}"]
    for name, err in result["errors"].items():
        md += [f"- section **{name}** failed: `{err}`"]
    if result["skipped"] or result["errors"]:
        md.append("")
    if "build" in s:
        b = s["build"]
        md += ["## 1. Build throughput vs teacher forward", "",
               f"{b['samples']} samples of {b['source']}, teachers `{b['teachers']}` on {b['device']}, "
               f"K={b['n_aug']}, S={b['n_captions']}, store {b['store_size']} px, {b['workers']} workers, "
               f"batch {b['batch_size']} records.", "",
               *_table([b], [("build_samples_per_s", "build samples/s"), ("teacher_samples_per_s", "teacher-only samples/s"),
                             ("ratio", "ratio"), ("build_seconds", "build s"), ("teacher_seconds", "teacher s")]), "",
               f"time split (s): {b['time_split_seconds']}", ""]
    if "students" in s:
        st = s["students"]
        md += ["## 2. Students A-E", "", st["note"] + ".", "",
               *_table(st["rows"], [("family", "family"), ("config", "config"), ("image_tower", "image tower"),
                                    ("image_size", "px"), ("params_m", "params M"),
                                    ("train_img_per_s", "train img/s"), ("inference_img_per_s", "infer img/s"),
                                    ("latency_ms_per_img", "latency ms"), ("peak_memory_mb", "peak MB"),
                                    ("gflops_per_img", "GFLOPs/img"), ("patch_usage_pct", "patch use %")]), ""]
        for family, r in st["E_over_A"].items():
            md.append(f"- {family}: E / A train img/s {_fmt(r['train_img_per_s'])}x, inference "
                      f"{_fmt(r['inference_img_per_s'])}x, GFLOPs {_fmt(r['gflops_per_img'])}x")
        md += [f"- not measured: {x}" for x in st["skipped"]] + [""]
    if "train_step" in s:
        ts = s["train_step"]
        md += ["## 3. Training step: stored embeddings vs teacher online vs no teacher", "",
               f"Trainer steps (data + forward + losses + backward + AdamW) on {ts['shards']}.", "",
               *_table(ts["rows"], [("name", "configuration"), ("model", "model"), ("step_ms", "ms/step"),
                                    ("data_ms", "data ms"), ("teacher_ms", "teacher ms"), ("batch_size", "batch")]), "",
               f"online / stored: {_fmt(ts['online_over_stored'])}x; no teacher / stored: "
               f"{_fmt(ts['plain_over_stored'])}x", ""]
    if "table" in s:
        tb = s["table"]
        md += [f"## 4. Efficiency table ({tb['family']}, the layout of `train experiment ablation`)", "",
               "infer img/s, synth step ms, latency, GFLOPs, peak MB: section 2 (synthetic inputs, target keep "
               f"rate); loop step ms / train img/s: the training loop's mean step at batch {tb['batch_size']}.", "",
               markdown_table(tb["rows"], COST_COLUMNS + ["step_ms", "train_img_per_s"], first="run"), ""]
    return "\n".join(md)


def write_results(result: dict, out_dir: Path) -> tuple[Path, Path]:
    from cxrdr.train.evaluation.report import jsonable

    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{result['device']}.json", out_dir / f"{result['device']}.md"
    json_path.write_text(json.dumps(jsonable(result), indent=1) + "\n")
    md_path.write_text(markdown(result) + "\n")
    return json_path, md_path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="cuda, cuda:N, cpu or auto")
    parser.add_argument("--tiny", action="store_true", help="CPU-sized models and data (what the tests run)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all sections [480; tiny: 120]")
    parser.add_argument("--out-dir", default=str(HERE / "results"), help="where <device>.json/.md go")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)

    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_suite: --device {device}: CUDA is not available here (use --tiny on CPU)", file=sys.stderr)
        return 2
    if not device.startswith("cuda") and not args.tiny:
        print("gpu_suite: the full suite needs a CUDA device (--device cuda); on CPU run --tiny", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = args.budget or (120.0 if args.tiny else 480.0)
    with tempfile.TemporaryDirectory(prefix="gpu-suite-") as tmp:
        result = run_suite(args.tiny, device, budget, Path(tmp), log=lambda m: print(m, file=sys.stderr, flush=True))
    json_path, md_path = write_results(result, Path(args.out_dir))
    print(markdown(result))
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
