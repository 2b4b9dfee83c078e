"""GPU benchmark suite: every CUDA figure of the project in one call of at most ~8 minutes.

    python benchmarks/gpu_suite.py --device cuda          # writes benchmarks/results/<device>.json and .md
    python benchmarks/gpu_suite.py --tiny --device cpu    # the same sections, CPU-sized (the test suite runs it)

Everything is timed as the training loop runs it: bf16 autocast on CUDA, the loop's CUDA math
settings (TF32 for the fp32 work autocast leaves), fused AdamW, and for training figures the real
``Trainer.train_step`` (non-log steps, a black box: its returned numbers are not read, the device
is synchronised only at block edges). Every figure carries GPU busy %, model FLOPs utilisation
(MFU against the card's dense bf16 peak) and peak memory beside img/s; loop figures also carry host
syncs per step (``torch.cuda.set_sync_debug_mode``). cxrdr.train.evaluation.efficiency defines
them; off CUDA busy %, MFU and syncs are None and peak memory is the process's RSS.
Configurations are interleaved and warmed up before timing (the first configuration of a process
pays warm-up costs: ../shared/gpu/compile-h100.txt), and a peer, open_clip's own CLIP step, runs on
the same card in the same run.

Sections (each a function; each reuses the project's own measurement code):
1. build          ``reinforce build`` throughput with an open_clip ViT-B/16 teacher (random weights:
                  speed only) against that teacher's pure forward on the same crops, K=10, 256 px
                  (``benchmarks/reinforce_throughput.measure``).
2. students       A-E at ViT-S/16 (configs A..E) and A, E at ViT-B/16 (``image_tower=vit_base_patch16``),
                  MiniLM text, 224 px, synthetic batch of 256: train and inference img/s, GFLOPs, E at its
                  target keep rate (``efficiency_metrics(step=FAR_STEP)``).
3. loop           the real loop's step (``Trainer.train_step``, ``benchmarks/train_step.time_round_robin``)
                  of A-E at ViT-S/16 224 + MiniLM, batch 256, bf16, stored teacher (the shards of
                  section 1), interleaved in blocks of steps; and A with its texts padded
                  (``--no-pack-text``), for what running the text tower on the real tokens buys.
4. peer           open_clip's CLIP step: random-init ViT-S-16, ClipLoss, fused AdamW, bf16, batch 256,
                  eager and compiled.
5. loop_compiled  as 3 with ``TrainConfig.compile`` for A, D, E (COMPILED_ORDER, as the budget allows; ``--compiled
                  SCOPES`` keeps those scopes alone): by blocks with the blocks replayed as CUDA graphs (beside
                  the default graphs uncompiled), by blocks with every graph (beside every graph uncompiled),
                  then whole, then by blocks alone (beside their eager twins); skipped with a note where
                  TrainConfig has no ``compile`` option, and in --tiny (a CPU compile takes minutes).
6. train_step     D with stored embeddings vs the ViT-B/16 teacher online vs no teacher, batch 64
                  (``benchmarks/train_step.py --size full --teachers openclip:ViT-B-16 --only D``).
7. table          the seeds' efficiency table (``train experiment ablation`` layout) for A-E from
                  sections 2 and 3 (no run of its own).

The JSON's ``targets`` list holds each target as {name, required, value, met}. In --tiny the values
are the tiny CPU run's own (``targets_device``, ``targets_note``): they check the suite's code, not
the GPU targets.

The suite keeps a total time budget (``--budget``): a section that would not fit is skipped with
a note, and whatever was measured is written. A section that fails is recorded with its error
and the others still run.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import gc
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

from child_deadline import DeadlineExceeded, call_with_deadline  # noqa: E402 - a sibling benchmark module

VARIANTS = "ABCDE"
PADDED_A = "A padded texts"  # the loop section's A with --no-pack-text, beside A
# the loop section's D and E with the local-alignment heads default.yaml had before the CPU ladder's
# (train_step.FORMER_HEADS), beside D and E: what the change of heads costs or saves
FORMER_HEADS_D, FORMER_HEADS_E = "D former heads", "E former heads"
# The compiled loop configurations (variant, scope: COMPILE_SETTINGS), most wanted first (the budget may cut the
# tail). Whole models next: on the H100 at 0ef6026 whole-model compilation gained D 1.30x and A 1.21x over their
# eager twins while blocks gained 1.00-1.06x. A leads (~45 s of compilation there), so that E whole, the lever for its
# host-bound step, has A's compiled figure to divide by; E's compilation ran past the section's time at 48c40d0
# (COMPILE_LIMIT_S) and comes second, with what is left. Then block by block (cxrdr.train.compiling: a block's compile
# time, shared by the variants' towers), which a budget too short for another whole model may still fit.
# Blocks compiled one by one *and* replayed as CUDA graphs ("blocks+graphs": --compile-scope blocks --cuda-graphs on,
# what torch.compile's reduce-overhead mode does, for the blocks) lead since stop 55: the graphs took the blocks'
# launches off the host (graphed A 1.22x, D 1.30x eager on the H200 at 65e9f61), and compilation fuses the blocks'
# layer norms, casts and elementwise tails, which those graphs replay as they were (A's casts and copies 8.4 ms, layer
# norms 12.1 ms of its 63.4 ms of kernels a step); their twin is the graphed eager row, so the ratio is what fusion
# adds. A block compiles in ~13 s (D, H100 at 0ef6026) where a whole model took 44-65 s or did not finish. Since stop
# 61 "blocks+graphs" compiles the image blocks only, the packed text layers staying eager in the default text graphs
# (at 7067ab4 it compiled them too: A 1.30x, D 1.12x, E 1.09x the blocks graphed, below the text graphs' E), and
# its twin is the default graphs, blocks and text layers.
# "blocks+all-graphs" (since stop 73) compiles the image blocks under every graph (the blocks, the text layers, the heads
# on the patch grid and the global loss terms: --cuda-graphs-heads on --cuda-graphs-losses on), beside every graph
# uncompiled: of the configurations the loop has, the one that leaves the host least and fuses most, so the one the
# img/s bars are likeliest met by; none of its parts has been timed with the others yet.
COMPILED_ORDER = (("A", "blocks+graphs"), ("D", "blocks+graphs"), ("E", "blocks+graphs"),
                  ("A", "blocks+all-graphs"), ("D", "blocks+all-graphs"), ("E", "blocks+all-graphs"), ("A", "model"),
                  ("E", "model"), ("D", "model"), ("D", "blocks"), ("A", "blocks"), ("E", "blocks"))
# every CUDA graph the loop has: the blocks, the text layers, the heads on the patch grid, the global loss terms
ALL_GRAPHS = {"cuda_graphs": "on", "cuda_graphs_text": "on", "cuda_graphs_heads": "on", "cuda_graphs_losses": "on"}
# the TrainConfig fields of each compile scope of COMPILED_ORDER
COMPILE_SETTINGS = {"model": {"compile": True, "compile_scope": "model"},
                    "blocks": {"compile": True, "compile_scope": "blocks"},
                    "blocks+graphs": {"compile": True, "compile_scope": "blocks", "cuda_graphs": "on"},
                    "blocks+all-graphs": {"compile": True, "compile_scope": "blocks", **ALL_GRAPHS}}
# Seconds one compiled loop configuration is assumed to add (inductor's compilation of forward and backward + its
# timed steps, beside its eager twin), from the H100 at 0ef6026 (benchmarks/results/nvidia-h100-80gb-hbm3-0ef6026.json):
# the section took 190 s for D, A, E by blocks (warm-ups 12.9 s for D, ~3 s for A and E, whose blocks reuse D's
# compiled code) and D, A whole (warm-ups 64.9 s and 43.9 s); with the former 75 / 150 s, and the skipped train_step's
# 45 s held back (``reserve_after`` leaves skipped sections out now), it left E whole out with ~145 s of the budget
# unspent. Kept above the measured ~20 s and ~65 s: a cold cache or another card.
COMPILE_ESTIMATE_S = {"blocks+graphs": 45, "blocks+all-graphs": 50, "blocks": 40,  # +graphs: blocks' + captures
                      "model": 100}
# The most one compiled loop configuration may take, compilation included, before its child process is killed
# (``child_deadline``; on CUDA): on the H100 at 48c40d0 the whole-model E had not finished its warm-up after 149 s in
# the full suite nor after 263 s alone (the section's own phantom build, ~60-100 s, included), and the compilation in
# progress could not be stopped from the suite's process.
COMPILE_LIMIT_S = {"blocks+graphs": 100, "blocks+all-graphs": 110, "blocks": 90, "model": 180}
# The compiled section first compiles a two-layer MLP's step in a child (``inductor_smoke``), cut at this limit: on
# the H100 at 416dba0 neither the whole-model A (44 s of warm-up at 0ef6026) nor D by blocks (13 s) logged a first
# step within 240 and 90 s. A smoke check that cannot compile says the host's inductor is stuck, not the student;
# then it tries once more with one compile thread (TORCHINDUCTOR_COMPILE_THREADS=1: inductor's compile workers are
# known to hang beside forked processes, pytorch#121197; the loop's trainers fork 8 loader workers each) and the
# configurations get the setting that worked. A configuration killed at its limit passes the fallback on to the
# ones after it. The whole model's limit is 180 s (4x A's 44 s at 0ef6026), so that a stall leaves a lease's
# budget room for another configuration.
SMOKE_LIMIT_S = 60
SMOKE_FALLBACK_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
# the build section samples its build's threads this often (~1 % of a thread's time)
BUILD_SAMPLE_INTERVAL_S = 0.02
TARGET_CONFIG = "ViT-S/16 224 + MiniLM, batch 256, bf16, stored teacher"
# loop_graphs right after the eager loop (its twins are the loop's configurations): on the H200 at 65e9f61 its
# graphs matched eager exactly, and placed after the compiled loop it was skipped for want of one second
SECTIONS = ("build", "students", "loop", "loop_graphs", "peer", "loop_compiled", "train_step", "table")
GRAPHED = "{v} CUDA graphs"  # the loop_graphs section's rows: TrainConfig.cuda_graphs (models/block_graphs.py)
GRAPHED_TEXT = "{v} CUDA graphs + text"  # and with TrainConfig.cuda_graphs_text (the packed text tower's layers too)
GRAPHED_HEADS = "{v} CUDA graphs + text + heads"  # and TrainConfig.cuda_graphs_heads (the heads on the patch grid; B-E)
GRAPHED_ALL = "{v} all CUDA graphs"  # and TrainConfig.cuda_graphs_losses (the global loss terms) too
# parts of a section --skip may also leave out: the students' compiled inference took ~160 s of the H100's 200 s
# students section at 48c40d0, time a 15-minute lease may want for the compiled loop; the loop's comparisons (A with
# padded texts, D and E with the former heads: 3 of its 8 configurations, ~35 s) answered the same on three leases
SKIPPABLE_PARTS = ("inference_compiled", "loop_comparisons")


def settings(tiny: bool, device: str) -> dict:
    """Sizes of every section: the GPU run, or a CPU-sized run that exercises the same code.

    GPU sizes come from the H100 at 48c40d0 (benchmarks/results/nvidia-h100-80gb-hbm3-48c40d0.json): build 31 s;
    students 200 s, of which ~80 s each for A's and E's encoders compiled whole with CUDA graphs; loop 82 s (10 timed
    blocks of 5 steps, 8 configurations); compiled loop configurations COMPILE_ESTIMATE_S each, as the budget allows
    (20 timed steps beside their eager twin), each cut at COMPILE_LIMIT_S; peer ~10 s eager + one compile and train_step
    ~36 s (../shared/gpu, not rerun since)."""
    if tiny:
        return dict(device=device, teacher="random:tiny",
                    build=dict(n=16, workers=1, batch_size=8, n_aug=2, n_captions=2, store_size=64),
                    families={"tiny": ("tiny-{v}", {}, "ABCDE"), "tiny-32px": ("tiny-{v}", {"image_size": 32}, "AE")},
                    students=dict(batch_size=4, iters=2, warmup=1),
                    loop=dict(family="tiny", batch_size=4, steps=2, compiled_steps=2, warmup=1, block=1, workers=0,
                              graphed="AED"),
                    peer=dict(model="tiny", batch_size=4, steps=2, warmup=1, block=1, compile=False),
                    compile=False, step=dict(size="tiny", batch_size=4, steps=2, warmup=1, block=1, workers=0),
                    table_family="tiny",
                    reserve={"build": 5, "students": 10, "loop": 5, "loop_graphs": 3, "peer": 3, "loop_compiled": 5,
                             "train_step": 5, "table": 0})
    workers = max(1, min(12, (os.cpu_count() or 2) - 2))
    return dict(device=device, teacher="openclip:ViT-B-16",
                # four batches a worker: at 1,024 samples (1.3 batches a worker) the first wave of batches was most
                # of the build, so its "steady" rate measured the workers' ramp-up (docs/gpu.md, stop 52); the
                # teacher alone on all of them once (best of its thread settings)
                build=dict(n=4 * 64 * workers, workers=workers, batch_size=64, n_aug=10, n_captions=5,
                           store_size=256, teacher_repeats=1),
                families={"vit-s16": ("{v}", {}, "ABCDE"),
                          "vit-b16": ("{v}", {"image_tower": "vit_base_patch16"}, "AE")},
                students=dict(batch_size=256, iters=4, warmup=2),
                # 10 blocks in the loop section, so its slowest is dropped (train_step.time_interleaved): on the
                # H100 at 0ef6026, 4 blocks of E gave a mean step of 160 ms around a median of 137 ms
                loop=dict(family="vit-s16", batch_size=256, steps=50, compiled_steps=20, warmup=10, block=5,
                          workers=min(8, workers), graphed="AED"),
                peer=dict(model="ViT-S-16", batch_size=256, steps=20, warmup=10, block=5, compile=True),
                compile=True,
                step=dict(size="full", batch_size=64, steps=10, warmup=5, block=5, workers=min(8, workers)),
                table_family="vit-s16",
                reserve={"build": 90, "students": 80, "loop": 110, "loop_graphs": 80, "peer": 60,
                         "loop_compiled": COMPILE_ESTIMATE_S["blocks"], "train_step": 45, "table": 0})


def _free_device_memory() -> None:
    """Between sections on a GPU: what the last one left in reference cycles, and the allocator's cache, given back.
    On the CPU (the tiny suite) there is no device memory, and a full collection of this process's heap took ~0.4 s
    a call (8.7 s of the tiny suite's test)."""
    import torch

    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- sections


def section_build(cfg: dict, work: Path, budget) -> dict:
    """Build throughput vs the teacher's pure forward on the same crops (reinforce_throughput)."""
    import reinforce_throughput

    b = cfg["build"]
    # its threads sampled, so the figures come with where the build's process waited: the lease at 416dba0 lost
    # its separate profiling call (docs/gpu.md, "Fourth H100 session")
    m = reinforce_throughput.measure(teachers=cfg["teacher"], device=cfg["device"], out=str(work / "build"),
                                     profile_out=str(work / "build-threads.txt"),
                                     profile_interval=BUILD_SAMPLE_INTERVAL_S, **b)
    # beside the wall-time split, the CPU seconds of the workers' steps and of the build's threads: a worker's
    # wall time well above its CPU time says the cores were shared (the H100 run's 13.8 ms a sample of worker
    # wall time against ~6 ms of CPU on a 2-core box could not tell which)
    keep = ("source", "device", "teachers", "workers", "batch_size", "n_aug", "n_captions", "store_size",
            "samples", "build_seconds", "build_samples_per_s", "teacher_seconds", "teacher_samples_per_s",
            "ratio", "build_steady_samples_per_s", "steady_ratio", "start_up_seconds", "time_split_seconds",
            "prepare_cpu_seconds", "main_cpu_seconds", "cpu_threads", "cpus", "shards", "thread_samples")
    return {k: m.get(k) for k in keep}


def section_students(cfg: dict, work: Path, budget, reserve_after: float = 0.0) -> dict:
    """Each family's variants: efficiency_metrics at the target keep rate, as the loop runs (bf16 on CUDA); the
    loop family's A and E also compiled (``_compiled_inference``) where the budget, less what the sections after
    this one hold back (``reserve_after``), has COMPILED_INFERENCE_ESTIMATE_S left."""
    from cxrdr.train.evaluation.efficiency import FAR_STEP, efficiency_metrics
    from cxrdr.train.models.config import StudentConfig
    from cxrdr.train.models import build_student

    st = cfg["students"]
    rows, skipped = [], []
    for family, (pattern, overrides, variants) in cfg["families"].items():
        for v in variants:
            name = pattern.format(v=v)
            if budget.left() < 5:
                skipped.append(f"{family} {name}: time budget spent")
                continue
            config = StudentConfig.from_yaml(name, **overrides)
            model = build_student(config).to(cfg["device"])
            m = efficiency_metrics(model, batch_size=st["batch_size"], iters=st["iters"], warmup=st["warmup"],
                                   step=FAR_STEP, amp="bf16")
            row = {"family": family, "variant": v, "config": name, "image_tower": config.image_tower,
                   "image_size": config.image_size, "text_tower": config.text_tower,
                   "params_m": sum(p.numel() for p in model.parameters()) / 1e6, **m}
            if v in "AE" and family == cfg["loop"]["family"]:
                row.update(_bf16_weights_inference(model, st))
                compiled = cfg.get("compiled_inference", cfg["compile"])
                if compiled and budget.left() - reserve_after >= COMPILED_INFERENCE_ESTIMATE_S:
                    row.update(_compiled_inference(model, st))
                elif compiled:
                    skipped.append(f"{family} {name} compiled inference: {budget.left():.0f} s left, "
                                   f"{reserve_after:.0f} s held for the later sections")
            rows.append(row)
            del model
            _free_device_memory()
    ratios = {}
    for family in cfg["families"]:
        by = {r["variant"]: r for r in rows if r["family"] == family}
        if "A" in by and "E" in by:
            ratios[family] = {k: by["E"][k] / by["A"][k] for k in ("train_img_per_s", "inference_img_per_s",
                                                                  "gflops_per_img", COMPILED_INFERENCE,
                                                                  BF16_INFERENCE)
                              if by["E"].get(k) and by["A"].get(k)}
    return {"rows": rows, "E_over_A": ratios, "skipped": skipped,
            "note": f"synthetic batch of {st['batch_size']} at the model size, run as the loop runs (autocast "
                    "bf16 and the loop's CUDA math on CUDA, fused AdamW); E (and the Top-K mask) at their target "
                    "rates (FAR_STEP)"}


COMPILED_INFERENCE = "inference_img_per_s_compiled"
BF16_INFERENCE = "inference_img_per_s_bf16_weights"
# Seconds one encoder's compiled inference is assumed to take (inductor's forward-only compilation of a ViT-S/16
# encoder, CUDA-graph capture and its timed batches): on the H100 at 48c40d0 the students section took 199.5 s with
# A's and E's, 37.6 s at 0ef6026 without them (and with a ~20 s block compilation), so ~80-90 s each.
COMPILED_INFERENCE_ESTIMATE_S = 90


def _compiled_inference(model, st: dict, backend: str = "inductor") -> dict:
    """The image encoder's inference img/s compiled whole (one graph, ``fullgraph``) and on CUDA replayed as a
    CUDA graph (inductor's "reduce-overhead"), after the eager figures. An eager E at batch 256 waits on kernel
    launches (61 % busy on the H200), and compiling its blocks alone did not remove that (E / A 1.19 with the
    blocks compiled on the H100 at 0ef6026, 1.52 eager); a graph replay launches nothing from Python. It is what
    a deployment that compiles its encoder for one batch size gets; E's shapes are fixed (it keeps a fixed number
    of tokens at its target rate). The compilation runs in the warm-up calls. A failure is recorded in the row
    (``inference_compiled_error``), not raised: the eager figures beside it stand."""
    import torch

    from cxrdr.train.device import amp_dtype_for
    from cxrdr.train.evaluation.efficiency import image_encoder_metrics, model_device

    device = model_device(model)
    start = time.perf_counter()  # compilation, graph capture and timing together: inference_compiled_seconds
    graphs = backend == "inductor" and device.type == "cuda"
    mode = "whole encoder, CUDA graphs" if graphs else f"whole encoder, {backend}"
    model.eval()
    first_call_s: list[float] = []
    try:
        compiled = torch.compile(model.encode_image, backend=backend, fullgraph=True,
                                 **({"mode": "reduce-overhead"} if graphs else {}))

        def encode(images):
            started = time.perf_counter() if not first_call_s else None
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()  # a new replay: the last one's output is not read again
            out = compiled(images)
            if started is not None:  # the compilation
                first_call_s.append(time.perf_counter() - started)
            return out

        m = image_encoder_metrics(encode, int(model.image_size), st["batch_size"], st["iters"], st["warmup"] + 2,
                                  device, amp_dtype=amp_dtype_for("bf16", device), batch_only=True)
    except Exception as exc:  # noqa: BLE001 - one figure of the section; the rest of it was measured
        return {"inference_compiled_error": f"{mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    finally:
        model.train()
        torch._dynamo.reset()  # the next model's encoder compiles afresh, without this one's guards
    return {COMPILED_INFERENCE: m["inference_img_per_s"], "inference_compiled_mode": mode,
            "inference_gpu_busy_pct_compiled": m["inference_gpu_busy_pct"],
            "inference_compile_s": round(first_call_s[0], 1),
            "inference_compiled_seconds": round(time.perf_counter() - start, 1)}


def _bf16_weights_inference(model, st: dict) -> dict:
    """The image encoder's inference img/s with its weights in bf16 and no autocast: what an inference deployment
    in bf16 runs. Under autocast the residual stream, the layer norms and the adds stay fp32 and every linear layer
    casts its input: about half of E's encoder time on the H100 at 416dba0 (its profile), memory-bound work that
    token dropping does not shrink as it shrinks the products. Beside the figure, how far its embeddings are from
    autocast's (the smallest cosine over a batch), since they are not the same computation. A failure is recorded
    in the row (``inference_bf16_error``)."""
    import copy

    import torch
    import torch.nn.functional as F

    from cxrdr.train.device import amp_dtype_for, autocast
    from cxrdr.train.evaluation.efficiency import image_encoder_metrics, model_device

    device = model_device(model)
    model.eval()
    try:
        bf16 = copy.deepcopy(model).to(torch.bfloat16)

        def encode(images):
            return bf16.encode_image(images.to(torch.bfloat16))

        m = image_encoder_metrics(encode, int(model.image_size), st["batch_size"], st["iters"], st["warmup"],
                                  device, amp_dtype=None, batch_only=True)
        images = torch.rand(min(32, st["batch_size"]), 1, model.image_size, model.image_size, device=device)
        with torch.no_grad():
            with autocast(device, amp_dtype_for("bf16", device)):
                reference = model.encode_image(images).float()
            cosine = F.cosine_similarity(encode(images).float(), reference, dim=-1)
    except Exception as exc:  # noqa: BLE001 - one figure of the section; the rest of it was measured
        return {"inference_bf16_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    finally:
        model.train()
    return {BF16_INFERENCE: m["inference_img_per_s"], "inference_gpu_busy_pct_bf16": m["inference_gpu_busy_pct"],
            "inference_bf16_min_cosine_to_autocast": float(cosine.min())}


def _loop_description(cfg: dict) -> str:
    from cxrdr.train.models.config import StudentConfig

    lp = cfg["loop"]
    pattern, overrides, _ = cfg["families"][lp["family"]]
    c = StudentConfig.from_yaml(pattern.format(v="A"), **overrides)
    amp = "bf16" if cfg["device"].startswith("cuda") else "fp32 (CPU)"
    return (f"{pattern.format(v='A-E')}: {c.image_tower} {c.image_size} px + {c.text_tower}, batch "
            f"{lp['batch_size']}, {amp}, stored teacher")


def _loop_trainers(cfg: dict, work: Path, shards: str, plan: list[tuple]) -> dict:
    """A trainer per (name, model, compile scope (COMPILE_SETTINGS) or None for eager[, other TrainConfig fields]) of
    ``plan``."""
    import train_step

    lp = cfg["loop"]
    base = train_step.bench_config(shards, lp["batch_size"], lp["workers"], cfg["device"])
    trainers = {}
    for name, model, scope, *fields in plan:
        extra = dict(COMPILE_SETTINGS[scope]) if scope else {}
        extra.update(*fields)
        # a fresh run folder each: the compiled section builds trainers of the same models again
        out = tempfile.mkdtemp(prefix=f"loop-{model}-", dir=work)
        trainers[name] = train_step.make_trainer({**base, "out": out, "overwrite": True, **extra}, model=model)
    return trainers


def _run_loop(cfg: dict, trainers: dict, steps: int | None = None) -> list[dict]:
    import train_step

    lp = cfg["loop"]
    try:
        return train_step.time_round_robin(trainers, steps or lp["steps"], lp["warmup"], block=lp["block"])
    finally:
        for _, batches in trainers.values():
            batches.close()


def _math_state() -> dict:
    import torch

    return {"matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def _ratios(rows: list[dict]) -> dict:
    by = {r["name"]: r for r in rows}
    out = {}
    if "A" in by and "D" in by:
        out["D_over_A_step"] = by["D"]["step_ms"] / by["A"]["step_ms"]
    if "A" in by and "E" in by:
        out["E_over_A_img_per_s"] = by["E"]["img_per_s"] / by["A"]["img_per_s"]
    return out


def section_loop(cfg: dict, work: Path, budget, shards: str) -> dict:
    """The real loop's step of A-E, eager, interleaved (train_step.time_round_robin), A with its texts
    padded (``--no-pack-text``): what running the text tower on the real tokens buys, and D and E with their former
    local-alignment heads (train_step.FORMER_HEADS): what the change of heads costs or saves."""
    import train_step

    lp = cfg["loop"]
    pattern = cfg["families"][lp["family"]][0]
    comparisons = cfg.get("loop_comparisons", True)  # --skip loop_comparisons: A-E alone
    plan = [(v, pattern.format(v=v), None) for v in VARIANTS]
    if comparisons:
        plan.append((PADDED_A, pattern.format(v="A"), None, {"pack_text": False}))
        plan.append((FORMER_HEADS_D, pattern.format(v="D"), None, {"model_overrides": train_step.FORMER_HEADS}))
        plan.append((FORMER_HEADS_E, pattern.format(v="E"), None, {"model_overrides": train_step.FORMER_HEADS_E}))
    trainers = _loop_trainers(cfg, work, shards, plan)
    rows = _run_loop(cfg, trainers)
    math_state = _math_state()  # as the Trainer left the process (it sets its CUDA math at start-up)
    del trainers
    _free_device_memory()
    by = {r["name"]: r for r in rows}
    packing = {"A_packed_over_padded_img_per_s": by["A"]["img_per_s"] / by[PADDED_A]["img_per_s"],
               "D_over_former_heads_D_step": by["D"]["step_ms"] / by[FORMER_HEADS_D]["step_ms"],
               "E_over_former_heads_E_step": by["E"]["step_ms"] / by[FORMER_HEADS_E]["step_ms"]} if comparisons else {}
    return {"rows": rows, **_ratios(rows), **packing, "description": _loop_description(cfg), "shards": shards,
            "batch_size": lp["batch_size"], "block": lp["block"], "steps": lp["steps"], "warmup": lp["warmup"],
            "cuda_math": math_state if cfg["device"].startswith("cuda") else None,
            "note": f"Trainer.train_step (non-log steps), {lp['steps']} timed steps per configuration in blocks of "
                    f"{lp['block']} after {lp['warmup']} warm-up steps, interleaved; E and the Top-K mask at their "
                    "target rates" + ("" if comparisons else "; the comparisons left out (--skip loop_comparisons)")}


def section_loop_graphs(cfg: dict, work: Path, shards: str) -> dict:
    """The real loop's A, E and D with ``--cuda-graphs on`` (the image tower's blocks replayed as CUDA graphs, forward
    and backward), with ``--cuda-graphs-text`` too (the packed text tower's layers), for E and D with
    ``--cuda-graphs-heads`` too (the heads on the patch grid), and with every graph (``--cuda-graphs-losses`` too: the
    global loss terms), each interleaved with its eager twin: what taking the blocks' operators off the
    host buys where the eager step is bound by it (E at 60 % busy on the H100 at 416dba0). A section of its own,
    after the loop's, so that a capture that fails on the card cannot take the eager figures with it. On CPU the
    graphed rows run eagerly (the Trainer warns): the tiny run checks the section's code, not graphs."""
    import block_graphs_check

    lp = cfg["loop"]
    pattern = cfg["families"][lp["family"]][0]
    cuda = cfg["device"].startswith("cuda")
    agreement = {}  # first, whether the graphs compute what the eager blocks do: a speed figure cannot say
    stand_in = None if cuda else (lambda module, *inputs: module)
    checks = [(v, block_graphs_check.compare, v, 32) for v in "DE"] + [("E text", block_graphs_check.compare_text,
                                                                        "E", 64)]
    checks += [(f"{v} heads", block_graphs_check.compare_heads, v, 32) for v in "DE"]
    checks.append(("D losses", block_graphs_check.compare_losses, "D", 256))
    for name, check, v, batch in checks:
        try:
            agreement[name] = check(pattern.format(v=v), cfg["device"], batch if cuda else 2, 3, capture=stand_in)
        except Exception as exc:  # noqa: BLE001 - recorded; the timing still runs
            agreement[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    plan = []
    for v in lp["graphed"]:
        plan += [(v, pattern.format(v=v), None),
                 (GRAPHED.format(v=v), pattern.format(v=v), None, {"cuda_graphs": "on", "cuda_graphs_text": "off"}),
                 (GRAPHED_TEXT.format(v=v), pattern.format(v=v), None,
                  {"cuda_graphs": "on", "cuda_graphs_text": "on"})]
        if v != "A":  # the heads on the patch grid (A has none)
            plan.append((GRAPHED_HEADS.format(v=v), pattern.format(v=v), None,
                         {"cuda_graphs": "on", "cuda_graphs_text": "on", "cuda_graphs_heads": "on"}))
        plan.append((GRAPHED_ALL.format(v=v), pattern.format(v=v), None, ALL_GRAPHS))
    trainers = _loop_trainers(cfg, work, shards, plan)
    rows = _run_loop(cfg, trainers, lp["compiled_steps"])
    graphed_names = {n.format(v=v) for v in lp["graphed"] for n in (GRAPHED, GRAPHED_TEXT, GRAPHED_HEADS, GRAPHED_ALL)}
    for row in (r for r in rows if r["name"] in graphed_names):  # what the graphed trainers captured, or why not
        row.update(graphs_captured_fields(trainers[row["name"]][0].block_graphs))
    del trainers
    _free_device_memory()
    by = {r["name"]: r for r in rows}
    graphed = [{**by[GRAPHED.format(v=v)], "name": v} for v in lp["graphed"]]
    graphed_text = [{**by[GRAPHED_TEXT.format(v=v)], "name": v} for v in lp["graphed"]]
    with_heads = [v for v in lp["graphed"] if v != "A"]
    graphed_heads = [{**by[(GRAPHED_HEADS if v in with_heads else GRAPHED_TEXT).format(v=v)], "name": v}
                     for v in lp["graphed"]]  # A beside them as it is: it has no heads to replay
    return {"rows": rows, "graphed_over_eager_img_per_s": {
                v: by[GRAPHED.format(v=v)]["img_per_s"] / by[v]["img_per_s"] for v in lp["graphed"]},
            "text_graphed_over_graphed_img_per_s": {
                v: by[GRAPHED_TEXT.format(v=v)]["img_per_s"] / by[GRAPHED.format(v=v)]["img_per_s"]
                for v in lp["graphed"]},
            "heads_graphed_over_text_graphed_img_per_s": {
                v: by[GRAPHED_HEADS.format(v=v)]["img_per_s"] / by[GRAPHED_TEXT.format(v=v)]["img_per_s"]
                for v in with_heads},
            "all_graphed_over_heads_graphed_img_per_s": {  # A beside its text graphs: it has no heads
                v: by[GRAPHED_ALL.format(v=v)]["img_per_s"]
                / by[(GRAPHED_HEADS if v in with_heads else GRAPHED_TEXT).format(v=v)]["img_per_s"]
                for v in lp["graphed"]},
            "graphed_ratios": _ratios(graphed), "text_graphed_ratios": _ratios(graphed_text),
            "heads_graphed_ratios": _ratios(graphed_heads),
            "all_graphed_ratios": _ratios([{**by[GRAPHED_ALL.format(v=v)], "name": v} for v in lp["graphed"]]),
            "description": _loop_description(cfg),
            "agreement": agreement, "agreement_note": "benchmarks/block_graphs_check.py: the image tower alone, "
            "stochastic depth off, 3 steps of random images (E text: the text tower alone, dropout off, 3 steps of "
            "random texts; D heads, E heads: the heads on the patch grid alone, 3 steps of random patches; D losses: "
            "the global loss terms alone, 3 steps of random embeddings and masks), graphed vs eager; the largest "
            "differences relative to the largest value"
            + ("" if cuda else "; on CPU the blocks stand in for the capture (plumbing only), and the text tower, "
               "without FlashAttention, captures nothing"),
            "note": f"Trainer.train_step (non-log steps), {lp['compiled_steps']} timed steps per configuration in "
                    f"blocks of {lp['block']} after {lp['warmup']} warm-up steps (the capture among them), each "
                    "graphed configuration beside its eager twin, interleaved; E at its target keep rate"}


def graphs_captured_fields(graphs) -> dict:
    """A graphed row's record of what its trainer's ``BlockGraphs`` captured (all of them, then the text tower's, the
    heads' and the loss terms' among them), or why none (None: not a CUDA device)."""
    if graphs is None:
        return {"graphs_captured": None, "text_graphs_captured": None, "heads_graphs_captured": None,
                "losses_graphs_captured": None, "graphs_failed": "no graphs: not a CUDA device"}
    return {"graphs_captured": len(graphs), "text_graphs_captured": graphs.captured("text"),
            "heads_graphs_captured": graphs.captured("heads"), "losses_graphs_captured": graphs.captured("losses"),
            "graphs_failed": graphs.failed}


def captured_text(row: dict) -> str:
    """A graphed row's captures in words, for the Markdown."""
    return (f"**{row['name']}**: {row['graphs_captured']} graph(s) captured"
            + (f" ({row['text_graphs_captured']} of the text tower)" if row.get("text_graphs_captured") else "")
            + (f" ({row['heads_graphs_captured']} of the heads)" if row.get("heads_graphs_captured") else "")
            + (f" ({row['losses_graphs_captured']} of the loss terms)" if row.get("losses_graphs_captured") else "")
            + (f", their memory pool {row['graph_pool_mb']:.0f} MB (in its peak MB)" if row.get("graph_pool_mb")
               else "")
            + (f"; capture failed or off: {row['graphs_failed']}" if row.get("graphs_failed") else ""))


def _compiled_name(variant: str, scope: str) -> str:
    return f"{variant} compiled {scope}"


def _graphed(scope: str) -> bool:
    """Whether a compile scope of COMPILE_SETTINGS also replays the blocks as CUDA graphs."""
    return COMPILE_SETTINGS[scope].get("cuda_graphs") == "on"


def _compiled_twin(variant: str, scope: str) -> tuple[str, dict]:
    """The row a compiled configuration is timed beside, and its TrainConfig fields: eager, or for a graphed scope the
    same graphs uncompiled (what compiling the image blocks adds to them): for blocks+graphs the default graphs (the
    blocks and the packed text layers), for blocks+all-graphs every graph."""
    if scope == "blocks+all-graphs":
        return GRAPHED_ALL.format(v=variant), dict(ALL_GRAPHS)
    if _graphed(scope):
        return GRAPHED_TEXT.format(v=variant), {"cuda_graphs": "on", "cuda_graphs_text": "on"}
    return f"{variant} eager", {"cuda_graphs": "off"}


def inductor_smoke(device: str) -> float:
    """Seconds to compile (inductor) and run one training step of a two-layer MLP on ``device``, under the loop's
    autocast: whether torch.compile works on this host at all, apart from the student."""
    import torch

    from cxrdr.train.device import amp_dtype_for, autocast

    start = time.perf_counter()
    dev = torch.device(device)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 8)).to(dev)
    step = torch.compile(model)
    with autocast(dev, amp_dtype_for("bf16", dev)):
        loss = step(torch.randn(32, 64, device=dev)).float().square().mean()
    loss.backward()
    float(loss)  # waits for the device
    return time.perf_counter() - start


def _processes_text(processes: list[dict]) -> str:
    """A killed configuration's processes at its deadline in a few words: how many, how many were working (at least
    half a core over the last second: a compilation still running) and the busiest ones' commands."""
    busy = sorted((p for p in processes if (p.get("busy") or 0) >= 0.5), key=lambda p: -p["busy"])
    states = ", ".join(f"{n} {st}" for st, n in sorted(collections.Counter(p["state"] for p in processes).items()))
    text = f"{len(processes)} processes at the deadline ({states}), {len(busy)} busy"
    return text + (": " + "; ".join(f"{p['cmd'][:60]} {p['busy']:.2f} core" for p in busy[:3]) if busy else "")


def _smoke_check(device: str) -> dict:
    """``inductor_smoke`` in a child, with inductor's defaults and, if that fails, with SMOKE_FALLBACK_ENV: the
    attempts, and the env the configurations should get (None: neither compiled)."""
    attempts = []
    for env in ({}, SMOKE_FALLBACK_ENV):
        try:
            seconds = call_with_deadline(inductor_smoke, SMOKE_LIMIT_S, device, env=env)
        except (DeadlineExceeded, RuntimeError) as exc:
            attempts.append({"env": env, "error": str(exc).splitlines()[0][:300]})
            continue
        attempts.append({"env": env, "seconds": round(seconds, 2)})
        return {"attempts": attempts, "env": env}
    return {"attempts": attempts, "env": None}


def compiled_configuration_rows(cfg: dict, work: str, shards: str, variant: str, scope: str) -> list[dict]:
    """One compiled loop configuration timed interleaved with its twin (``_compiled_twin``: eager, or the blocks graphed
    uncompiled for blocks+graphs; ``_run_loop``); the suite runs it in a
    child process on CUDA. The child logs when its trainers are built, then each warm-up step of the compiled trainer
    with its time and dynamo's graph count, so a configuration killed at its limit still says where its time went
    (with TORCH_LOGS' recompile reasons, and ``child_deadline``'s stacks before the kill)."""
    started = time.perf_counter()
    pattern = cfg["families"][cfg["loop"]["family"]][0]
    name = _compiled_name(variant, scope)
    twin, twin_fields = _compiled_twin(variant, scope)
    trainers = _loop_trainers(cfg, Path(work), shards, [(twin, pattern.format(v=variant), None, twin_fields),
                                                        (name, pattern.format(v=variant), scope)])
    print(f"[loop_compiled] {name}: its trainers and its twin's ({twin}) built in {time.perf_counter() - started:.1f} "
          f"s; warm-up starts ({_inductor_workers()})", file=sys.stderr, flush=True)
    trainer = trainers[name][0]
    _log_first_steps(trainer, name, cfg["loop"]["warmup"])
    graphs = {n: t.block_graphs for n, (t, _) in trainers.items()} if _graphed(scope) else {}
    rows = _run_loop(cfg, trainers, cfg["loop"]["compiled_steps"])  # beside its twin: fewer blocks do
    for row in (r for r in rows if r["name"] in graphs):  # what both graphed trainers captured, or why not
        row.update(graphs_captured_fields(graphs[row["name"]]))
    return rows


def _inductor_workers() -> str:
    """How inductor will compile here: its compile threads (worker processes when > 1), what a killed
    configuration's process list is read against."""
    try:
        import torch._inductor.config as inductor_config

        start = getattr(inductor_config, "worker_start_method", "?")
        return f"inductor compile threads {inductor_config.compile_threads}, worker start {start}"
    except Exception as exc:  # noqa: BLE001 - a log line's detail
        return f"inductor config unreadable: {type(exc).__name__}"


def _log_first_steps(trainer, name: str, steps: int) -> None:
    """Print the time of ``trainer``'s first ``steps`` steps and dynamo's compiled-graph count after each."""
    from torch._dynamo.utils import counters

    step, start, calls = trainer.train_step, time.perf_counter(), [0]

    def logged(*args, **kwargs):
        out = step(*args, **kwargs)
        calls[0] += 1
        if calls[0] <= steps:
            print(f"[loop_compiled] {name}: step {calls[0]} returned {time.perf_counter() - start:.1f} s after the "
                  f"start; graphs compiled {counters['stats'].get('unique_graphs', 0)}", file=sys.stderr, flush=True)
        return out

    trainer.train_step = logged


def compiled_order(scopes) -> list[tuple[str, str]]:
    """COMPILED_ORDER's configurations whose scope is one of ``scopes`` (all of them where it is empty), in its
    order; an unknown scope is refused, naming the known ones."""
    unknown = sorted(set(scopes) - set(COMPILE_SETTINGS))
    if unknown:
        raise ValueError(f"--compiled {','.join(unknown)}: no such compile scope (scopes: "
                         f"{', '.join(COMPILE_SETTINGS)})")
    return [(v, scope) for v, scope in COMPILED_ORDER if not scopes or scope in scopes]


def section_loop_compiled(cfg: dict, work: Path, budget, shards: str, reserve_after: float,
                          publish=lambda partial: None) -> dict:
    """A, D, E with TrainConfig.compile in COMPILED_ORDER's scopes (those of ``cfg["compiled_scopes"]`` alone, where
    it names some), each configuration timed interleaved with its twin (``_compiled_twin``), one at a time while the
    budget allows; ``publish(partial)`` gets the section after each, so a run cut short (a compilation slower than
    its COMPILE_ESTIMATE_S) keeps what it finished."""
    rows, done, failed = [], [], []
    order = compiled_order(cfg.get("compiled_scopes") or ())

    def summary(note_left: str) -> dict:
        by = {r["name"]: r for r in rows}
        tried = {f["name"] for f in failed}
        left_out = [_compiled_name(v, scope) for v, scope in order
                    if (v, scope) not in done and _compiled_name(v, scope) not in tried]
        ratios = {}
        for scope in COMPILE_ESTIMATE_S:
            compiled = {v: by[_compiled_name(v, sc)] for v, sc in done if sc == scope}
            twins = {v: _compiled_twin(v, scope)[0] for v in compiled}
            ratios[scope] = {**_ratios([{**r, "name": v} for v, r in compiled.items()]),
                             "compiled_over_twin_img_per_s": {
                                 v: r["img_per_s"] / by[twins[v]]["img_per_s"] for v, r in compiled.items()},
                             "twins": twins}
        return {"rows": list(rows), "failed": list(failed), "smoke": smoke,
                "by_scope": {k: v for k, v in ratios.items() if v["compiled_over_twin_img_per_s"]},
                "description": _loop_description(cfg),
                "note": "each compiled configuration timed interleaved with its twin (eager; for blocks+graphs the "
                        "default graphs, blocks and text layers, uncompiled; for blocks+all-graphs every graph "
                        "uncompiled), one at a time; "
                        "warmup_s holds the compilation"
                        + (f"; {note_left}: {', '.join(left_out)}" if left_out else "")}

    cuda = cfg["device"].startswith("cuda")
    smoke = _smoke_check(cfg["device"]) if cuda else None
    if smoke is not None and smoke["env"] is None:
        return {"rows": [], "failed": [], "smoke": smoke,
                "note": f"not measured: torch.compile of a two-layer MLP did not finish within {SMOKE_LIMIT_S} s in a "
                        "child process, with inductor's defaults nor with one compile thread (smoke)"}
    env = dict(smoke["env"]) if cuda else {}
    for v, scope in order:
        if budget.left() - reserve_after < COMPILE_ESTIMATE_S[scope]:
            continue  # a cheaper configuration further down may still fit
        if cuda:  # in a child process, killed at its limit (child_deadline)
            limit = min(budget.left() - reserve_after, COMPILE_LIMIT_S[scope])
            try:
                rows += call_with_deadline(compiled_configuration_rows, limit, cfg, str(work), shards, v, scope,
                                           env={"TORCH_LOGS": "recompiles,graph_breaks", **env})
            except (DeadlineExceeded, RuntimeError) as exc:
                failed.append({"name": _compiled_name(v, scope), "error": str(exc).splitlines()[0][:300],
                               "env": dict(env), **({"processes": [{k: p[k] for k in ("pid", "ppid", "state", "busy",
                                                                                      "cpu_s", "cmd")}
                                                                   for p in exc.processes]}
                                                    if getattr(exc, "processes", None) else {})})
                # a small step compiling is no proof for the student's: the next configurations get the fallback
                env.update(SMOKE_FALLBACK_ENV)
                publish(summary("still to measure"))
                continue
        else:
            rows += compiled_configuration_rows(cfg, str(work), shards, v, scope)
            _free_device_memory()  # (a child's memory went with it)
        done.append((v, scope))
        publish(summary("still to measure"))
    if not done and not failed:
        return {"rows": [], "note": f"not measured: {budget.left():.0f} s left, one compiled configuration needs "
                                    f"~{min(COMPILE_ESTIMATE_S.values())} s"}
    return summary("left out for the budget")


def _openclip_peer(spec: str, device: str):
    """(model, image size, vocabulary size, context length) of the peer: open_clip's model config
    ``spec`` with random weights, or a tiny CLIP of the same code for the CPU run."""
    import open_clip

    if spec == "tiny":
        model = open_clip.CLIP(embed_dim=32, vision_cfg=dict(image_size=32, patch_size=8, width=64, layers=2,
                                                             head_width=32, mlp_ratio=2.0),
                               text_cfg=dict(context_length=16, vocab_size=1000, width=64, heads=2, layers=2))
    else:
        model = open_clip.create_model(spec)  # no pretrained tag: random init (speed only)
    size = model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else int(size)
    return model.to(device), size, int(getattr(model, "vocab_size", 49408)), int(getattr(model, "context_length", 77))


def section_peer(cfg: dict, work: Path, budget, reserve_after: float) -> dict:
    """open_clip's own CLIP training step on the same card: ClipLoss, fused AdamW, bf16 autocast, eager and
    torch.compile'd (the model's forward, as open_clip's --torchcompile does), interleaved."""
    import torch
    import open_clip

    import train_step
    from cxrdr.train.device import amp_dtype_for, autocast
    from cxrdr.train.evaluation.efficiency import gflops, loop_math, peak_bf16_flops

    pc, device = cfg["peer"], torch.device(cfg["device"])
    cuda = device.type == "cuda"
    amp = amp_dtype_for("bf16", device)
    modes = ["eager"]
    notes = []
    if not pc["compile"]:
        notes.append("compiled step not measured in the tiny CPU run (a CPU compile takes minutes)")
    elif budget.left() - reserve_after < 2 * cfg["reserve"]["peer"]:
        notes.append(f"compiled step not measured: {budget.left():.0f} s of the budget left")
    else:
        modes.append("compiled")
    steps, flops, models = {}, None, []
    gen = torch.Generator().manual_seed(0)
    for mode in modes:
        model, size, vocab, ctx = _openclip_peer(pc["model"], cfg["device"])
        model.train()
        models.append(model)
        images = torch.randn(pc["batch_size"], 3, size, size, generator=gen).to(device)
        texts = torch.randint(0, vocab, (pc["batch_size"], ctx), generator=gen).to(device)
        loss_fn = open_clip.ClipLoss()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
        forward = torch.compile(model) if mode == "compiled" else model

        def fwd_bwd(forward=forward, loss_fn=loss_fn, images=images, texts=texts):
            with autocast(device, amp):
                img, txt, scale = forward(images, texts)[:3]
                loss = loss_fn(img, txt, scale)
            loss.backward()

        def step(fwd_bwd=fwd_bwd, opt=opt):
            opt.zero_grad(set_to_none=True)
            fwd_bwd()
            opt.step()

        steps[mode] = step
        if mode == "eager" and peak_bf16_flops(device) is not None:  # for MFU; slow on CPU
            with loop_math(device):
                flops = gflops(fwd_bwd, grad=True) * 1e9
    rows = []
    with loop_math(device):
        timed = train_step.time_interleaved(steps, device, pc["steps"], pc["warmup"], pc["block"])
        for mode, fn in steps.items():
            row = {"name": f"open_clip {pc['model']} {mode}", "model": pc["model"], "compile": mode == "compiled",
                   "batch_size": pc["batch_size"], **timed[mode]}
            row.update(train_step.step_figures(fn, device, pc["batch_size"], row["step_ms"], flops))
            rows.append(row)
    del models, steps
    _free_device_memory()
    return {"rows": rows, "notes": notes,
            "description": f"open_clip {open_clip.__version__} CLIP {pc['model']} (random init), ClipLoss, fused "
                           f"AdamW, {'bf16' if amp is not None else 'fp32 (CPU)'}, batch {pc['batch_size']}, "
                           "synthetic images and token ids; FLOPs counted on the eager step (where an MFU can "
                           "be computed)"}


def section_train_step(cfg: dict, work: Path, budget, shards: str | None) -> dict:
    """benchmarks/train_step.py's plan for D: stored embeddings, no teacher (plain), the teacher online."""
    import train_step

    s = cfg["step"]
    out = work / "train_step.json"
    argv = ["--size", s["size"], "--teachers", cfg["teacher"], "--batch-size", str(s["batch_size"]),
            "--steps", str(s["steps"]), "--warmup", str(s["warmup"]), "--block", str(s["block"]),
            "--workers", str(s["workers"]), "--device", cfg["device"], "--json-out", str(out),
            "--only", "D"]  # A and E stored: the loop section's (same loop, same shards)
    if shards:
        argv += ["--shards", shards]
    train_step.main(argv)
    _free_device_memory()
    rows = json.loads(out.read_text())
    by = {r["name"]: r["step_ms"] for r in rows}
    online = next((r["step_ms"] for r in rows if r["name"].startswith("D online")), None)
    stored, plain = by.get("D stored"), by.get("D plain (no teacher)")
    return {"rows": rows, "shards": shards or "train_step's own phantom build",
            "online_over_stored": online / stored if online and stored else None,
            "plain_over_stored": plain / stored if plain and stored else None}


def section_table(cfg: dict, loop: dict | None, students: dict | None) -> dict:
    """The ablation's cost table for A-E: the loop's step (section 3) beside the synthetic figures (section 2)."""
    family = cfg["table_family"]
    pattern = cfg["families"][family][0]
    synthetic = {r["variant"]: r for r in (students or {}).get("rows", []) if r["family"] == family}
    looped = {r["name"]: r for r in (loop or {}).get("rows", [])}
    rows = []
    for v in VARIANTS:
        e, lr = synthetic.get(v, {}), looped.get(v, {})
        # The keys and their meaning are those of train.evaluation.runner's summary (ablation rows).
        rows.append({"run": v, "config": pattern.format(v=v), "inference_img_per_s": e.get("inference_img_per_s"),
                     "train_step_ms": e.get("train_step_ms"), "synthetic_train_img_per_s": e.get("train_img_per_s"),
                     "latency_ms": e.get("latency_ms_per_img"), "peak_memory_mb": e.get("peak_memory_mb"),
                     "step_memory_delta_mb": e.get("step_memory_delta_mb"), "gflops_per_img": e.get("gflops_per_img"),
                     "patch_usage_pct": e.get("patch_usage_pct"), "step_ms": lr.get("step_ms"),
                     "train_img_per_s": lr.get("img_per_s"), "gpu_busy_pct": lr.get("gpu_busy_pct"),
                     "mfu_pct": lr.get("mfu_pct"), "loop_peak_memory_mb": lr.get("peak_memory_mb")})
    return {"family": family, "rows": rows, "batch_size": cfg["loop"]["batch_size"],
            "synthetic_batch_size": cfg["students"]["batch_size"]}


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


def _target(name: str, op: str, threshold: float, value) -> dict:
    met = None if value is None else bool(value >= threshold if op == ">=" else value <= threshold)
    return {"name": name, "required": f"{op} {threshold:g}", "op": op, "threshold": threshold, "value": value,
            "met": met}


def _loop_targets(loop: dict | None, label: str, desc: str, variant_names: set[str]) -> list[dict]:
    """The real-loop targets on one section's rows: those named in ``variant_names`` ("A".."E" eager, "A compiled
    <scope>", "A CUDA graphs"...); rows beside them ("A padded texts", "D former heads", a compiled or graphed row's
    eager twin) are no target's."""
    rows = (loop or {}).get("rows", [])
    by = {r["name"].split()[0]: r for r in rows if r["name"] in variant_names}
    get = lambda v, k: (by.get(v) or {}).get(k)  # noqa: E731
    ratio = lambda a, b: a / b if a is not None and b else None  # noqa: E731
    syncs = [get(v, "host_syncs_per_step") for v in "ADE" if v in by]
    max_syncs = max(syncs) if syncs and None not in syncs else None
    return [
        _target(f"D training, real loop, img/s [{label}] ({desc})", ">=", 3500, get("D", "img_per_s")),
        _target(f"D training, real loop, GPU busy % [{label}]", ">=", 85, get("D", "gpu_busy_pct")),
        _target(f"A training, real loop, img/s [{label}]", ">=", 4500, get("A", "img_per_s")),
        _target(f"D step / A step, real loop [{label}]", "<=", 1.25, ratio(get("D", "step_ms"), get("A", "step_ms"))),
        _target(f"E / A train img/s, real loop, E at its target keep rate [{label}]", ">=", 1.5,
                ratio(get("E", "img_per_s"), get("A", "img_per_s"))),
        _target(f"host syncs per non-log step, max of A, D, E [{label}]", "<=", 2, max_syncs),
    ]


def evaluate_targets(sections: dict, cfg: dict, tiny: bool) -> list[dict]:
    """The issue's targets, each {name, required, value, met} (+ op, threshold); value None: not measured."""
    build = sections.get("build") or {}
    students = sections.get("students") or {}
    family = cfg["loop"]["family"]
    b = cfg["build"]
    desc = (sections.get("loop") or {}).get("description") or TARGET_CONFIG
    e_over_a_infer = (students.get("E_over_A") or {}).get(family, {}).get("inference_img_per_s")
    targets = _loop_targets(sections.get("loop"), "eager", desc, set(VARIANTS))
    if (sections.get("loop_graphs") or {}).get("rows"):
        targets += _loop_targets(sections["loop_graphs"], "eager + CUDA graphs of the blocks", desc,
                                 {GRAPHED.format(v=v) for v in VARIANTS})
        targets += _loop_targets(sections["loop_graphs"], "eager + CUDA graphs of the blocks and text layers", desc,
                                 {GRAPHED_TEXT.format(v=v) for v in VARIANTS})
        targets += _loop_targets(sections["loop_graphs"], "eager + CUDA graphs of the blocks, text layers and heads "
                                 "(A: blocks and text layers)", desc,
                                 {GRAPHED_TEXT.format(v="A")} | {GRAPHED_HEADS.format(v=v) for v in VARIANTS})
        targets += _loop_targets(sections["loop_graphs"], "all CUDA graphs: blocks, text layers, heads and loss "
                                 "terms", desc, {GRAPHED_ALL.format(v=v) for v in VARIANTS})
    targets.append(_target(f"E / A inference img/s ({family}, image encoder, batch {cfg['students']['batch_size']})",
                           ">=", 2, e_over_a_infer))
    e_over_a_bf16 = (students.get("E_over_A") or {}).get(family, {}).get(BF16_INFERENCE)
    if e_over_a_bf16 is not None:
        targets.append(_target(f"E / A inference img/s [bf16 weights, no autocast] ({family}, image encoder, batch "
                               f"{cfg['students']['batch_size']})", ">=", 2, e_over_a_bf16))
    e_over_a_compiled = (students.get("E_over_A") or {}).get(family, {}).get(COMPILED_INFERENCE)
    if e_over_a_compiled is not None:
        targets.append(_target(f"E / A inference img/s [compiled whole, CUDA graphs] ({family}, image encoder, batch "
                               f"{cfg['students']['batch_size']})", ">=", 2, e_over_a_compiled))
    targets.append(_target(f"build / teacher forward ({cfg['teacher']} teacher, K={b['n_aug']}, {b['store_size']} px)",
                           ">=", 0.9, build.get("ratio")))
    if build.get("steady_ratio") is not None:  # beside it, not instead: the same build without its workers' start-up
        targets.append(_target(f"build / teacher forward [steady: from the build's first batch, {b['n']} samples]",
                               ">=", 0.9, build["steady_ratio"]))
    compiled_rows = (sections.get("loop_compiled") or {}).get("rows") or []
    for scope in COMPILE_ESTIMATE_S:
        rows = [r for r in compiled_rows if r["name"] in {_compiled_name(v, scope) for v in VARIANTS}]
        if rows:
            targets += _loop_targets({"rows": rows}, f"compiled {scope}", desc,
                                     {_compiled_name(v, scope) for v in VARIANTS})
    return targets


def reserve_after(cfg: dict, name: str, skip_sections=()) -> float:
    """Seconds the sections after ``name`` reserve, those the command skips left out (the H100 run at 0ef6026 held
    back train_step's 45 s under --skip train_step, and left a compiled configuration out for them)."""
    later = SECTIONS[SECTIONS.index(name) + 1:]
    return sum(cfg["reserve"][n] for n in later if n not in skip_sections)


def run_suite(tiny: bool, device: str, budget_s: float, work: Path, log=print, compile_: bool = True,
              skip_sections: tuple[str, ...] = (), on_section=None, compiled_scopes: tuple[str, ...] = ()) -> dict:
    """Every section in order within the budget. ``on_section(result)`` runs after each section with the
    result so far (targets included), so a run cut short still leaves what it measured. ``compiled_scopes``: the
    compiled loop's scopes to time (``compiled_order``; empty: every one)."""
    import torch

    cfg = settings(tiny, device)
    cfg["compile"] = cfg["compile"] and compile_
    cfg["compiled_scopes"] = list(compiled_scopes)
    cfg["compiled_inference"] = cfg["compile"] and "inference_compiled" not in skip_sections
    cfg["loop_comparisons"] = "loop_comparisons" not in skip_sections
    if not cfg["loop_comparisons"]:  # A-E alone: 5 of the loop's 8 configurations
        cfg["reserve"]["loop"] = round(cfg["reserve"]["loop"] * len(VARIANTS) / (len(VARIANTS) + 3))
    cfg["peer"]["compile"] = cfg["peer"]["compile"] and compile_
    budget = Budget(budget_s)
    name = device_name(device, tiny)
    result = {"device": name, "device_kind": device, "mode": "tiny" if tiny else "full",
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "budget_s": budget_s,
              "peak_bf16_flops": _peak_flops(device),
              "settings": {k: v for k, v in cfg.items() if k != "families"} | {
                  "families": {f: {"configs": p, "overrides": o, "variants": vs}
                               for f, (p, o, vs) in cfg["families"].items()}},
              "sections": {}, "skipped": [], "errors": {}, "section_seconds": {}}
    sections = result["sections"]

    def after(name):
        return reserve_after(cfg, name, skip_sections)

    def skip(name, note):
        result["skipped"].append({"section": name, "reason": note})
        log(f"[{name}] {note}")

    def finish_result():
        result["targets"] = evaluate_targets(sections, cfg, tiny)
        result["targets_device"] = name
        result["targets_note"] = (
            f"tiny CPU run: every value was measured here, on {name}, at test size ({_describe_tiny(cfg)}); 'met' "
            f"compares these CPU figures with the GPU thresholds, so it says nothing about the GPU configuration "
            f"({TARGET_CONFIG}), whose figures only a --device cuda run gives" if tiny else
            f"measured on {name} in this run; GPU busy % and host syncs need CUDA")
        result["elapsed_s"] = round(budget.elapsed(), 1)

    def hand_over():  # the result so far, to on_section
        if on_section is not None:
            finish_result()
            on_section(result)

    def run(name, fn):
        try:
            _run(name, fn)
        finally:
            hand_over()

    def _run(name, fn):
        if name in skip_sections:
            skip(name, "skipped: --skip")
            return
        if budget.left() < cfg["reserve"][name]:
            skip(name, f"skipped: {budget.left():.0f} s of the {budget_s:.0f} s budget left, the section needs "
                       f"~{cfg['reserve'][name]} s")
            return
        log(f"[{name}] starting ({budget.elapsed():.0f} s elapsed)")
        start, cpu = time.perf_counter(), time.process_time()
        try:
            sections[name] = fn()
        except Exception as exc:  # noqa: BLE001 - record it, measure the rest
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            log(f"[{name}] failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            _free_device_memory()
        result["section_seconds"][name] = round(time.perf_counter() - start, 1)
        log(f"[{name}] done in {result['section_seconds'][name]} s ({time.process_time() - cpu:.1f} CPU s of "
            f"this process)")

    run("build", lambda: section_build(cfg, work, budget))
    built = (sections.get("build") or {}).get("shards")
    phantom: list[str] = []

    def shards() -> str:  # the build's shards; without them (build failed) a phantom build of the loop's own
        if built:
            return built
        if not phantom:
            import train_step

            start = time.perf_counter()
            phantom.append(str(train_step.build_phantom(work / "loop-shards", 96 if tiny else 2048,
                                                        64 if tiny else 256, workers=0 if tiny else
                                                        cfg["build"]["workers"])))
            log(f"[shards] the build section's shards missing (skipped or failed): built the loop's own in "
                f"{time.perf_counter() - start:.0f} s")
        return phantom[0]

    run("students", lambda: section_students(cfg, work, budget, after("students")))
    run("loop", lambda: section_loop(cfg, work, budget, shards()))
    run("loop_graphs", lambda: section_loop_graphs(cfg, work, shards()))
    run("peer", lambda: section_peer(cfg, work, budget, after("peer")))
    if not cfg["compile"]:
        skip("loop_compiled", "skipped: " + ("the tiny CPU run times no compiled step (a CPU compile takes minutes)"
                                             if tiny else "--no-compile"))
    else:
        def publish(partial):
            sections["loop_compiled"] = partial
            hand_over()

        run("loop_compiled", lambda: section_loop_compiled(cfg, work, budget, shards(), after("loop_compiled"),
                                                           publish))
    run("train_step", lambda: section_train_step(cfg, work, budget, built))
    if "loop" in sections or "students" in sections:
        run("table", lambda: section_table(cfg, sections.get("loop"), sections.get("students")))
    else:
        skip("table", "skipped: neither the loop nor the students section was measured")
    finish_result()
    return result


def _peak_flops(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None  # without importing the models (efficiency imports them): a spent budget stays quick
    from cxrdr.train.evaluation.efficiency import peak_bf16_flops

    return peak_bf16_flops(device)


def _describe_tiny(cfg: dict) -> str:
    return (f"students {cfg['families'][cfg['loop']['family']][0].format(v='A-E')}, loop batch "
            f"{cfg['loop']['batch_size']}, fp32, build {cfg['build']['n']} samples with {cfg['teacher']}")


def _env_text(env: dict) -> str:
    """Environment variables as ``NAME=value`` words (a compiled configuration's or the smoke check's)."""
    return " ".join(f"{k}={v}" for k, v in env.items())


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


FIGURE_COLUMNS = [("img_per_s", "img/s"), ("step_ms", "ms/step"), ("gpu_busy_pct", "GPU busy %"),
                  ("mfu_pct", "MFU %"), ("peak_memory_mb", "peak MB"), ("host_syncs_per_step", "host syncs/step"),
                  ("gflops_per_img", "GFLOPs/img (fwd+bwd)"), ("warmup_s", "warm-up s")]


def markdown(result: dict) -> str:
    from cxrdr.train.evaluation.report import COST_COLUMNS, markdown_table

    s = result["sections"]
    tiny = result["mode"] == "tiny"
    md = [f"# GPU benchmark suite: {result['device']}", "",
          f"- mode **{result['mode']}**, torch {result['torch']}, CUDA {result['cuda']}, {result['date']}",
          f"- command: `python benchmarks/{result['command']}`; {result['elapsed_s']} s of a {result['budget_s']:.0f} s budget",
          f"- MFU against {_fmt(result['peak_bf16_flops'])} dense bf16 FLOP/s" if result["peak_bf16_flops"] else
          "- MFU: not computed (no bf16 peak known for this device); GPU busy % and host syncs: CUDA only",
          "- peak memory: CUDA max allocated on GPU (whatever else the process holds included), process RSS on CPU",
          ""]
    if tiny:
        md += ["*Tiny CPU run (test-sized models and data): it checks that the suite works. Its figures, and the "
               "targets' values and 'met' below, are CPU measurements at tiny size, not the GPU targets' "
               "measurements.*", ""]
    md += ["## Targets", "", f"{result['targets_note']}.", "",
           "| target | required | measured | met |", "|---|---|---|---|"]
    for t in result["targets"]:
        met = "not measured" if t["met"] is None else ("yes" if t["met"] else "**no**")
        md.append(f"| {t['name']} | {t['required']} | {_fmt(t['value'])} | {met} |")
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
                             ("ratio", "ratio"), ("build_seconds", "build s"), ("teacher_seconds", "teacher s"),
                             ("build_steady_samples_per_s", "from the first batch: samples/s"),
                             ("steady_ratio", "ratio")]), "",
               f"time split (s, wall; decode_augment summed over the workers): {b['time_split_seconds']}; "
               f"start-up before the first batch (s): {b.get('start_up_seconds')}",
               f"CPU (s): workers' steps {b.get('prepare_cpu_seconds')}; the build's threads "
               f"{b.get('main_cpu_seconds')}; {(b.get('cpu_threads') or {}).get('line', 'cpu threads as given')}, "
               f"{b.get('cpus')} CPUs", ""]
        md += [f"- thread {name}, {t['samples']} samples of {BUILD_SAMPLE_INTERVAL_S * 1e3:.0f} ms: " + ", ".join(
            f"{fn} {pct}%" for fn, pct in list(t["own_pct"].items())[:5]) for name, t in
            (b.get("thread_samples") or {}).items() if not name.startswith(("QueueFeederThread", "tqdm"))]
        md += [""] if b.get("thread_samples") else []
    if "students" in s:
        st = s["students"]
        md += ["## 2. Students (synthetic batch)", "", st["note"] + ".", "",
               *_table(st["rows"], [("family", "family"), ("config", "config"), ("image_tower", "image tower"),
                                    ("image_size", "px"), ("params_m", "params M"),
                                    ("train_img_per_s", "train img/s"), ("train_gpu_busy_pct", "train busy %"),
                                    ("train_mfu_pct", "train MFU %"), ("peak_memory_mb", "train peak MB"),
                                    ("host_syncs_per_step", "syncs/step"),
                                    ("inference_img_per_s", "infer img/s"), ("inference_gpu_busy_pct", "infer busy %"),
                                    ("inference_mfu_pct", "infer MFU %"), ("inference_peak_memory_mb", "infer peak MB"),
                                    (COMPILED_INFERENCE, "infer img/s, compiled + CUDA graphs"),
                                    (BF16_INFERENCE, "infer img/s, bf16 weights"),
                                    ("latency_ms_per_img", "latency ms"), ("train_gflops_per_img", "train GFLOPs/img"),
                                    ("gflops_per_img", "infer GFLOPs/img"), ("patch_usage_pct", "patch use %")]), ""]
        for family, r in st["E_over_A"].items():
            md.append(f"- {family}: E / A train img/s {_fmt(r['train_img_per_s'])}x, inference "
                      f"{_fmt(r['inference_img_per_s'])}x, GFLOPs {_fmt(r['gflops_per_img'])}x"
                      + (f"; inference compiled whole (CUDA graphs) {_fmt(r[COMPILED_INFERENCE])}x"
                         if r.get(COMPILED_INFERENCE) else "")
                      + (f"; inference with bf16 weights {_fmt(r[BF16_INFERENCE])}x" if r.get(BF16_INFERENCE) else ""))
        md += [f"- {r['config']} with bf16 weights: " + (r["inference_bf16_error"] if "inference_bf16_error" in r else
               f"smallest cosine of its embeddings to autocast's {r['inference_bf16_min_cosine_to_autocast']:.4f}")
               for r in st["rows"] if BF16_INFERENCE in r or "inference_bf16_error" in r]
        md += [f"- not measured: {x}" for x in st["skipped"]] + [""]
    if "loop" in s:
        lp = s["loop"]
        md += ["## 3. Real training loop (Trainer.train_step)", "", f"{lp['description']}; {lp['note']}.", "",
               *_table(lp["rows"], [("name", "config"), *FIGURE_COLUMNS, ("data_ms", "data wait ms")]), "",
               f"- D step / A step {_fmt(lp.get('D_over_A_step'))}; E / A img/s {_fmt(lp.get('E_over_A_img_per_s'))}; "
               f"A packed / padded texts img/s {_fmt(lp.get('A_packed_over_padded_img_per_s'))}; "
               f"D step / D step with the former heads {_fmt(lp.get('D_over_former_heads_D_step'))}; "
               f"E step / E step with the former heads {_fmt(lp.get('E_over_former_heads_E_step'))}",
               f"- CUDA math after the Trainer's start-up: {lp['cuda_math']}" if lp.get("cuda_math") else "", ""]
    if "loop_graphs" in s:
        lg = s["loop_graphs"]
        md += ["## 3b. Real training loop, the image tower's blocks as CUDA graphs (TrainConfig.cuda_graphs)", "",
               f"{lg['description']}; {lg['note']}.", "",
               *_table(lg["rows"], [("name", "config"), *FIGURE_COLUMNS, ("data_ms", "data wait ms")]), "",
               "- graphed / eager img/s: " + ", ".join(f"{v} {_fmt(x)}x" for v, x in
                                                       lg["graphed_over_eager_img_per_s"].items())
               + f"; graphed D step / A step {_fmt(lg['graphed_ratios'].get('D_over_A_step'))}; graphed E / A img/s "
                 f"{_fmt(lg['graphed_ratios'].get('E_over_A_img_per_s'))}",
               "- with the text layers too, over the blocks alone, img/s: " + ", ".join(
                   f"{v} {_fmt(x)}x" for v, x in lg.get("text_graphed_over_graphed_img_per_s", {}).items())
               + f"; D step / A step {_fmt(lg.get('text_graphed_ratios', {}).get('D_over_A_step'))}; E / A img/s "
                 f"{_fmt(lg.get('text_graphed_ratios', {}).get('E_over_A_img_per_s'))}",
               "- with the heads on the patch grid too, over the blocks and text layers, img/s: " + ", ".join(
                   f"{v} {_fmt(x)}x" for v, x in lg.get("heads_graphed_over_text_graphed_img_per_s", {}).items())
               + f"; D step / A step {_fmt(lg.get('heads_graphed_ratios', {}).get('D_over_A_step'))}; E / A img/s "
                 f"{_fmt(lg.get('heads_graphed_ratios', {}).get('E_over_A_img_per_s'))} (A: blocks and text)",
               "- with the loss terms too (all graphs), over the row before (A: its text graphs), img/s: " + ", ".join(
                   f"{v} {_fmt(x)}x" for v, x in lg.get("all_graphed_over_heads_graphed_img_per_s", {}).items())
               + f"; D step / A step {_fmt(lg.get('all_graphed_ratios', {}).get('D_over_A_step'))}; E / A img/s "
                 f"{_fmt(lg.get('all_graphed_ratios', {}).get('E_over_A_img_per_s'))}"]
        md += [f"- graphed vs eager tower, {v}: " + (a["error"] if "error" in a else
               f"output {a['max_rel_diff_output']:.1e}, gradients {a['max_rel_diff_grad']:.1e} (largest relative "
               f"difference; {a['graphs_captured']} graph(s))") for v, a in lg["agreement"].items()]
        md += [f"- {captured_text(r)}" for r in lg["rows"] if "graphs_captured" in r] + [""]
    if "peer" in s:
        pe = s["peer"]
        md += ["## 4. Peer: open_clip's own CLIP step on the same device", "", pe["description"] + ".", "",
               *_table(pe["rows"], [("name", "step"), *FIGURE_COLUMNS]), ""]
        md += [f"- {n}" for n in pe["notes"]] + [""]
    if "loop_compiled" in s:
        lc = s["loop_compiled"]
        md += ["## 5. Real training loop, torch.compile (TrainConfig.compile)", "", lc["note"] + ".", ""]
        if lc["rows"]:
            md += [*_table(lc["rows"], [("name", "config"), *FIGURE_COLUMNS, ("data_ms", "data wait ms")]), ""]
            md += [f"- compiled {scope} / {'graphed' if _graphed(scope) else 'eager'} img/s: " + ", ".join(
                f"{k} {_fmt(v)}x" for k, v in r["compiled_over_twin_img_per_s"].items()) for scope, r in
                lc["by_scope"].items()]
            md += [f"- {captured_text(r)}" for r in lc["rows"] if "graphs_captured" in r] + [""]
        md += [f"- **{f['name']}** not measured: {f['error']}"
               + (f" (with {_env_text(f['env'])})" if f.get("env") else "")
               + (f"; {_processes_text(f['processes'])}" if f.get("processes") else "") for f in lc.get("failed", [])]
        if lc.get("smoke"):
            md += ["- smoke check (a two-layer MLP's step compiled in a child): " + "; ".join(
                f"{_env_text(a['env']) or 'inductor defaults'}: "
                + (f"{a['seconds']} s" if "seconds" in a else a["error"]) for a in lc["smoke"]["attempts"])]
    if "train_step" in s:
        ts = s["train_step"]
        md += ["## 6. Training step: stored embeddings vs teacher online vs no teacher", "",
               f"Trainer steps (data + forward + losses + backward + AdamW) on {ts['shards']}; the online "
               "teacher's cost is its row's ms/step minus D stored's.", "",
               *_table(ts["rows"], [("name", "configuration"), ("model", "model"), *FIGURE_COLUMNS,
                                    ("data_ms", "data wait ms"), ("batch_size", "batch")]), "",
               f"online / stored: {_fmt(ts['online_over_stored'])}x; no teacher / stored: "
               f"{_fmt(ts['plain_over_stored'])}x", ""]
    if "table" in s:
        tb = s["table"]
        md += [f"## 7. Efficiency table ({tb['family']}, the layout of `train experiment ablation`)", "",
               f"infer img/s, synth step ms, latency, GFLOPs, peak MB: section 2 (synthetic batch of "
               f"{tb['synthetic_batch_size']}, target keep rate); step ms, train img/s, GPU busy %, MFU: the real "
               f"loop's (section 3, batch {tb['batch_size']}).", "",
               markdown_table(tb["rows"], COST_COLUMNS + ["step_ms", "train_img_per_s", "gpu_busy_pct", "mfu_pct"],
                              first="run"), ""]
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
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled loop and peer steps")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out "
                                                    f"({', '.join(SECTIONS + SKIPPABLE_PARTS)})")
    parser.add_argument("--compiled", default="", help="comma-separated compile scopes the compiled loop times, in "
                                                        f"its order (default: all; {', '.join(COMPILE_SETTINGS)})")
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
    skip_sections = tuple(x for x in args.skip.split(",") if x)
    unknown = sorted(set(skip_sections) - set(SECTIONS + SKIPPABLE_PARTS))
    if unknown:
        print(f"gpu_suite: --skip {','.join(unknown)}: no such section (sections: {', '.join(SECTIONS)}; parts: "
              f"{', '.join(SKIPPABLE_PARTS)})", file=sys.stderr)
        return 2
    compiled_scopes = tuple(x for x in args.compiled.split(",") if x)
    try:
        compiled_order(compiled_scopes)
    except ValueError as exc:
        print(f"gpu_suite: {exc}", file=sys.stderr)
        return 2
    budget = args.budget or (120.0 if args.tiny else 480.0)
    out_dir = Path(args.out_dir)
    with tempfile.TemporaryDirectory(prefix="gpu-suite-") as tmp:
        result = run_suite(args.tiny, device, budget, Path(tmp), log=lambda m: print(m, file=sys.stderr, flush=True),
                           compile_=not args.no_compile, skip_sections=skip_sections,
                           compiled_scopes=compiled_scopes,
                           on_section=lambda partial: write_results(partial, out_dir))
    json_path, md_path = write_results(result, out_dir)
    print(markdown(result))
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
