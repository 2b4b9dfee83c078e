"""Kernel-time profile of the real training step (``Trainer.train_step``) per student variant.

    python benchmarks/profile_step.py --shards SHARDS --out-dir DIR [--models A,D,E] [--batch-size 256]
    python benchmarks/profile_step.py --encoder --out-dir DIR --models A,E      # the image encoder's inference

Writes ``profile-<model>.txt`` per model: torch.profiler's operator table over a few steps (after
warm-up steps), sorted by total CUDA time, then by self CUDA time. This is what
benchmarks/results/profiles/ holds; read it beside the suite's loop section (``gpu_suite.py``) to
see where a variant's extra step time goes. On CPU it profiles CPU time (slow, for a check only).

On CUDA the file starts with where the GPU waited: the gaps between its kernels (and copies) over the
profiled steps, each attributed to the phase the host was in meanwhile (``cxrdr.train.loop.PHASES``: data,
forward, backward, optimizer; "between phases" for the rest of the step: the loss bookkeeping, the
scheduler, the timing block's edges). A step whose GPU is 75 % busy shows there what the other 25 % waited for.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def idle_by_phase(gpu_spans: list[tuple[float, float]], phases: dict[str, list[tuple[float, float]]]) -> dict:
    """How long the GPU waited, and during which host phase: the gaps between the GPU's (merged) activity from its
    first to its last, each split over the host ranges of ``phases`` (name -> (start, end) ranges, one clock with
    the GPU's) it overlaps; what no range covers is "between phases". Returns {"busy", "idle", "by_phase": {name:
    idle}, "gaps": count} in the spans' unit."""
    from cxrdr.train.evaluation.efficiency import merged_spans

    busy = merged_spans(gpu_spans)
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:])]
    ranges = {name: merged_spans(spans) for name, spans in phases.items()}
    by_phase = dict.fromkeys([*ranges, "between phases"], 0.0)
    for start, end in gaps:
        covered = 0.0
        for name, spans in ranges.items():
            overlap = sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)
            by_phase[name] += overlap
            covered += overlap
        by_phase["between phases"] += max(0.0, (end - start) - covered)
    return {"busy": sum(b - a for a, b in busy), "idle": sum(b - a for a, b in gaps), "by_phase": by_phase,
            "gaps": len(gaps)}


def idle_report(prof, steps: int) -> str:
    """``idle_by_phase`` of a CUDA profile, per step, as text (empty without CUDA activity)."""
    from torch.autograd import DeviceType

    from cxrdr.train.evaluation.efficiency import gpu_activity_spans
    from cxrdr.train.loop import PHASES

    events = list(prof.profiler.kineto_results.events())
    gpu = [(start / 1e3, end / 1e3) for start, end in gpu_activity_spans(events)]
    if not gpu:
        return ""
    # the phase ranges as the host ran them (not their copies on the GPU's timeline)
    phases = {name: [(e.start_ns() / 1e6, e.end_ns() / 1e6) for e in events
                     if e.name() == label and e.device_type() == DeviceType.CPU] for name, label in PHASES.items()}
    r = idle_by_phase(gpu, phases)
    lines = [f"GPU busy {r['busy'] / steps:.1f} ms a step, waiting {r['idle'] / steps:.1f} ms a step in "
             f"{r['gaps']} gaps over {steps} steps; the host meanwhile, ms a step:"]
    lines += [f"  {name:<15} {ms / steps:7.2f}" for name, ms in sorted(r["by_phase"].items(), key=lambda kv: -kv[1])]
    return "\n".join(lines) + "\n\n"


