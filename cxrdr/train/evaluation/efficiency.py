"""Compute cost of a model: throughput, step time, latency, peak memory, GFLOPs, patch usage,
and on CUDA the share of wall time the GPU is busy, model FLOPs utilisation and host syncs.

All timings use synthetic inputs at the model's own image size and context length, after
warm-up iterations, with CUDA synchronised around the clock. They run as the training loop
runs: on CUDA under bf16 autocast (``amp``, via ``cxrdr.train.device``) with the loop's CUDA math
settings (``loop_math``: TF32 for the fp32 work autocast leaves), and the optimiser is the loop's
(``cxrdr.train.optim.build_optimizer``: fused AdamW on CUDA, the loop's parameter groups). On CPU
autocast is off, as in the loop.

Peak memory is CUDA ``max_memory_allocated`` on GPU; on CPU it is the process's peak resident
set size sampled during the measurement (``/proc/self/status`` VmRSS; falls back to
``ru_maxrss``), which includes the Python process itself: compare models within one run, not
across machines (``peak_memory_kind`` says which).

GPU busy %: kernel (and memcpy/memset) time on the GPU, as the union of their intervals in a
torch.profiler trace of a few extra calls, per call, over the un-profiled wall time per call
(``gpu_busy_ms``, ``busy_pct``); None off CUDA. Model FLOPs utilisation (MFU): FLOPs per image counted by
``torch.utils.flop_counter`` (forward and backward for training) x images/s / the device's
dense bf16 peak (``PEAK_BF16_FLOPS``); None on CPU or on a device not in that table.
Host syncs: ``torch.cuda.set_sync_debug_mode("warn")`` warnings per call; None off CUDA.
Training FLOPs are counted only where an MFU can be computed (the count is slow on CPU).

The training step is the trainer's Task (forward of report and caption, the default objective
with a stored teacher's embeddings) + backward + AdamW step on a synthetic batch: the same
computation as a reinforced training step without needing shards. The real loop's step
(``Trainer.train_step``: data, host work and all) is timed by benchmarks/train_step.py and
benchmarks/gpu_suite.py with the helpers here.
"""
from __future__ import annotations

import contextlib
import copy
import resource
import threading
import time
import warnings

import torch
import torch.nn.functional as F

from cxrdr.common.allocator import keep_freed_memory
from cxrdr.train.checkpoint import load_checkpoint
from cxrdr.train import device as train_device
from cxrdr.train.device import amp_dtype_for, autocast
from cxrdr.train.losses import LossConfig
from cxrdr.train.models.frozen_memo import suspended
from cxrdr.train.optim import OptimConfig, build_optimizer
from cxrdr.train.task import Task

FAR_STEP = 10**9  # past any keep-rate warm-up, so token dropping runs at its final rate


# Dense (no sparsity) bf16 tensor-core peak FLOP/s from the vendors' data sheets, matched on the
# lower-cased ``torch.cuda.get_device_name``: (every substring that must occur, peak). The first
# match wins; a device matching none has no MFU (None) rather than a guessed one.
PEAK_BF16_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("h200",), 989e12),
    (("h100", "pcie"), 756e12),
    (("h100", "hbm3"), 989e12),  # the SXM5 card names itself "NVIDIA H100 80GB HBM3"
    (("h100", "sxm"), 989e12),
    (("a100",), 312e12),  # SXM4 and PCIe alike
)

