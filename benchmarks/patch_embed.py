"""Milliseconds of a ViT's patch embedding: the convolution against the same map as one matrix product.

    python benchmarks/patch_embed.py                              # this machine's CPU: ViT-S/16 at 224, batch 32
    python benchmarks/patch_embed.py --device cuda --batch 256 --amp

``cxrdr.common.patch_conv.PatchConv2d`` (swapped into the students' ViT towers and the open_clip teachers)
computes a kernel-equals-stride convolution on CUDA as patches @ its weight matrix (``as_matmul``) and keeps
the convolution on the CPU. This times both, forward alone and forward + backward (the weight's gradient, as
in training: the images need none), interleaved, median of ``--rounds`` after a warm-up, and prints the
largest difference of their outputs. ``--amp``: under bf16 autocast, as the loop runs on a GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cxrdr.common.patch_conv import PatchConv2d  # noqa: E402


def timed_ms(fn, device: str, rounds: int) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()  # warm-up: kernel choice, allocations
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--patch", type=int, default=16)
    parser.add_argument("--width", type=int, default=384, help="embedding width (ViT-S 384, ViT-B 768)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, args.width, args.patch, stride=args.patch).to(args.device)
    matmul = PatchConv2d.sharing(conv)
    x = torch.rand(args.batch, 3, args.size, args.size, device=args.device)
    amp = (torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16) if args.amp
           else contextlib.nullcontext())

    def forward(fn):
        def run():
            with torch.no_grad(), amp:
                fn(x)
        return run

    def forward_backward(fn):
        def run():
            with amp:
                out = fn(x)
            out.float().square().mean().backward()
            conv.weight.grad = conv.bias.grad = None
        return run

    with torch.no_grad(), amp:
        diff = (conv(x).float() - matmul.as_matmul(x).float()).abs().max().item()
    print(f"{args.device}, batch {args.batch}, {args.size} px, patch {args.patch}, width {args.width}, "
          f"{'bf16 autocast' if args.amp else 'fp32'}, torch threads {torch.get_num_threads()}; "
          f"max |conv - matmul| {diff:.2e}")
    for label, wrap in (("forward", forward), ("forward + backward", forward_backward)):
        ms = {name: timed_ms(wrap(fn), args.device, args.rounds)
              for name, fn in (("convolution", conv), ("matrix product", matmul.as_matmul))}
        print(f"{label:<20} convolution {ms['convolution']:8.2f} ms   matrix product {ms['matrix product']:8.2f} ms"
              f"   ({ms['convolution'] / ms['matrix product']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
