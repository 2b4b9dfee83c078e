"""Throughput of `reinforce build` versus the teacher's pure forward throughput.

Builds N phantom samples (default 200, teacher random:tiny, 2 DataLoader workers), then times
the teacher alone on the very same inputs: the stored images are decoded and their stored aug
params replayed (the crops the teacher saw during the build), batched like the build
(``--batch-size`` records -> K*B crops per image forward, B*(1+S) texts per text forward). Texts are
tokenized beforehand, untimed, for a teacher whose texts the build's workers tokenize (open_clip's:
``Teacher.text_tokenizer``), so that side is the forwards alone.

    ratio = build samples/s / teacher-forward samples/s

A ratio near 1 means decoding, augmenting and writing are hidden behind the teacher. Next to it,
the steady state: ``build_steady_samples_per_s`` counts the build's samples from the first batch the
build's main loop received to the end of the build (the workers' start-up and the first batch's
preparation left out), and ``steady_ratio`` compares it with the same teacher rate. Both sides
are timed warm: the teachers after a first forward (best of ``--teacher-repeats``), the build after
an untimed build of two records that pays the first build's one-time costs (imports).
It also prints wall and CPU milliseconds per sample for each step (worker steps: load/render +
resize, encode+decode, params+replay, captions; main thread: teacher, queueing; writer thread:
assembling, writing) and the CPU bound: with workers, teacher and writer sharing the same cores
the build cannot exceed cores / (CPU ms per sample), whatever the pipeline does; on a machine that
other jobs also use, the CPU figures are the ones that do not depend on the load. It also prints
where the build prepared for a CPU teacher (its process or the workers), the teacher's threads, and why
(``cpu_policy.where_to_prepare``: from the first two batches, prepared and timed in the build's process)
and, when it prepared in turn with the forward, the bound that puts on the ratio: t / (t + p).

``--replay`` takes ``cpu``, ``device`` or ``auto`` (as ``reinforce build --replay``), or several
separated by ``,``: each teacher set is then built once per replay location, e.g. both paths on a GPU
(``device``: the workers only decode, the build's process replays each batch's views on the GPU):

    python benchmarks/reinforce_throughput.py --n 1024 --workers 12 --batch-size 64 --device cuda \
        --teachers openclip:ViT-B-16 --replay cpu,device

``--teachers`` takes several teacher sets separated by ``;``: each is built and timed in turn, and
a table of their ratios ends the run, e.g. the cheap, the text and the image teacher on CPU:

    python benchmarks/reinforce_throughput.py --n 48 --workers 1 --batch-size 16 --n-aug 4 --n-captions 3 \
        --teachers "random:tiny;text:minilm;openclip:ViT-B-32,text:minilm"

(``openclip:ViT-B-32`` without a pretrained tag: random weights, the speed of the real architecture.)

``--profile-out FILE`` also samples the timed build's process thread by thread (the build's thread, its
embedding thread on a GPU, its writer thread; the workers' CPU is in the figures above; ``thread_sampler``), and
writes each thread's functions by own and by cumulative share of its wall time to FILE: where that process
spends, or waits out, what the teacher does not. The sampler takes the GIL every 5 ms, so a sampled run reads a
little slow; compare threads and functions within it, not its ratio with another run's.

Usage: python benchmarks/reinforce_throughput.py [--n 200] [--teachers random:tiny] [--workers 2] [--replay auto]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # sibling benchmarks and the repository's packages

from thread_sampler import sampled_threads  # noqa: E402


def teacher_forward_seconds(shards_dir: Path, teachers, batch_size: int, repeats: int = 1) -> tuple[float, int]:
    """Seconds the teachers alone need for the build's inputs (best of ``repeats``), and the sample count."""
    import numpy as np
    import torch

    from cxrdr.common.augment import replay_many
    from cxrdr.common.shards import iter_tar_samples, load_meta, read_dataset_info
    from cxrdr.reinforce.embed import worker_tokenizers
    from cxrdr.reinforce.prepare import decode_stored_image

    tokenizers = dict(worker_tokenizers(teachers))  # the teachers whose texts the build's workers tokenize
    info = read_dataset_info(shards_dir)
    samples = [s for shard in info["shards"] for _, s in iter_tar_samples(shards_dir / shard["name"])]
    sizes = sorted({t.image_size for t in teachers if t.has_images})
    batches = []
    for start in range(0, len(samples), batch_size):
        crops = {size: [] for size in sizes}
        texts = []
        chunk = samples[start:start + batch_size]
        for s in chunk:
            meta = load_meta(s["json"])  # aug params as replay reads them
            pixels = np.asarray(decode_stored_image(s[info["image_format"]]))
            for size in sizes:  # replay_many == stacked replay() calls, bit for bit
                crops[size].append(replay_many(pixels, meta["aug"], size))
            texts.append(s["txt"].decode())
        for s in chunk:
            texts += [c["text"] for c in load_meta(s["json"])["captions"]]
        # tokenized beforehand (untimed) where the build's workers tokenize: the forward alone is timed
        tokens = {name: tokenize(texts) for name, tokenize in tokenizers.items()}
        batches.append(({k: torch.cat(v) for k, v in crops.items()}, texts, tokens))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for crops, texts, tokens in batches:
            for t in teachers:
                if t.has_images:
                    t.encode_images(crops[t.image_size])
                if t.name in tokens:
                    t.encode_tokens(tokens[t.name])
                else:
                    t.encode_texts(texts)
        best = min(best, time.perf_counter() - start)
    return best, len(samples)