SYNC_WARNING = "synchronizing CUDA operation"  # the text of set_sync_debug_mode("warn")'s warning


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def peak_bf16_flops_of(name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU named ``name`` (``torch.cuda.get_device_name``); None if unknown."""
    name = name.lower()
    return next((peak for needles, peak in PEAK_BF16_FLOPS if all(n in name for n in needles)), None)


def peak_bf16_flops(device) -> float | None:
    """The device's dense bf16 peak FLOP/s from ``PEAK_BF16_FLOPS``; None on CPU or an unknown GPU."""
    if not _is_cuda(device):
        return None
    return peak_bf16_flops_of(torch.cuda.get_device_name(torch.device(device)))


def mfu_pct(flops_per_item: float | None, items_per_s: float | None, device) -> float | None:
    """Model FLOPs utilisation in percent: counted FLOPs per item x items/s / the device's bf16 peak."""
    peak = peak_bf16_flops(device)
    if peak is None or not flops_per_item or not items_per_s:
        return None
    return 100.0 * flops_per_item * items_per_s / peak


def loop_math(device):
    """The CUDA math settings a training process runs with (``cxrdr.train.device.training_cuda_math``:
    TF32 for the fp32 work autocast leaves, its attention-kernel choice), restored on exit; on CUDA only."""
    return train_device.training_cuda_math() if _is_cuda(device) else contextlib.nullcontext()


def gpu_activity_spans(events) -> list[tuple[float, float]]:
    """(start, end) microseconds of the GPU's own work among a trace's raw events (``kineto_results.events()``):
    kernels, copies, memsets. Not the GPU-side copies of the host's annotations (``record_function`` ranges:
    ``Optimizer.step``, torch.compile's regions, the loop's phases): the profiler draws each over the device
    time its kernels span, gaps included, so counting them would call a waiting GPU busy."""
    from torch.autograd import DeviceType

    return [(e.start_ns() / 1e3, e.end_ns() / 1e3) for e in events
            if e.device_type() == DeviceType.CUDA and not getattr(e, "is_user_annotation", lambda: False)()]


def merged_spans(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as sorted, disjoint intervals (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def union_length(spans: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals (overlaps count once)."""
    return sum(end - start for start, end in merged_spans(spans))


def gpu_busy_ms(fn, calls: int, device) -> float | None:
    """Milliseconds per call during which the GPU runs a kernel, memcpy or memset: the union of their
    intervals (``gpu_activity_spans``) in a torch.profiler trace (CUDA activity only) of ``calls``
    back-to-back calls (overlapping kernels on several streams count once), divided by ``calls``. None
    off CUDA.

    Divide by the un-profiled step time for a busy share: the profiler slows the host side (which
    is what leaves a GPU idle), not the kernels, so the profiled wall time would understate it.
    The trace's raw events are read (``kineto_results``), not ``prof.events()``, whose Python
    event tree takes seconds to build for a step of thousands of kernels."""
    if not _is_cuda(device) or calls <= 0:
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    return union_length(gpu_activity_spans(prof.profiler.kineto_results.events())) / 1000.0 / calls


def busy_pct(busy_ms: float | None, step_ms: float | None) -> float | None:
    return None if busy_ms is None or not step_ms else 100.0 * busy_ms / step_ms


def count_host_syncs(fn, calls: int, device) -> float | None:
    """Host-device synchronisations per call of ``fn``, counted as the warnings
    ``torch.cuda.set_sync_debug_mode("warn")`` raises (blocking copies, ``.item()``, ``nonzero``,
    stream syncs...). None off CUDA. The caller's own synchronisation stays outside the count."""
    if not _is_cuda(device) or calls <= 0:
        return None
    _sync(device)
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    _sync(device)
    return sum(SYNC_WARNING in str(w.message) for w in caught) / calls


def _rss_mb() -> float:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class PeakMemory(contextlib.AbstractContextManager):
    """Peak memory (MB) inside the block: CUDA max allocated, or sampled process RSS on CPU."""

    def __init__(self, device="cpu", interval: float = 0.005):
        self.device, self.interval, self.peak_mb = torch.device(device), interval, 0.0
        self._stop = threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_mb = torch.cuda.memory_allocated(self.device) / 2**20
        else:
            self.peak_mb = self.start_mb = _rss_mb()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(self.interval):
            self.peak_mb = max(self.peak_mb, _rss_mb())

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mb = max(self.peak_mb, _rss_mb())
        return False


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _synthetic_inputs(model, batch_size: int, device, seed: int) -> tuple[torch.Tensor, dict]:
    """Random images at the model's size, and a fixed plausible report per row as the tokenizer gives it
    (its tensors on ``device``)."""
    gen = torch.Generator().manual_seed(seed)
    size = int(model.image_size)
    images = torch.rand(batch_size, 1, size, size, generator=gen).to(device)
    texts = ["mild cardiomegaly. small right pleural effusion. no pneumothorax."] * batch_size
    return images, {k: v.to(device) for k, v in model.tokenize(texts).items()}


def synthetic_batch(model, batch_size: int, device, seed: int = 0):
    """Random images at the model's size and a fixed plausible report per row, tokenized."""
    images, tok = _synthetic_inputs(model, batch_size, device, seed)
    return images, tok["input_ids"], tok["attention_mask"]


def synthetic_train_batch(model, batch_size: int, device, seed: int = 0) -> dict:
    """A loader-like batch for the Task: images, report and caption tokens (with the tokenizer's packing index,
    as the loader's collate gives them), and one teacher's (random, normalised) image/report/caption embeddings
    as a reinforced shard stores them."""
    images, tok = _synthetic_inputs(model, batch_size, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    teacher = {part: F.normalize(torch.randn(batch_size, model.embed_dim, generator=gen), dim=-1).to(device)
               for part in ("img", "txt", "syn")}
    ids, mask, index = tok["input_ids"], tok["attention_mask"], tok.get("token_index")
    return {"images": images, "report_ids": ids, "report_mask": mask, "caption_ids": ids,
            "caption_mask": mask, "report_token_index": index, "caption_token_index": index,
            "teacher": {"synthetic": teacher}}


def _time(fn, iters: int, warmup: int, device) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _cpu_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils import flop_counter

    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils import flop_counter

    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


def flop_counter():
    """A torch.utils.flop_counter.FlopCounterMode (no display) that also counts the CPU kernel of
    ``scaled_dot_product_attention``. Why: the counter has formulas for the CUDA kernels (flash, memory-efficient,
    cuDNN) and counts 0 for the CPU one, so a CPU count left out every attention's matrix products: the ViT's, the
    text tower's and the local heads' (B_text x B_image pooling, B^2 x tokens x patches). Same formulas."""
    from torch.utils.flop_counter import FlopCounterMode

    formulas = {"_scaled_dot_product_flash_attention_for_cpu": _cpu_attention_flops,
                "_scaled_dot_product_flash_attention_for_cpu_backward": _cpu_attention_backward_flops}
    # a torch without these kernels (or with other names) counts as before rather than failing
    return FlopCounterMode(display=False, custom_mapping={
        getattr(torch.ops.aten, name): formula for name, formula in formulas.items() if hasattr(torch.ops.aten, name)})


def gflops(fn, grad: bool = False) -> float:
    """GFLOPs of one call of ``fn`` counted by ``flop_counter`` (matmul/conv/attention, on CPU too).
    ``grad``: run with autograd on, so a ``fn`` that calls ``backward`` has its backward counted too
    (a training step's FLOPs); otherwise under no_grad (a forward)."""
    counter = flop_counter()
    with counter, (contextlib.nullcontext() if grad else torch.no_grad()):
        fn()
    return counter.get_total_flops() / 1e9


def image_encoder_metrics(encode_images, image_size: int, batch_size: int = 32, iters: int = 5,
                          warmup: int = 2, device="cpu", amp_dtype: torch.dtype | None = None,
                          batch_only: bool = False) -> dict:
    """Inference throughput, batch-1 latency, GFLOPs/img of any ``encode_images(B,1,S,S)``, and
    at the batch: peak memory, GPU busy % and MFU (None off CUDA). ``amp_dtype``: autocast dtype
    (the training loop's ``amp_dtype_for``) or None for full precision; TF32 on CUDA. The timed batches share
    one autocast region, as an inference pass's do (the weights cast once).
    ``batch_only``: call ``encode_images`` at the batch size alone (latency, GFLOPs and MFU None), for
    a function compiled for that one shape (a batch of 1 would compile it again)."""
    device = torch.device(device)
    x = torch.rand(batch_size, 1, image_size, image_size, device=device)
    x1 = x[:1]
    run_batch, run_one = (lambda: encode_images(x)), (lambda: encode_images(x1))
    # the batches in one autocast region, as an inference pass runs them (quick_eval.collect_embeddings): the
    # weights' casts are made once and cached, not again for every batch
    with torch.no_grad(), autocast(device, amp_dtype), loop_math(device):
        with PeakMemory(device) as peak:
            t_batch = _time(run_batch, iters, warmup, device)
        t_one = None if batch_only else _time(run_one, iters * 2, warmup, device)
        busy = gpu_busy_ms(run_batch, min(iters, 3), device)
    per_img = None if batch_only else gflops(lambda: encode_images(x1))
    return {"inference_img_per_s": batch_size / t_batch,
            "latency_ms_per_img": None if t_one is None else t_one * 1000,
            "gflops_per_img": per_img, "eval_batch_size": batch_size,
            "inference_peak_memory_mb": peak.peak_mb,
            "inference_gpu_busy_pct": busy_pct(busy, t_batch * 1000),
            "inference_mfu_pct": None if per_img is None else mfu_pct(per_img * 1e9, batch_size / t_batch, device)}


def efficiency_metrics(model, batch_size: int = 32, train_batch_size: int | None = None,
                       iters: int = 5, warmup: int = 2, step: int = FAR_STEP, amp: str = "bf16",
                       train_flops: bool | None = None) -> dict:
    """Inference img/s, training img/s and step ms, latency ms/img at batch 1, peak memory (MB)
    of the training step, GFLOPs per image (image tower; and of the full forward), patch usage %;
    training GFLOPs per image (forward + backward, counted), GPU busy %, MFU and host syncs per
    step of the training step (None off CUDA), the same for inference.

    Runs as the loop does (module docstring): ``amp`` autocast on CUDA (``bf16``, ``fp16`` or
    ``none``), the loop's CUDA math (``loop_math``), the loop's optimiser. ``train_flops``: count
    the training step's FLOPs (None: only where an MFU can be computed, a CUDA device in
    ``PEAK_BF16_FLOPS``; the count runs the step through a Python dispatch mode, several steps'
    time on CPU, for a figure only MFU needs).

    ``model`` is a PatchIBStudent (needs ``forward``/``tokenize``); the model is restored to its
    original train/eval mode and parameters are not changed (the optimizer step runs on a copy). A frozen stem's
    memo (``frozen_memo``: the training loop's, on the CPU) is off meanwhile: the figures time the model's compute.
    """
    with suspended(model):
        return _efficiency_metrics(model, batch_size, train_batch_size, iters, warmup, step, amp, train_flops)


def _efficiency_metrics(model, batch_size: int, train_batch_size: int | None, iters: int, warmup: int, step: int,
                        amp: str, train_flops: bool | None) -> dict:
    device = model_device(model)
    amp_dtype = amp_dtype_for(amp, device)
    was_training = model.training
    train_bs = train_batch_size or batch_size
    model.eval()
    out = image_encoder_metrics(model.encode_image, int(model.image_size), batch_size, iters,
                                warmup, device, amp_dtype=amp_dtype)
    images, ids, mask = synthetic_batch(model, 1, device)
    with torch.no_grad():
        fwd = model(images, ids, mask, step=step)
    out["gflops_forward_pair"] = gflops(lambda: model(images, ids, mask, step=step))
    keep = float(getattr(fwd, "keep_ratio", 1.0) or 1.0)
    out["patch_usage_pct"] = 100.0 * keep
    z = getattr(fwd, "mask", None)
    out["mask_kept_pct"] = 100.0 * float((z > 0.5).float().mean()) if z is not None else None

    trainee = copy.deepcopy(model).train()
    task = Task(trainee, LossConfig(), total_steps=step + 1, device=device)
    opt = build_optimizer(trainee, OptimConfig(lr=1e-5))  # the loop's: fused AdamW on CUDA, its groups
    batch = synthetic_train_batch(trainee, train_bs, device, seed=1)

    def forward_backward():
        with autocast(device, amp_dtype):
            loss = task.forward(batch, step)["total"]
        loss.backward()

    def train_step():
        opt.zero_grad(set_to_none=True)
        forward_backward()
        opt.step()

    with loop_math(device):
        train_step()  # allocate optimizer state before measuring memory
        with PeakMemory(device) as peak:
            t_step = _time(train_step, iters, warmup, device)
        busy = gpu_busy_ms(train_step, min(iters, 3), device)
        syncs = count_host_syncs(train_step, 1, device)
        if train_flops if train_flops is not None else peak_bf16_flops(device) is not None:
            opt.zero_grad(set_to_none=True)
            train_gflops = gflops(forward_backward, grad=True) / train_bs  # forward + backward, per image
            opt.zero_grad(set_to_none=True)
        else:
            train_gflops = None
    out.update({"train_step_ms": t_step * 1000, "train_img_per_s": train_bs / t_step,
                "train_batch_size": train_bs, "peak_memory_mb": peak.peak_mb,
                "step_memory_delta_mb": peak.peak_mb - peak.start_mb,  # above the state before the step
                "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "process_rss",
                "train_gflops_per_img": train_gflops, "train_gpu_busy_pct": busy_pct(busy, t_step * 1000),
                "train_mfu_pct": mfu_pct(train_gflops and train_gflops * 1e9, train_bs / t_step, device),
                "host_syncs_per_step": syncs,
                "autocast": None if amp_dtype is None else str(amp_dtype).removeprefix("torch."),
                "loop_math": device.type == "cuda", "peak_bf16_flops": peak_bf16_flops(device),
                "device": str(device), "threads": torch.get_num_threads()})
    del trainee, task, opt
    model.train(was_training)
    return out


def measure_in_subprocess(ckpt: str, batch_size: int = 32, iters: int = 5, timeout: float = 600) -> dict:
    """``efficiency_metrics`` of a checkpoint in a fresh Python process.

    On CPU the peak-RSS number of one process that already trained and evaluated other models
    says little (the allocator keeps what it freed); a fresh process measures one model alone.
    """
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "eff.json")
        cmd = [sys.executable, "-m", "cxrdr.train.evaluation.efficiency", str(ckpt), "--batch-size",
               str(batch_size), "--iters", str(iters), "--json", out,
               "--threads", str(torch.get_num_threads())]  # the same threads as the caller
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"efficiency measurement of {ckpt} failed: {proc.stderr.strip()[-500:]}")
        with open(out) as fh:
            return json.load(fh)


def _main(argv=None) -> None:
    """``python -m cxrdr.train.evaluation.efficiency CKPT [--batch-size N] [--iters N] [--json PATH]``."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("ckpt")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the train CLI does: the same allocator behaviour as the training it measures
    if args.threads:
        torch.set_num_threads(args.threads)
    baseline = _rss_mb()
    model = load_checkpoint(args.ckpt, device="cuda" if torch.cuda.is_available() else "cpu")
    result = efficiency_metrics(model, batch_size=args.batch_size, iters=args.iters)
    result["memory_before_model_mb"] = baseline
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    else:
        print(text)


if __name__ == "__main__":
    _main()