def profile_model(model: str, shards: str, batch_size: int, device: str, warmup: int, steps: int,
                  workers: int, cuda_graphs: bool = False, text_graphs: bool = False) -> str:
    from torch.profiler import ProfilerActivity, profile

    import train_step

    base = train_step.bench_config(shards, batch_size, workers, device)
    with tempfile.TemporaryDirectory(prefix="profile-step-") as out:
        settings = {"cuda_graphs": "on" if cuda_graphs or text_graphs else "off", "cuda_graphs_text": text_graphs}
        trainer, batches = train_step.make_trainer({**base, "out": out, **settings}, model=model)
        try:
            cuda = trainer.device.type == "cuda"
            sync = train_step.sync_fn(trainer.device)
            for _ in range(warmup):
                trainer.train_step(batches, log_balance=False)
            sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    trainer.train_step(batches, log_balance=False)
                sync()
        finally:
            batches.close()
    graphs = f", image tower blocks{' and text layers' if text_graphs else ''} as CUDA graphs " \
        f"({len(trainer.block_graphs)} captured)" if trainer.block_graphs is not None else ""
    return (f"{model}: {steps} steps of batch {batch_size} on {device} after {warmup} warm-up steps{graphs}\n"
            + (idle_report(prof, steps) if cuda else "") + operator_tables(prof, cuda))


def operator_tables(prof, cuda: bool) -> str:
    """torch.profiler's operator table sorted by total CUDA time, then by self CUDA time (CPU time off CUDA), and on
    CUDA by the host's own time: where a run bound by its host (E on the H100, 63 % busy) spends it."""
    key = "cuda_time_total" if cuda else "cpu_time_total"
    averages = prof.key_averages()
    return (averages.table(sort_by=key, row_limit=45, max_name_column_width=70) + "\n"
            + averages.table(sort_by="self_" + key, row_limit=45, max_name_column_width=70)
            + ("\n" + averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
               if cuda else ""))


def profile_encoder(model: str, batch_size: int, device: str, warmup: int, steps: int) -> str:
    """The same operator tables for the image encoder's inference (``encode_image`` of ``model``'s config, eval
    mode, bf16 autocast and the loop's CUDA math, a synthetic batch): the suite's "E / A inference" figure, whose E
    ran at 12.5 % MFU against A's 17.5 % on the H100 at 48c40d0, shows here where its batch goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from cxrdr.train.device import amp_dtype_for, autocast
    from cxrdr.train.evaluation.efficiency import loop_math
    from cxrdr.train.models import build_student
    from cxrdr.train.models.config import StudentConfig

    dev = torch.device(device)
    student = build_student(StudentConfig.from_yaml(model)).to(dev).eval()
    x = torch.rand(batch_size, 1, int(student.image_size), int(student.image_size), device=dev)
    cuda = dev.type == "cuda"

    def encode():
        with torch.no_grad(), autocast(dev, amp_dtype_for("bf16", dev)), loop_math(dev):
            student.encode_image(x)

    for _ in range(warmup):
        encode()
    if cuda:
        torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            encode()
        if cuda:
            torch.cuda.synchronize(dev)
    return (f"{model} image encoder: {steps} batches of {batch_size} on {device} after {warmup} warm-up batches\n"
            + operator_tables(prof, cuda))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", help="a reinforce build's shard folder (the training step's profiles)")
    parser.add_argument("--encoder", action="store_true",
                        help="profile the image encoder's inference instead (profile-<model>-encoder.txt; no shards)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--models", default="A,D,E")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the training steps with the image tower's blocks as CUDA graphs "
                             "(profile-<model>-graphs.txt)")
    parser.add_argument("--cuda-graphs-text", action="store_true",
                        help="and the packed text tower's layers too (profile-<model>-graphs-text.txt)")
    args = parser.parse_args(argv)
    if not args.encoder and not args.shards:
        parser.error("--shards is required for the training step's profiles (or --encoder)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for model in [m for m in args.models.split(",") if m]:
        if args.encoder:
            path = out / f"profile-{model}-encoder.txt"
            path.write_text(profile_encoder(model, args.batch_size, args.device, args.warmup, args.steps))
        else:
            suffix = "-graphs-text" if args.cuda_graphs_text else "-graphs" if args.cuda_graphs else ""
            path = out / f"profile-{model}{suffix}.txt"
            path.write_text(profile_model(model, args.shards, args.batch_size, args.device, args.warmup, args.steps,
                                          args.workers, args.cuda_graphs, args.cuda_graphs_text))
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