def measure(n: int = 200, teachers: str = "random:tiny", workers: int = 2, batch_size: int = 32, n_aug: int = 10,
            n_captions: int = 5, store_size: int = 256, device: str = "auto", files: bool = False,
            out: str | None = None, teacher_repeats: int = 2, replay: str = "auto",
            profile_out: str | None = None, profile_interval: float = 0.005) -> dict:
    """Build N phantom samples, then time the teachers alone on the same inputs; returns the figures.
    ``profile_out``: sample the timed build's threads every ``profile_interval`` seconds into that file
    (``thread_sampler``); the result's ``thread_samples`` then holds each thread's top functions."""
    import torch

    from cxrdr.reinforce.build import BuildOptions, build
    from cxrdr.reinforce.options import resolve_device
    from cxrdr.teachers import load_teachers

    device = resolve_device(device)
    loaded = load_teachers(teachers, device=device)
    root = Path(out or tempfile.mkdtemp(prefix="reinforce-bench-"))
    shards = root / "shards"
    # Warm the teachers up (first-call allocations) so neither side pays for it.
    for t in loaded:
        if t.has_images:
            t.encode_images(torch.rand(4, 1, t.image_size, t.image_size))
        t.encode_texts(["warm up"])
    source = f"phantom:{n}"
    if files:
        from cxrdr.reinforce.phantom import write_phantom_dataset

        source = f"jsonl:{write_phantom_dataset(n, root / 'data', progress=False)}"
    opts = BuildOptions(source=source, teachers=teachers, out=shards, n_aug=n_aug,
                        n_captions=n_captions, store_size=store_size, shard_size=max(1, n // 4),
                        workers=workers, batch_size=batch_size, device=device, replay=replay, progress=False)
    threads_before = torch.get_num_threads()
    # The first build in a process pays one-time costs that do not grow with the samples, as
    # loading the teachers does: imports (pyarrow imports pandas, where installed, on its first
    # table: 0.15-0.35 s), PIL plugins, caches. An untimed build of two records pays them here.
    build(dataclasses.replace(opts, out=root / "warm-up", limit=min(n, 2)), teachers=loaded)
    torch.set_num_threads(threads_before)
    with sampled_threads(Path(profile_out), profile_interval) if profile_out else contextlib.nullcontext() as sampler:
        start = time.perf_counter()
        info = build(opts, teachers=loaded)
        build_wall = time.perf_counter() - start
    build_rate = info["total_samples"] / build_wall
    torch.set_num_threads(threads_before)
    # The teacher alone gets its best of: all default threads, or one thread (on a shared, busy
    # CPU one thread is often faster); the ratio is therefore conservative.
    rates = {}
    for threads in sorted({threads_before, 1}):
        torch.set_num_threads(threads)
        forward_s, count = teacher_forward_seconds(shards, loaded, batch_size, repeats=teacher_repeats)
        rates[threads] = count / forward_s
    torch.set_num_threads(threads_before)
    best_threads = max(rates, key=rates.get)
    teacher_rate = rates[best_threads]
    n_built = max(1, info["total_samples"])
    split = info["build"]["time_split_seconds"]
    prep, main_cpu = {}, {}
    assemble_s = sum(r.get("assemble_seconds", 0.0) for r in info["build"].get("ranks", []))
    for r in info["build"].get("ranks", []):
        for k, v in (r.get("prepare_cpu_seconds") or {}).items():
            prep[k] = prep.get(k, 0.0) + v
        for k, v in (r.get("main_cpu_seconds") or {}).items():
            main_cpu[k] = main_cpu.get(k, 0.0) + v
    steady_s = steady_seconds(info, build_wall)
    start_up = start_up_seconds(info)
    start_up = {k: round(v, 3) for k, v in start_up.items()} if start_up else None
    steady_rate = info["total_samples"] / steady_s if steady_s else None
    choice = next((r["cpu_threads"] for r in info["build"].get("ranks", []) if r.get("cpu_threads")), None)
    replayed = ", ".join(sorted({str(r.get("replay")) for r in info["build"].get("ranks", [])}))
    return {"source": source, "device": device, "teachers": teachers, "workers": workers, "cpu_threads": choice,
            "replay": replayed,
            "batch_size": batch_size, "n_aug": n_aug, "n_captions": n_captions, "store_size": store_size,
            "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "samples": info["total_samples"], "build_seconds": build_wall, "build_samples_per_s": build_rate,
            "teacher_seconds": n_built / teacher_rate, "teacher_samples_per_s": teacher_rate,
            "teacher_best_threads": best_threads, "teacher_rate_by_threads": rates,
            "ratio": build_rate / teacher_rate, "build_steady_seconds": steady_s,
            "build_steady_samples_per_s": steady_rate, "start_up_seconds": start_up,
            "steady_ratio": steady_rate / teacher_rate if steady_rate else None,
            "time_split_seconds": split, "assemble_seconds": assemble_s,
            "prepare_cpu_seconds": prep, "main_cpu_seconds": main_cpu, "shards": str(shards),
            "thread_samples": sampler.summary() if sampler is not None else None}


def start_up_seconds(info: dict) -> dict | None:
    """The start-up before a build's main loop received its first batch, from the rank's stats, in two parts:
    ``setup``, the build's work before its shard loop (reading the source, the plan, the lock: ``wall_seconds``,
    the build's start to the end of its shard loop, less ``pipeline_seconds``, the shard loop), and
    ``first_batch``, the loop's wait for its first batch (the workers' start and first chunks). None without
    those (one local rank only)."""
    ranks = info["build"].get("ranks") or []
    if len(ranks) != 1 or ranks[0].get("first_batch_seconds") is None:
        return None
    r = ranks[0]
    return {"setup": r["wall_seconds"] - r["pipeline_seconds"], "first_batch": r["first_batch_seconds"]}


def steady_seconds(info: dict, build_wall: float) -> float | None:
    """Seconds of the build (``build_wall``: its call, timed by the caller) from the moment its main loop received
    the first batch to its end: the build less its ``start_up_seconds``. None without those."""
    start_up = start_up_seconds(info)
    if start_up is None:
        return None
    steady = build_wall - sum(start_up.values())
    return steady if steady > 0 else None


def report(m: dict) -> None:
    """Print a ``measure`` result: rates, wall and CPU ms per sample by step, the CPU bound."""
    split, prep, main_cpu = m["time_split_seconds"], m["prepare_cpu_seconds"], m["main_cpu_seconds"]
    teacher_rate, build_wall = m["teacher_samples_per_s"], m["build_seconds"]
    print(f"source {m['source']}, device {m['device']}, torch threads {m['torch_threads']}, cpus {m['cpus']}, "
          f"teachers {m['teachers']}, workers {m['workers']}, batch {m['batch_size']}, K={m['n_aug']}, "
          f"S={m['n_captions']}, store {m['store_size']}, replay {m['replay']}")
    print(f"build: {m['samples']} samples in {build_wall:.2f} s = {m['build_samples_per_s']:.1f} samples/s "
          f"(time split s: {split})")
    if m.get("build_steady_samples_per_s"):
        print(f"build from its first batch on (no worker start-up): {m['build_steady_seconds']:.2f} s = "
              f"{m['build_steady_samples_per_s']:.1f} samples/s, steady ratio {m['steady_ratio']:.3f}")
    print(f"teacher forward only, same batches: {m['teacher_seconds']:.2f} s = {teacher_rate:.1f} samples/s "
          f"(torch threads {m['teacher_best_threads']}; by threads: "
          + ", ".join(f"{t}: {r:.1f}/s" for t, r in m["teacher_rate_by_threads"].items()) + ")")
    n_built = max(1, m["samples"])
    ms = lambda seconds: 1000 * seconds / n_built  # noqa: E731
    prep_cpu = sum(prep.values())
    print(f"wall per sample (ms): prepare {ms(split['decode_augment']):.1f} (summed over the workers or the "
          f"build process, whichever prepared), "
          f"teacher {ms(split['teacher']):.1f} (alone {1000 / teacher_rate:.1f}), "
          + (f"replay in the build's process {ms(split['replay']):.1f}, " if "replay" in split else "")
          + f"loader wait {ms(split['loader_wait']):.1f}, waiting for the writer {ms(split.get('write_wait', 0.0)):.1f}; "
          f"writer thread: assemble {ms(m['assemble_seconds']):.1f}, write {ms(split['write']):.1f}; "
          f"teacher busy {split['teacher'] / build_wall:.0%} of wall")
    print(f"CPU per sample (ms): prepare {ms(prep_cpu):.1f} ["
          + ", ".join(f"{k} {ms(v):.2f}" for k, v in prep.items())
          + f"]; main thread: teacher {ms(main_cpu.get('teacher', 0.0)):.1f}, "
          f"queue {ms(main_cpu.get('queue', 0.0)):.2f}; writer thread: assemble {ms(main_cpu.get('assemble', 0.0)):.2f}; "
          f"the process during the teacher's forwards "
          f"(all its threads, spin-waits included) {ms(main_cpu.get('teacher_process', 0.0)):.1f}")
    if m.get("cpu_threads"):
        print(f"build's choice: {m['cpu_threads']['line']}")
        if m["cpu_threads"].get("workers_used") == 0:
            # Preparation and forward in turn: a sample takes at least p + t, whatever else is hidden.
            p_ms, t_ms = ms(split["decode_augment"]), 1000 / teacher_rate
            print(f"in turn: preparation {p_ms:.1f} ms + the teacher alone {t_ms:.1f} ms a sample -> ratio at most "
                  f"{t_ms / (t_ms + p_ms):.3f}")
    # Workers, main process and writer share the same cores: whatever the pipeline does, the
    # build runs at most at cores / (CPU per sample), with the teacher at its stand-alone cost.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # device replay on a CPU device is CPU work of the build's process too
    other_ms = ms(main_cpu.get("assemble", 0.0)) + ms(main_cpu.get("queue", 0.0)) + ms(split["write"]) \
        + (ms(split.get("replay", 0.0)) if m["device"] == "cpu" else 0.0)
    cpu_ms = ms(prep_cpu) + 1000 / teacher_rate + other_ms
    bound = cores * 1000 / cpu_ms
    budget = cores * 1000 / (0.8 * teacher_rate) - 1000 / teacher_rate - other_ms
    print(f"CPU bound: {cpu_ms:.1f} ms CPU per sample on {cores} cores -> at most {bound:.1f} samples/s on idle "
          f"cores, ratio at most {bound / teacher_rate:.3f}; ratio 0.8 needs prepare <= {budget:.1f} ms CPU/sample. "
          f"Load average {os.getloadavg()[0]:.1f} (other processes share these cores)")
    print(f"ratio build/teacher throughput: {m['ratio']:.3f}"
          + (f" (steady, from the first batch: {m['steady_ratio']:.3f})" if m.get("steady_ratio") else ""))
    print(f"shards in {m['shards']}")


def report_table(results: list[dict]) -> None:
    """One row per teacher set: rates, ratio, CPU ms per sample by stage, the build's thread choice."""
    print("\n| teachers | replay | samples | build /s | teacher alone /s (threads) | ratio | steady ratio | CPU "
          "ms/sample: prepare, teacher (main thread), teacher (process), assemble | build's teacher threads |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in results:
        n = max(1, m["samples"])
        cpu = m["main_cpu_seconds"]
        choice = m.get("cpu_threads") or {}
        print(f"| `{m['teachers']}` | {m['replay']} | {m['samples']} | {m['build_samples_per_s']:.2f} | "
              f"{m['teacher_samples_per_s']:.2f} ({m['teacher_best_threads']}) | {m['ratio']:.3f} | "
              + (f"{m['steady_ratio']:.3f} | " if m.get("steady_ratio") else "- | ")
              + f"{1000 * sum(m['prepare_cpu_seconds'].values()) / n:.1f}, {1000 * cpu.get('teacher', 0.0) / n:.1f}, "
              f"{1000 * cpu.get('teacher_process', 0.0) / n:.1f}, {1000 * cpu.get('assemble', 0.0) / n:.2f} | "
              f"{choice.get('teacher_threads', '-')} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--teachers", default="random:tiny",
                        help="a teacher set (comma list), or several sets separated by ';', each built and timed")
    parser.add_argument("--teacher-repeats", type=int, default=2, help="timings of the teacher alone (best of)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n-aug", type=int, default=10)
    parser.add_argument("--n-captions", type=int, default=5)
    parser.add_argument("--store-size", type=int, default=256)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--replay", default="auto",
                        help="auto, cpu or device (reinforce build --replay), or several separated by ','")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the main process")
    parser.add_argument("--files", action="store_true",
                        help="write the phantom studies as PNG files first (untimed) and build from "
                             "jsonl:, as with real data (decode instead of render)")
    parser.add_argument("--out", default=None, help="shard folder (default: a temp folder)")
    parser.add_argument("--profile-out", default=None,
                        help="sample the timed build's threads' stacks into this file (one teacher set)")
    args = parser.parse_args()

    import torch

    from cxrdr.common.allocator import keep_freed_memory

    keep_freed_memory()  # as the reinforce CLI does: the allocator the build runs with
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    sets = [t.strip() for t in args.teachers.split(";") if t.strip()]
    replays = [r.strip() for r in args.replay.split(",") if r.strip()]
    runs = [(teachers, replay) for teachers in sets for replay in replays]
    for i, (teachers, replay) in enumerate(runs):
        out = None if args.out is None else (args.out if len(runs) == 1 else str(Path(args.out) / f"set-{i}"))
        results.append(measure(n=args.n, teachers=teachers, workers=args.workers, batch_size=args.batch_size,
                               n_aug=args.n_aug, n_captions=args.n_captions, store_size=args.store_size,
                               device=args.device, files=args.files, out=out, teacher_repeats=args.teacher_repeats,
                               replay=replay, profile_out=args.profile_out if len(runs) == 1 else None))
        report(results[-1])
    if len(results) > 1:
        report_table(results)


if __name__ == "__main__":
    main()
