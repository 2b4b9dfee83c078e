"""What token dropping (variant E) buys over A: inference and training images/s at E's target keep rate.

E drops patch tokens after transformer block ``drop_layer``; during its keep-rate warm-up it keeps
(nearly) all of them, so it is timed here past the warm-up (``FAR_STEP``), as deployed. Each pair
(A, E) is measured in alternation, ``--rounds`` times, and the median of each is reported, so
drifting load on a shared machine hits both alike.

    python benchmarks/token_dropping.py                       # CPU ladder (cpu-A/E) and ViT-S/16 224 (A/E)
    python benchmarks/token_dropping.py --pairs cpu --rounds 5
    python benchmarks/token_dropping.py --device cuda --batch-size 64 --json-out bench.json
    python benchmarks/token_dropping.py --pairs vit-s16-224,vit-s16-224-former-heads   # what E's head convs cost

Inference: the image encoder on a batch (``cxrdr.train.evaluation.efficiency.image_encoder_metrics``).
Training: one AdamW step of the student on a synthetic batch (the trainer's Task: forward and the
training objective, then backward and update), as ``efficiency_metrics`` measures it: on CUDA as the
loop runs it (bf16 autocast, the loop's CUDA math, fused AdamW). The real loop's E / A (data,
host work and all) is benchmarks/gpu_suite.py's loop section.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from train_step import FORMER_HEADS_E  # a sibling benchmark (this folder is on sys.path when run as a script)

PAIRS = {"cpu": ("cpu-A", "cpu-E"), "vit-s16-224": ("A", "E"), "vit-s16-224-former-heads": ("A", "E-former-heads")}
# names that are a config with overrides: E with default.yaml's former local-alignment heads (train_step.FORMER_HEADS_E)
OVERRIDDEN = {"E-former-heads": ("E", FORMER_HEADS_E)}


def build(name: str):
    """The student a pair names: a config name, or one of OVERRIDDEN."""
    from cxrdr.train.models import build_student
    from cxrdr.train.models.config import StudentConfig

    if name not in OVERRIDDEN:
        return build_student(name)
    config, overrides = OVERRIDDEN[name]
    return build_student(StudentConfig.from_yaml(config, **overrides))


def measure_pair(names: tuple[str, str], batch_size: int, rounds: int, device: str) -> dict:
    from cxrdr.train.evaluation.efficiency import FAR_STEP, efficiency_metrics

    models = {name: build(name).to(device) for name in names}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(rounds):
        for name, model in models.items():
            runs[name].append(efficiency_metrics(model, batch_size=batch_size, iters=3, warmup=1, step=FAR_STEP))
    out = {}
    for name, rows in runs.items():
        out[name] = {key: statistics.median(r[key] for r in rows)
                     for key in ("inference_img_per_s", "train_img_per_s", "gflops_per_img", "patch_usage_pct")}
    a, e = (out[n] for n in names)
    out["E_over_A"] = {key: e[key] / a[key] for key in ("inference_img_per_s", "train_img_per_s", "gflops_per_img")}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", default="cpu,vit-s16-224", help=f"comma list of {sorted(PAIRS)}")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json-out", help="also write the results here")
    args = parser.parse_args(argv)

    import torch

    from cxrdr.common.allocator import keep_freed_memory

    keep_freed_memory()  # as the train CLI does
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    results = {}
    for key in [p.strip() for p in args.pairs.split(",") if p.strip()]:
        if key not in PAIRS:
            parser.error(f"unknown pair {key!r}; choose from {sorted(PAIRS)}")
        results[key] = measure_pair(PAIRS[key], args.batch_size, args.rounds, args.device)
    print(f"\ntoken dropping at the target keep rate ({args.device}, {torch.get_num_threads()} threads, "
          f"batch {args.batch_size}, median of {args.rounds} alternating rounds)")
    print(f"{'pair':<24} {'model':<14} {'infer img/s':>12} {'train img/s':>12} {'GFLOPs/img':>11} {'patches %':>10}")
    for key, res in results.items():
        for name in PAIRS[key]:
            r = res[name]
            print(f"{key:<24} {name:<14} {r['inference_img_per_s']:12.1f} {r['train_img_per_s']:12.1f} "
                  f"{r['gflops_per_img']:11.3f} {r['patch_usage_pct']:10.0f}")
        ratio = res["E_over_A"]
        print(f"{key:<24} {'E / A':<14} {ratio['inference_img_per_s']:11.2f}x {ratio['train_img_per_s']:11.2f}x "
              f"{ratio['gflops_per_img']:10.2f}x")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
