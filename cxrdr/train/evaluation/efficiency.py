"""Compute cost of a model: throughput, step time, latency, peak memory, GFLOPs, patch usage.

All timings use synthetic inputs at the model's own image size and context length, after
warm-up iterations, with CUDA synchronised around the clock. Peak memory is CUDA
``max_memory_allocated`` on GPU; on CPU it is the process's peak resident set size sampled
during the measurement (``/proc/self/status`` VmRSS; falls back to ``ru_maxrss``), which
includes the Python process itself: compare models within one run, not across machines.

The training step is the trainer's Task (forward of report and caption, the default objective
with a stored teacher's embeddings) + backward + AdamW step on a synthetic batch: the same
computation as a reinforced training step without needing shards.
"""
from __future__ import annotations

import contextlib
import copy
import resource
import threading
import time

import torch
import torch.nn.functional as F

from cxrdr.common.allocator import keep_freed_memory
from cxrdr.train.checkpoint import load_checkpoint
from cxrdr.train.losses import LossConfig
from cxrdr.train.task import Task

FAR_STEP = 10**9  # past any keep-rate warm-up, so token dropping runs at its final rate


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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


def synthetic_batch(model, batch_size: int, device, seed: int = 0):
    """Random images at the model's size and a fixed plausible report per row, tokenized."""
    gen = torch.Generator().manual_seed(seed)
    size = int(model.image_size)
    images = torch.rand(batch_size, 1, size, size, generator=gen).to(device)
    texts = ["mild cardiomegaly. small right pleural effusion. no pneumothorax."] * batch_size
    tok = model.tokenize(texts)
    return images, tok["input_ids"].to(device), tok["attention_mask"].to(device)


def synthetic_train_batch(model, batch_size: int, device, seed: int = 0) -> dict:
    """A loader-like batch for the Task: images, report and caption tokens, and one teacher's
    (random, normalised) image/report/caption embeddings as a reinforced shard stores them."""
    images, ids, mask = synthetic_batch(model, batch_size, device, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    teacher = {part: F.normalize(torch.randn(batch_size, model.embed_dim, generator=gen), dim=-1).to(device)
               for part in ("img", "txt", "syn")}
    return {"images": images, "report_ids": ids, "report_mask": mask, "caption_ids": ids,
            "caption_mask": mask, "teacher": {"synthetic": teacher}}


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


def gflops(fn) -> float:
    """GFLOPs of one call of ``fn`` counted by torch.utils.flop_counter (matmul/conv/attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        fn()
    return counter.get_total_flops() / 1e9


def image_encoder_metrics(encode_images, image_size: int, batch_size: int = 32, iters: int = 5,
                          warmup: int = 2, device="cpu") -> dict:
    """Inference throughput, batch-1 latency and GFLOPs/img of any ``encode_images(B,1,S,S)``."""
    x = torch.rand(batch_size, 1, image_size, image_size, device=device)
    x1 = x[:1]
    with torch.no_grad():
        t_batch = _time(lambda: encode_images(x), iters, warmup, device)
        t_one = _time(lambda: encode_images(x1), iters * 2, warmup, device)
    return {"inference_img_per_s": batch_size / t_batch, "latency_ms_per_img": t_one * 1000,
            "gflops_per_img": gflops(lambda: encode_images(x1)), "eval_batch_size": batch_size}


def efficiency_metrics(model, batch_size: int = 32, train_batch_size: int | None = None,
                       iters: int = 5, warmup: int = 2, step: int = FAR_STEP) -> dict:
    """Inference img/s, training img/s and step ms, latency ms/img at batch 1, peak memory (MB)
    of the training step, GFLOPs per image (image tower; and of the full forward), patch usage %.

    ``model`` is a PatchIBStudent (needs ``forward``/``tokenize``); the model is restored to its
    original train/eval mode and parameters are not changed (the optimizer step runs on a copy).
    """
    device = model_device(model)
    was_training = model.training
    train_bs = train_batch_size or batch_size
    model.eval()
    out = image_encoder_metrics(model.encode_image, int(model.image_size), batch_size, iters,
                                warmup, device)
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
    opt = torch.optim.AdamW(trainee.parameters(), lr=1e-5)
    batch = synthetic_train_batch(trainee, train_bs, device, seed=1)

    def train_step():
        opt.zero_grad(set_to_none=True)
        task.forward(batch, step)["total"].backward()
        opt.step()

    train_step()  # allocate optimizer state before measuring memory
    with PeakMemory(device) as peak:
        t_step = _time(train_step, iters, warmup, device)
    out.update({"train_step_ms": t_step * 1000, "train_img_per_s": train_bs / t_step,
                "train_batch_size": train_bs, "peak_memory_mb": peak.peak_mb,
                "step_memory_delta_mb": peak.peak_mb - peak.start_mb,  # above the state before the step
                "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "process_rss",
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
