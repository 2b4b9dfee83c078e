"""Training step time: student variants and the cost of where the teacher signal comes from.

Measures, in one process and on the same shards, the mean wall time of one optimiser step
(data loading + forward + losses + backward + AdamW) for
  * variants A and E (reinforced: stored-embedding distillation),
  * variant D with stored embeddings (the reinforced dataset), with no teacher (plain CLIP on
    fresh augmentations) and with the teacher in the loop (online: the teacher embeds the same
    replayed crop and the report/caption every step), for each online teacher spec given
    (`random:tiny` always; others such as `biomedclip` when their weights load),
and prints them with ratios to "D stored". The interesting ratio is online / stored: what
storing the teacher's embeddings saves per step (MobileCLIP's argument).

    python benchmarks/train_step.py                      # the CPU ladder, phantom shards, CPU/GPU auto
    python benchmarks/train_step.py --size full --shards shards/ --device cuda --teachers random:tiny,biomedclip \
        --batch-size 256 --block 5 [--compile]
    python benchmarks/train_step.py --size full --only A,E --padded-texts   # texts packed vs padded
    python benchmarks/train_step.py --size full --only A,D,E --former-heads --count-flops   # heads: default vs former
    python benchmarks/train_step.py --size full --only A,E --parts --teachers ""   # what each part of E's step costs
    python benchmarks/train_step.py --shards demo/shards --only D --batch-size 32 --threads 2 --without-memo \
        --teachers "" --warmup 200 --steps 200 --block 10   # the demo's student with and without its stem's memo

The step is the loop's own (``Trainer.train_step``, non-log steps), timed as a black box with the
device synchronised only at block edges (``time_interleaved``); beside ms/step it prints the data
wait, GPU busy %, model FLOPs utilisation, peak memory and host syncs per step
(cxrdr.train.evaluation.efficiency defines them). What the online teacher costs is its row's
ms/step minus "D stored"'s.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


# The local-alignment heads configs/models/default.yaml had before it took the CPU ladder's (multi-head attention on
# the final tokens, words from the last text layer, no head convs); E keeps head_layer 0, where its mask picks tokens
FORMER_HEADS = {"local_attention": "mha", "head_layer": None, "head_conv_depth": 0, "local_text_layer": None}
FORMER_HEADS_E = {**FORMER_HEADS, "head_layer": 0}
# The parts of a step that a setting switches off (--parts), each alone: a variant's step less its step without the
# part is what the part costs, forward, backward and AdamW together (E / A misses 1.5 by its kernels, docs/gpu.md: which
# of E's parts they are). The token-region term draws the words that the mask-follows-words term reads, so without it
# both are left out. A has the captions alone.
PARTS_OFF = {
    "B_syn captions": {"loss.use_syn": False},  # the captions' text tower pass and their CLIP + distillation terms
    "Patch-IB global terms": {"loss.w_mask_nce": 0.0, "loss.mu_consistency": 0.0, "loss.lambda_sparse": 0.0},
    "mask follows words": {"loss.w_mask_words": 0.0},
    "token-region term": {"loss.w_local": 0.0},  # the all-pairs pooled cosines (models/gram_cosine.py) and its loss
    "head convs": {"model_overrides": {"head_conv_depth": 0}},  # the ConvNeXt blocks on the whole patch grid
}
PARTS_OF_A = ("B_syn captions",)


def build_phantom(out: Path, n: int, store_size: int, workers: int = 0) -> Path:
    """``n`` phantom studies with the random:tiny teacher; ``workers``: the build's preparation workers (0: in its
    process, enough for the tests' small builds; the GPU suite's 2,048 at 256 px want a GPU host's cores)."""
    import subprocess

    cmd = [sys.executable, "-m", "cxrdr.reinforce.cli", "build", "--source", f"phantom:{n}", "--teachers", "random:tiny",
           "--n-aug", "4", "--n-captions", "3", "--store-size", str(store_size), "--workers", str(workers),
           "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


class TimedBatches:
    """The trainer's batch iterator, adding up the seconds each ``next`` waits: the loop's data wait,
    measured outside ``Trainer.train_step`` (its returned numbers are not read: on CUDA some are
    device tensors, and reading one is a host sync the loop does not pay on a non-log step)."""

    def __init__(self, batches):
        self.batches, self.waits = batches, []  # seconds of each next()

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.waits.append(time.perf_counter() - t0)

    def close(self) -> None:
        """End the loader (its worker processes) now rather than at garbage collection."""
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()


def bench_config(shards: str, batch_size: int, workers: int, device: str, amp: str = "bf16") -> dict:
    """TrainConfig fields of a timed trainer: a long run (no schedule ends while timing), no
    evaluation, no progress bar, one lr warm-up step, eager blocks (a graphed configuration asks for
    ``cuda_graphs="on"``); ``out`` and the model come per trainer."""
    return dict(shards=str(shards), batch_size=batch_size, workers=workers, device=device, amp=amp,
                steps=10_000, progress=False, eval_every=0, cuda_graphs="off", **{"optim.warmup_steps": 1})


def make_trainer(base: dict, **overrides):
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer

    trainer = Trainer(TrainConfig.load(None, **{**base, **overrides}))
    # time the student as trained: token dropping (E) and Top-K at their target rates, not in warm-up
    # (and, with --compile, past the schedules, where the loop runs its compiled forward)
    trainer.step = trainer.student.config.warmup_steps_to_target
    return trainer, TimedBatches(trainer._batches())


def sync_fn(device):
    import torch

    if str(device).startswith("cuda"):
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_interleaved(steps: dict, device, timed_steps: int, warmup: int, block: int = 1) -> dict:
    """Wall time per call of each callable in ``steps``, interleaved round-robin in blocks.

    Each round runs ``block`` consecutive calls of one configuration, then the next's: within a
    block nothing waits for the device, so the host queues the next step while the GPU runs the
    last one, as the training loop does between log steps; the device is synchronised only at
    block edges. Interleaving makes every configuration see the same background load and clocks,
    so ratios stay meaningful when absolute times drift. ``warmup`` untimed calls of each (in
    whole blocks) come first (the first configuration of a process pays start-up costs: allocator, autotuning,
    compilation: ../shared/gpu/compile-h100.txt). The slowest tenth of the blocks is dropped
    (none with fewer than 10). Peak memory: the largest over the timed blocks
    (``efficiency.PeakMemory``: CUDA max allocated, whatever else the process holds included; CPU:
    process RSS). Returns per name: step_ms, median_ms, warmup_s, peak_memory_mb,
    step_memory_delta_mb, peak_memory_kind, steps, block_ms (each timed block's ms per step, in the order run:
    a mean that its median does not explain shows here as a few slow or fast blocks)."""
    from cxrdr.common.heap import frozen_heap
    from cxrdr.train.evaluation.efficiency import PeakMemory

    sync = sync_fn(device)
    blocks = {name: [] for name in steps}
    warm = {name: 0.0 for name in steps}
    peaks = {name: (0.0, 0.0) for name in steps}
    rounds, warm_rounds = max(1, -(-timed_steps // block)), -(-warmup // block)
    with frozen_heap():  # as Trainer.run steps (cxrdr.common.heap)
        for round_ in range(warm_rounds + rounds):
            for name, fn in steps.items():
                with PeakMemory(device) as peak:
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(block):
                        fn()
                    sync()
                    dt = time.perf_counter() - t0
                if round_ < warm_rounds:
                    warm[name] += dt
                else:
                    blocks[name].append(dt / block)
                    peaks[name] = max(peaks[name], (peak.peak_mb, peak.peak_mb - peak.start_mb))
    out = {}
    for name, times in blocks.items():
        t = sorted(times)
        kept = t[: len(t) - len(t) // 10]
        out[name] = {"step_ms": 1000 * sum(kept) / len(kept), "median_ms": 1000 * t[len(t) // 2],
                     "warmup_s": round(warm[name], 2), "peak_memory_mb": peaks[name][0],
                     "step_memory_delta_mb": peaks[name][1],
                     "peak_memory_kind": "cuda_max_allocated" if str(device).startswith("cuda") else "process_rss",
                     "steps": len(t) * block, "block_ms": [round(1000 * x, 2) for x in times]}
    return out


def step_figures(fn, device, items: int, step_ms: float, flops_per_call: float | None,
                 profile_calls: int = 3, sync_calls: int = 2) -> dict:
    """GPU busy %, MFU and host syncs per call of a warmed-up step ``fn`` (None off CUDA / unknown
    device), as cxrdr.train.evaluation.efficiency defines them; ``items``: samples per call;
    ``flops_per_call``: counted FLOPs of one call (efficiency.gflops(grad=True) x 1e9) or None."""
    from cxrdr.train.evaluation.efficiency import busy_pct, count_host_syncs, gpu_busy_ms, mfu_pct

    busy = gpu_busy_ms(fn, profile_calls, device)
    per_s = 1000.0 * items / step_ms
    return {"img_per_s": per_s, "gpu_busy_ms": busy, "gpu_busy_pct": busy_pct(busy, step_ms),
            "gflops_per_img": None if flops_per_call is None else flops_per_call / items / 1e9,
            "mfu_pct": mfu_pct(None if flops_per_call is None else flops_per_call / items, per_s, device),
            "host_syncs_per_step": count_host_syncs(fn, sync_calls, device)}


def eager_twin_key(cfg) -> str:
    """What a configuration's FLOP count depends on: every TrainConfig field but compilation, CUDA graphs and the run
    folder. A compiled or graphed configuration shares it with its eager twin; "A padded texts" or "D former heads"
    do not share A's or D's (model, mode and teacher alone made them share it, and their counts were their twins')."""
    skip = ("compile", "compile_scope", "compile_backend", "cuda_graphs", "cuda_graphs_text", "cuda_graphs_heads",
            "cuda_graphs_losses", "out", "overwrite", "resume")
    fields = {k: v for k, v in cfg.to_dict().items() if k not in skip}
    return json.dumps(fields, sort_keys=True, default=str)


def time_round_robin(trainers: dict, steps: int, warmup: int, block: int = 1, figures: bool = True,
                     count_flops: bool | None = None) -> list[dict]:
    """``Trainer.train_step`` (non-log steps) of each configuration: ``time_interleaved`` figures,
    then per configuration GPU busy %, MFU and host syncs per step (``step_figures``; extra steps
    after the timed ones). The step is a black box: its returned numbers are not read (no host
    sync of ours inside it); the data wait comes from ``TimedBatches``.

    FLOPs per image: one eager step counted by torch.utils.flop_counter (forward and backward; an
    online teacher's forward included: work the GPU does); a compiled configuration takes its
    eager twin's (``eager_twin_key``: every field but compilation) as the count cannot run through a
    compiled graph, and has none without a twin. ``count_flops`` None: count only where an MFU can be computed
    (a CUDA device in efficiency.PEAK_BF16_FLOPS): the count costs several steps' time on CPU."""
    from cxrdr.train.evaluation.efficiency import gflops, peak_bf16_flops

    def step_of(trainer, batches):
        return lambda: trainer.train_step(batches, log_balance=False)

    fns = {name: step_of(*tb) for name, tb in trainers.items()}
    timed = time_interleaved(fns, next(iter(trainers.values()))[0].device if trainers else "cpu",
                             steps, warmup, block)
    flops, out = {}, []
    for name, (trainer, batches) in trainers.items():
        count = count_flops if count_flops is not None else peak_bf16_flops(trainer.device) is not None
        cfg = trainer.cfg
        compiled = bool(getattr(cfg, "compile", False))
        graphed = getattr(trainer, "block_graphs", None) is not None  # a replayed graph's operators go uncounted
        key = eager_twin_key(cfg)
        row = {"name": name, "model": cfg.model, "mode": cfg.mode, "online_teacher": cfg.online_teacher,
               "compile": compiled, "compile_scope": cfg.compile_scope if compiled else None, "cuda_graphs": graphed,
               "batch_size": cfg.batch_size, "device": str(trainer.device), **timed[name]}
        if graphed:  # CUDA's max allocated leaves out the graphs' pool (allocated at capture): counted here
            row["graph_pool_mb"] = round(trainer.block_graphs.pool_mb, 1)
            row["peak_memory_mb"] += row["graph_pool_mb"]
        # the timed steps' waits only (the last ones so far): the first warm-up step starts the loader
        waits = batches.waits[-timed[name]["steps"] * cfg.accum_steps:]
        row["data_ms"] = 1000 * sum(waits) / max(1, timed[name]["steps"])
        memos = [memo.describe() for memo in getattr(trainer, "memos", [])]  # over warm-up and timed steps
        row["frozen_memo_hit_pct"] = (100.0 * sum(m["hits"] for m in memos) /
                                      max(1, sum(m["hits"] + m["misses"] for m in memos))) if memos else None
        if figures:
            if count and not compiled and not graphed and key not in flops:
                flops[key] = gflops(fns[name], grad=True) * 1e9
            row.update(step_figures(fns[name], trainer.device, cfg.batch_size * cfg.accum_steps,
                                    row["step_ms"], flops.get(key)))
        else:
            row["img_per_s"] = 1000.0 * cfg.batch_size * cfg.accum_steps / row["step_ms"]
        out.append(row)
    return out


def part_costs(results: list[dict]) -> list[dict]:
    """Per "V stored, without PART" row of ``results`` (``--parts``): PART's cost in V's step, ms and % of it; per
    "V stored, with KEY=VALUE" row (``--with``): what the setting saves of V's step ("part" the setting)."""
    steps = {r["name"]: r["step_ms"] for r in results}
    costs = []
    for name, ms in steps.items():
        for mark, label in ((" stored, without ", "{}"), (" stored, with ", "with {}")):
            variant, found, part = name.partition(mark)
            if found and f"{variant} stored" in steps:
                full = steps[f"{variant} stored"]
                costs.append({"variant": variant, "part": label.format(part), "ms": full - ms,
                              "share_pct": 100.0 * (full - ms) / full})
    return costs


def setting(text: str) -> tuple[str, object]:
    """``--with KEY=VALUE``: a TrainConfig field or dotted path and its YAML-read value."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--with takes KEY=VALUE (e.g. loss.local_group_size=64), got {text!r}")
    return key, yaml.safe_load(value)


def main(argv=None) -> int:
    from cxrdr.train.compiling import SCOPES as COMPILE_SCOPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", help="shard folder (default: a phantom build in a temp folder)")
    parser.add_argument("--size", choices=("cpu", "tiny", "full"), default="cpu",
                        help="cpu-A/E/D (the CPU ladder), tiny-A/E/D (test-sized) or A/E/D (GPU-sized) students")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration first")
    parser.add_argument("--block", type=int, default=1,
                        help="consecutive steps of one configuration between device syncs (GPU: e.g. 5)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the student (TrainConfig.compile)")
    parser.add_argument("--compile-scope", choices=COMPILE_SCOPES, default="model",
                        help="with --compile: the whole forward or each tower block (TrainConfig.compile_scope)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="the image tower's blocks as CUDA graphs (TrainConfig.cuda_graphs; CUDA only)")
    parser.add_argument("--cuda-graphs-text", action="store_true",
                        help="and the packed text tower's layers (TrainConfig.cuda_graphs_text; CUDA only)")
    parser.add_argument("--cuda-graphs-heads", action="store_true",
                        help="and the heads on the patch grid (TrainConfig.cuda_graphs_heads; CUDA only)")
    parser.add_argument("--cuda-graphs-losses", action="store_true",
                        help="and the CLIP and distillation terms (TrainConfig.cuda_graphs_losses; CUDA only)")
    parser.add_argument("--only", default=None,
                        help="time only these variants (e.g. 'D': D stored, plain and online; default A, E and D)")
    parser.add_argument("--padded-texts", action="store_true",
                        help="also time A, E and D with their texts padded (--no-pack-text): what packing buys")
    parser.add_argument("--former-heads", action="store_true",
                        help="also time D and E with default.yaml's former local-alignment heads (FORMER_HEADS)")
    parser.add_argument("--parts", action="store_true",
                        help="also time A, E and D each without one part (PARTS_OFF: the captions, Patch-IB's global "
                             "terms, the mask following the words, the token-region term, the head convs) and print "
                             "what each part costs")
    parser.add_argument("--with", dest="settings", type=setting, action="append", default=[], metavar="KEY=VALUE",
                        help="also time A, E and D with this setting (a TrainConfig field or dotted path, e.g. "
                             "loss.local_group_size=64; repeatable) and print what it saves of each step")
    parser.add_argument("--without-memo", action="store_true",
                        help="also time D stored with its frozen stem's memo off (--frozen-memo-mb 0; CPU "
                             "students with a frozen stem: cpu-*). The memo's hits grow with the epochs a run has "
                             "seen: --warmup sets how many come before the timed steps")
    parser.add_argument("--count-flops", action="store_true",
                        help="count FLOPs per image on CPU too (always where an MFU can be computed; slow on CPU)")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--amp", default="bf16")
    parser.add_argument("--teachers", default="random:tiny",
                        help="online teacher specs to time (comma list); ones that fail to load are skipped")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    parser.add_argument("--json-out", help="also write the results here")
    args = parser.parse_args(argv)

    import torch

    from cxrdr.common.allocator import keep_freed_memory

    keep_freed_memory()  # as the train CLI does
    if args.device in ("auto", "cpu") and not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="cxrdr-bench-")
    shards = Path(args.shards) if args.shards else build_phantom(Path(tmp.name) / "shards", 96, 128)
    prefix = {"cpu": "cpu-", "tiny": "tiny-", "full": ""}[args.size]
    base = {**bench_config(shards, args.batch_size, args.workers, args.device, args.amp),
            "out": str(Path(tmp.name) / "run")}
    if args.compile:
        base.update(compile=True, compile_scope=args.compile_scope)
    if args.cuda_graphs or args.cuda_graphs_text or args.cuda_graphs_heads or args.cuda_graphs_losses:
        base.update(cuda_graphs="on", cuda_graphs_text=args.cuda_graphs_text,
                    cuda_graphs_heads="on" if args.cuda_graphs_heads else "off",
                    cuda_graphs_losses="on" if args.cuda_graphs_losses else "off")

    plan = [("A stored", dict(model=f"{prefix}A")),
            ("E stored", dict(model=f"{prefix}E")),
            ("D stored", dict(model=f"{prefix}D")),
            ("D plain (no teacher)", dict(model=f"{prefix}D", mode="plain"))]
    for spec in [s.strip() for s in args.teachers.split(",") if s.strip()]:
        plan.append((f"D online {spec}", dict(model=f"{prefix}D", online_teacher=spec)))
    if args.padded_texts:
        plan += [(f"{v} stored, padded texts", dict(model=f"{prefix}{v}", pack_text=False)) for v in "AED"]
    if args.former_heads:
        plan += [(f"{v} stored, former heads", dict(model=f"{prefix}{v}", model_overrides=heads))
                 for v, heads in (("D", FORMER_HEADS), ("E", FORMER_HEADS_E))]
    if args.without_memo:
        plan.append(("D stored, no frozen memo", dict(model=f"{prefix}D", frozen_memo_mb=0)))
    if args.parts:
        plan += [(f"{v} stored, without {part}", dict(model=f"{prefix}{v}", **off)) for v in "AED"
                 for part, off in PARTS_OFF.items() if v != "A" or part in PARTS_OF_A]
    plan += [(f"{v} stored, with {key}={value}", {"model": f"{prefix}{v}", key: value}) for v in "AED"
             for key, value in args.settings]
    if args.only:
        plan = [(name, overrides) for name, overrides in plan if name.split()[0] in args.only.split(",")]
    trainers = {}
    for name, overrides in plan:
        try:
            trainers[name] = make_trainer({**base, "out": str(Path(tmp.name) / f"run{len(trainers)}")},
                                          **overrides)
        except Exception as exc:  # e.g. a teacher without local weights: say so and go on
            print(f"skipped {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    try:
        results = time_round_robin(trainers, args.steps, args.warmup, block=args.block,
                                   count_flops=True if args.count_flops else None)
    finally:
        for _, batches in trainers.values():
            batches.close()

    def fmt(v, spec):
        return format(v, spec) if v is not None else format("-", ">" + spec.split(".")[0])

    ref = next((r["step_ms"] for r in results if r["name"] == "D stored"), None)
    print(f"\ntrain step time ({results[0]['device'] if results else '?'}, batch {args.batch_size}, "
          f"{args.size} students, {args.steps} interleaved steps in blocks of {args.block} after {args.warmup} "
          f"warm-up; GPU busy, MFU and host syncs: None off CUDA)")
    print(f"{'configuration':<30} {'ms/step':>9} {'img/s':>8} {'data ms':>8} {'busy %':>7} {'MFU %':>6} "
          f"{'GFLOPs':>7} {'peak MB':>8} {'syncs':>6} {'x D stored':>10} {'memo hit %':>10}")
    for r in results:
        ratio = r["step_ms"] / ref if ref else None
        print(f"{r['name']:<30} {r['step_ms']:9.1f} {r['img_per_s']:8.1f} {r['data_ms']:8.1f} "
              f"{fmt(r.get('gpu_busy_pct'), '7.1f')} {fmt(r.get('mfu_pct'), '6.1f')} "
              f"{fmt(r.get('gflops_per_img'), '7.2f')} {r['peak_memory_mb']:8.0f} "
              f"{fmt(r.get('host_syncs_per_step'), '6.1f')} {fmt(ratio, '10.2f')} "
              f"{fmt(r.get('frozen_memo_hit_pct'), '10.1f')}")
    costs = part_costs(results)
    if costs:
        print("\nwhat each part costs (what a setting saves): its configuration's step less the step without it (with "
              "it); negative: within noise")
        for c in costs:
            print(f"{c['variant']:<3} {c['part']:<32} {c['ms']:8.1f} ms/step {c['share_pct']:6.1f} % of the step")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
