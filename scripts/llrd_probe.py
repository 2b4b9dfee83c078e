#!/usr/bin/env python
"""Does layer-wise LR decay brake an image tower that starts from scratch? (issue 36's teacher)

The GPU recipe's ViT-B/16 teacher barely moved in 120 steps (CLIP term 5.61 -> 5.41; docs/experiments.md), while
`optim.llrd` 0.85, a fine-tuning device, ran its patch embedding at 0.85**14 = 0.10 of the learning rate. This
probe asks the question at CPU size: a 12-block ViT from scratch (width 96, 64 px, 8x8 patches: as deep as
ViT-S/B, so the same decay reaches its first layers) + the tiny BERT text tower (from scratch too), plain CLIP
(variant A), batch 64, 400 steps, on phantom:3000 (source seed 0).

- choose: seed 0, the shards' val split, final val mean recall, llrd {0.85, 1.0} x lr {5e-4, 1e-3, 2e-3}: the
  best lr of each llrd;
- report: each llrd at its chosen lr, fresh seeds 1-3, on a report set no choice read (phantom:600, source
  seed 104 as image-only's report set, all test); mean +- 95 % CI, paired per-seed differences, beside chance.

    python scripts/llrd_probe.py choose   # ~13 min on 2 cores (two runs at a time, one thread each)
    python scripts/llrd_probe.py report   # ~15 min
    python scripts/llrd_probe.py summary > docs/results/llrd-probe.json
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cxrdr.experiments.stats import t_interval

ROOT = Path("runs/probes/llrd")
LLRDS = (0.85, 1.0)
LRS = (0.0005, 0.001, 0.002)
STEPS, BATCH, EVAL_EVERY = 400, 64, 50
CHOICE_SEED, REPORT_SEEDS = 0, (1, 2, 3)
MODEL = """# the probe's student: a 12-block ViT from scratch at 64 px, tiny BERT from scratch, global CLIP only
image_tower: vit_micro
image_kwargs: {depth: 12, embed_dim: 96, num_heads: 3}
image_size: 64
global_pool: avg
text_tower: tiny
context_length: 64
embed_dim: 128
local_heads: 4
variant: A
variants: {A: {}}
"""
BUILD = dict(teachers="random:tiny", n_aug=1, n_captions=1, store_size=64, shard_size=500, workers=2, batch_size=64,
             device="cpu", progress=False)


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def build_sets() -> None:
    ROOT.mkdir(parents=True, exist_ok=True)
    (ROOT / "model.yaml").write_text(MODEL)
    from cxrdr.reinforce.build import build
    from cxrdr.reinforce.options import BuildOptions
    for folder, source, source_options in (("shards", "phantom:3000", {"size": 64, "seed": 0}),
                                           ("report", "phantom:600", {"size": 64, "seed": 104, "split": "test"})):
        if not (ROOT / folder / "dataset.json").exists():
            build(BuildOptions(source=source, source_options=source_options, out=ROOT / folder, **BUILD))


def run_name(llrd: float, lr: float, seed: int) -> str:
    return f"llrd{llrd}-lr{lr}-s{seed}"


def train(llrd: float, lr: float, seed: int, report: bool) -> None:
    out = ROOT / run_name(llrd, lr, seed)
    if (out / "summary.json").exists():
        return
    args = [_bin("train"), "run", "--shards", str(ROOT / "shards"), "--model", str(ROOT / "model.yaml"),
            "--out", str(out), "--steps", str(STEPS), "--batch-size", str(BATCH), "--mode", "plain",
            "--lr", str(lr), "--llrd", str(llrd), "--seed", str(seed), "--eval-every", str(EVAL_EVERY),
            "--workers", "1", "--no-progress", "--overwrite"]
    args += ["--eval-shards", str(ROOT / "report"), "--eval-split", "test"] if report else ["--eval-split", "val"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with (ROOT / f"{out.name}.log").open("w") as log:
        subprocess.run(args, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)


def _run_all(jobs: list[tuple]) -> None:
    """Two runs at a time, one thread each: the 2-core box's best throughput."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda job: train(*job), jobs))


def curve(name: str) -> list[dict]:
    lines = [json.loads(line) for line in (ROOT / name / "metrics.jsonl").open()]
    return [{"step": d["step"], "mean_recall": d["mean_recall"], "chance": d["chance_mean_recall"]}
            for d in lines if d.get("kind") == "eval" and "mean_recall" in d]


def chosen_lrs() -> dict[float, float]:
    return {llrd: max(LRS, key=lambda lr: curve(run_name(llrd, lr, CHOICE_SEED))[-1]["mean_recall"])
            for llrd in LLRDS}


def _mean_ci(values: list[float]) -> dict:
    mean, half = t_interval(values)
    return {"mean": mean, "ci95": half, "values": [float(v) for v in values]}


def summary() -> dict:
    choice = {f"llrd {llrd}, lr {lr}": curve(run_name(llrd, lr, CHOICE_SEED)) for llrd in LLRDS for lr in LRS}
    lrs = chosen_lrs()
    report = {}
    finals = {}
    for llrd in LLRDS:
        runs = {seed: curve(run_name(llrd, lrs[llrd], seed)) for seed in REPORT_SEEDS}
        finals[llrd] = [runs[s][-1]["mean_recall"] for s in REPORT_SEEDS]
        report[f"llrd {llrd}"] = {"lr": lrs[llrd], "final_mean_recall": _mean_ci(finals[llrd]),
                                  "curves": {str(s): c for s, c in runs.items()}}
    diff = [b - a for a, b in zip(finals[LLRDS[0]], finals[LLRDS[1]])]
    chance = curve(run_name(LLRDS[0], lrs[LLRDS[0]], REPORT_SEEDS[0]))[-1]["chance"]
    return {"probe": __doc__.split("\n\n")[0], "model": MODEL, "steps": STEPS, "batch_size": BATCH,
            "choice": {"set": "phantom:3000 (source seed 0) val split", "seed": CHOICE_SEED,
                       "rule": "highest final val mean recall per llrd",
                       "chosen_lr": {str(k): v for k, v in lrs.items()}, "curves": choice},
            "report": {"set": "phantom:600 (source seed 104), test", "seeds": list(REPORT_SEEDS),
                       "chance_mean_recall": chance, "arms": report,
                       "llrd 1.0 - llrd 0.85 (paired by seed)": _mean_ci(diff)}}


if __name__ == "__main__":
    command = sys.argv[1:2]
    if command == ["choose"]:
        build_sets()
        _run_all([(llrd, lr, CHOICE_SEED, False) for llrd in LLRDS for lr in LRS])
    elif command == ["report"]:
        build_sets()
        lrs = chosen_lrs()
        _run_all([(llrd, lrs[llrd], seed, True) for seed in REPORT_SEEDS for llrd in LLRDS])
    elif command == ["summary"]:
        print(json.dumps(summary(), indent=1))
    else:
        raise SystemExit(__doc__)
