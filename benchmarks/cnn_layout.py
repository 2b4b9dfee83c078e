"""Milliseconds of a CNN image tower in channels_last against the default layout, forward and training step.

    python benchmarks/cnn_layout.py                                   # tiny-cnn-D at its 96 px, batch 32, CPU
    python benchmarks/cnn_layout.py --model teacher-lite2-gpu-D --device cuda --batch 256   # the GPU recipe's teacher

``EfficientNetTower`` runs channels_last by default (``image_kwargs: {channels_last: false}`` keeps the default
layout): on this CPU oneDNN's depthwise convolutions gained from it (the demo's teacher step 210 -> 151 ms), and on
a GPU cuDNN may or may not (the recipe's add-teacher went 38.9 -> 51.8 s on a lease where other figures slowed too).
This builds the model config's image tower twice with the same weights, one in each layout, and times, interleaved
(``train_step.time_interleaved``), median of ``--rounds`` after a warm-up: the forward under no_grad (add-teacher's
and the online teacher's path) and forward + backward of the tower (training). On CUDA both run under bf16 autocast, as the loop and add-teacher do
(``--no-amp``: fp32). It prints the largest difference of the two layouts' features, and exits 1 where they differ
beyond float rounding in fp32.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from train_step import time_interleaved  # noqa: E402

from cxrdr.train.models.config import StudentConfig  # noqa: E402
from cxrdr.train.models.factory import build_image_tower  # noqa: E402
from cxrdr.train.models.image_towers import EFFNET_STAGES, EfficientNetTower  # noqa: E402

FP32_TOLERANCE = 1e-4  # of the features' largest magnitude; measured 5e-6 on this CPU (tests/test_models.py)


def towers(model: str, device: str, pretrained: bool) -> dict[str, EfficientNetTower]:
    """The model's image tower in each layout, with the same weights."""
    config = StudentConfig.from_yaml(model)
    if config.image_tower not in EFFNET_STAGES:
        raise SystemExit(f"{model}: its image tower is {config.image_tower}, not a CNN tower ({list(EFFNET_STAGES)})")
    built = {}
    for name, last in (("channels_last", True), ("contiguous", False)):
        cfg = copy.deepcopy(config)
        cfg.image_kwargs = {**cfg.image_kwargs, "channels_last": last}
        built[name] = build_image_tower(cfg, load_pretrained=pretrained and not built)
    built["contiguous"].load_state_dict(built["channels_last"].state_dict())  # copies keep each tower's layout
    return {name: tower.to(device).train() for name, tower in built.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-cnn-D", help="a student config with a CNN image tower")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--no-amp", action="store_true", help="fp32 on CUDA too (the CPU always runs fp32)")
    parser.add_argument("--pretrained", action="store_true", help="the packaged ImageNet weights (speed is alike)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    built = towers(args.model, args.device, args.pretrained)
    size = StudentConfig.from_yaml(args.model).image_size
    x = torch.rand(args.batch, 3, size, size, device=args.device)
    amp = args.device.startswith("cuda") and not args.no_amp
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if amp else contextlib.nullcontext)

    def forward(tower):
        with torch.no_grad(), autocast():
            return tower(x).patches

    def step(tower):
        with autocast():
            loss = tower(x).patches.float().square().mean()
        loss.backward()
        tower.zero_grad(set_to_none=True)

    features = {name: forward(tower).float() for name, tower in built.items()}
    calls = {(name, what): (lambda fn=fn, tower=tower: fn(tower))
             for name, tower in built.items() for what, fn in (("forward", forward), ("step", step))}
    # interleaved: a drifting machine moves both layouts alike
    timed = time_interleaved(calls, args.device, timed_steps=args.rounds, warmup=1)
    median = {key: result["median_ms"] for key, result in timed.items()}
    print(f"{args.model} image tower, batch {args.batch} at {size} px on {args.device}"
          f"{' (bf16 autocast)' if amp else ' (fp32)'}, median of {args.rounds} rounds")
    print("| layout | forward ms (no_grad) | forward + backward ms |")
    print("|---|---|---|")
    for name in built:
        print(f"| {name} | {median[name, 'forward']:.2f} | {median[name, 'step']:.2f} |")
    for what in ("forward", "step"):
        print(f"channels_last / contiguous, {what}: {median['channels_last', what] / median['contiguous', what]:.3f}")
    diff = (features["channels_last"] - features["contiguous"]).abs().max().item()
    scale = features["contiguous"].abs().max().item()
    print(f"largest feature difference: {diff:.3g} (features up to {scale:.3g})")
    if not amp and diff > FP32_TOLERANCE * scale:
        print(f"the layouts' features differ beyond float rounding ({FP32_TOLERANCE:g} of their scale)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
