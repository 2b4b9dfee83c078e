"""Operators dispatched per training step (forward + backward) of student variants, eager or compiled.

An eager step on a GPU issues each operator from Python, a few microseconds of CPU apiece; where the kernels are
short (E's dropped tokens, small batches), that CPU time is the step's floor (on the H200 E was 75 % busy). The
count of dispatched ``aten::`` operators, which ``--compile-scope blocks`` cuts by fusing inside each block, is
measurable on any machine:

    python benchmarks/dispatch_count.py D D:blocks E E:blocks      # full-size students, batch 2, CPU
    python benchmarks/dispatch_count.py --size tiny A A:blocks
    python benchmarks/dispatch_count.py A E --by-function 3 --inference-casts
    python benchmarks/dispatch_count.py D --mode plain --by-function 12   # beside --mode reinforced: what the
                                                                          # stored teacher's losses add

``--by-function N`` also splits the operators by the project's function that issued them and counts the image
tower's blocks alone (forward + backward: what ``--cuda-graphs`` replays as two launches) and the heads on the patch
grid alone (what ``--cuda-graphs-heads`` replays) and the loss terms on the global embeddings
(``--cuda-graphs-losses``);
``--inference-casts``
counts the bf16 casts of a validation pass's first batch and of each later one (the weights' are cached).

Each argument is VARIANT[:SCOPE] (SCOPE: a ``TrainConfig.compile_scope``). The count is torch.profiler's
``aten::`` events of one micro-step (``Trainer._micro_step``) after two warm-up steps (the compilation), nested
calls included; the optimiser step is left out (on CUDA it is one fused AdamW). On CPU, inductor still calls aten
for matrix products, so a GPU's count drops further than the CPU's. Beside it: the seconds of the first step (the
compilation, with inductor's cache in a fresh folder per command unless TORCHINDUCTOR_CACHE_DIR is set; later
configurations of one command reuse what earlier ones compiled) and of the second, and for a compiled
configuration the graphs dynamo compiled in its three steps (1: no graph break, no recompilation; ``--backend
aot_eager`` checks that without inductor's code generation).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def count_step_ops(trainer, batches) -> collections.Counter:
    """``aten::`` events of one forward + backward of the trainer's step (its batches' next one)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    _micro_step_within(trainer, batches, prof)
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def _micro_step_within(trainer, batches, context) -> None:
    """One forward + backward of the trainer's step on its batches' next one, inside ``context`` (the batch is
    taken outside it); the gradients cleared after, so the step leaves the trainer as it was."""
    batch = next(batches)
    with context:
        trainer._micro_step(batch, sync=True, log_balance=False)
    trainer.optimizer.zero_grad(set_to_none=True)


def ops_by_function(trainer, batches) -> collections.Counter:
    """Operators of one forward + backward of the trainer's step by where they come from: the innermost cxrdr
    function on the Python stack ("file:function"; an operator of timm or transformers counts for the cxrdr function
    that called into them), or "backward" for the autograd engine's. Counted below autograd
    (``TorchDispatchMode``: each operator once, nested calls not counted again), so the totals are lower than
    ``count_step_ops``'; the split says which of the project's own functions issue the operators."""
    from torch.utils._python_dispatch import TorchDispatchMode

    package = str(Path(__file__).resolve().parents[1] / "cxrdr")
    counts: collections.Counter = collections.Counter()

    def origin() -> str:
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(package):
                return f"{Path(code.co_filename).relative_to(package)}:{code.co_name}"
            if code.co_name in ("backward", "_engine_run_backward"):
                return "backward"
            frame = frame.f_back
        return "other"

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[origin()] += 1
            return func(*args, **(kwargs or {}))

    _micro_step_within(trainer, batches, Counting())
    return counts


def ops_of_backward(student, loss_of) -> int:
    """Operators below autograd of ``loss_of()`` and its backward (each once, nested calls not counted again), the
    student's gradients cleared after."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = [0]

    class Counting(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            count[0] += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        loss_of().backward()
    student.zero_grad(set_to_none=True)
    return count[0]


def tower_block_ops(student, batch_size: int) -> int:
    """Operators below autograd of the image tower's transformer blocks alone, forward + backward, on tokens of the
    shape they see in training (E: its kept tokens): what ``--cuda-graphs`` replays as two launches."""
    import torch

    tower = student.image_tower
    n = tower.num_patches
    tokens = 1 + (tower.num_kept(n) + int(tower.fuse_dropped) if hasattr(tower, "num_kept") else n)
    x = torch.randn(batch_size, tokens, tower.width, requires_grad=True)
    return ops_of_backward(student, lambda: tower._eager_blocks(x, 0, tower.depth).float().sum())


def grid_head_ops(student, batch_size: int) -> int:
    """Operators below autograd of the heads on the patch grid alone (head convs, then the mask at its final K),
    forward + backward, on the patches they read in training: what ``--cuda-graphs-heads`` replays as two launches.
    0 for a student without them (A)."""
    import torch

    from cxrdr.train.models.heads import GridHeads

    if student.head_conv is None and student.mask_head is None:
        return 0
    heads = GridHeads(student.head_conv, student.mask_head)
    tower = student.image_tower
    n = tower.num_patches
    if getattr(tower, "num_kept", None) and not student.drops_by_mask and tower.head_layer is None:
        n = tower.num_kept(n)  # an E whose heads read its kept patches
    x = torch.randn(batch_size, n, tower.width, requires_grad=True)
    return ops_of_backward(student, lambda: sum(t.float().sum() for t in heads(x)))


def global_term_ops(trainer, batches) -> int:
    """Operators below autograd of the loss terms on the global embeddings alone (``Objective._pair_terms`` of B_real
    and B_syn, and with a mask head Patch-IB's), forward + backward into the embeddings, on the trainer's next batch's
    teachers and random unit embeddings (and mask): what ``--cuda-graphs-losses`` replays as two launches."""
    import torch
    import torch.nn.functional as F

    objective, batch, student = trainer.task.objective, next(batches), trainer.student
    teachers = objective._teachers(batch.get("teacher") or {}, torch.device("cpu"))
    n = batch["images"].shape[0]
    img, txt, syn, masked = (F.normalize(torch.randn(n, student.embed_dim), dim=-1).requires_grad_(True)
                             for _ in range(4))
    mask = torch.rand(n, student.image_tower.num_patches, requires_grad=True)
    scale = torch.tensor(14.3, requires_grad=True)
    lam = objective.cfg.lambda_distill if teachers else 0.0

    def loss():
        terms = objective._pair_terms(img, txt, scale, lam, teachers, "txt", None, None, 0.0)
        terms.update(objective._pair_terms(img, syn, scale, lam, teachers, "syn", None, None, 0.0))
        if student.mask_head is not None:
            terms.update(objective.patch_ib({"img": img, "txt": txt, "masked_img": masked, "mask": mask},
                                            {"txt": txt, "masked_img": masked}, scale))
        return torch.stack(list(terms.values())).sum()
    return ops_of_backward(student, loss)


def inference_casts(student, batch_size: int, batches: int) -> int:
    """``aten::_to_copy`` events of a validation pass (``quick_eval.collect_embeddings``) of ``batches`` random
    batches under bf16 autocast on the CPU: the casts an inference pass makes, the weights' among them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from cxrdr.train.quick_eval import collect_embeddings

    tok = student.tokenize(["no acute findings."] * batch_size)
    size = student.config.image_size
    data = [{"images": torch.rand(batch_size, 1, size, size), "report_ids": tok["input_ids"],
             "report_mask": tok["attention_mask"], "labels": torch.zeros(batch_size, 3),
             "study_id": ["s"] * batch_size, "subject_id": ["s"] * batch_size, "view": ["PA"] * batch_size,
             "report_text": ["x"] * batch_size, "key": [f"k{i}-{j}" for j in range(batch_size)]}
            for i in range(batches)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        collect_embeddings(student, data, torch.device("cpu"), torch.bfloat16)
    return sum(e.name == "aten::_to_copy" for e in prof.events())


def main(argv=None) -> int:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="cxrdr-inductor-"))  # a cold compile
    import torch
    from torch._dynamo.utils import counters

    import train_step

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="+", help="VARIANT[:SCOPE], e.g. D D:blocks")
    parser.add_argument("--size", choices=("cpu", "tiny", "full"), default="full")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--shards", help="shard folder (default: a phantom build in a temp folder)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled configurations")
    parser.add_argument("--by-function", type=int, default=0, metavar="N",
                        help="also print the N cxrdr functions that issue the most operators (eager configurations)")
    parser.add_argument("--mode", choices=("plain", "reinforced"), default=None,
                        help="the training mode (default: the benchmark config's, reinforced with the stored teacher)")
    parser.add_argument("--inference-casts", action="store_true",
                        help="also count the bf16 casts of a validation pass's first and later batches")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory(prefix="cxrdr-dispatch-")
    store = 224 if args.size == "full" else 64
    shards = Path(args.shards) if args.shards else train_step.build_phantom(Path(tmp.name) / "shards", 16, store)
    prefix = {"cpu": "cpu-", "tiny": "tiny-", "full": ""}[args.size]
    counts = {}
    for i, spec in enumerate(args.configs):
        variant, _, scope = spec.partition(":")
        extra = {"compile": True, "compile_scope": scope, "compile_backend": args.backend} if scope else {}
        mode = {"mode": args.mode} if args.mode else {}
        base = {**train_step.bench_config(shards, args.batch_size, 0, "cpu"), "out": f"{tmp.name}/run{i}", **extra,
                **mode}
        trainer, batches = train_step.make_trainer(base, model=f"{prefix}{variant}")
        graphs_before = counters["stats"].get("unique_graphs", 0)
        seconds = []
        for _ in range(2):  # warm-up: the compilation, the loader
            start = time.perf_counter()
            trainer.train_step(batches, log_balance=False)
            seconds.append(time.perf_counter() - start)
        counts[spec] = count_step_ops(trainer, batches)
        batches.close()
        top = ", ".join(f"{name.removeprefix('aten::')} {n}" for name, n in counts[spec].most_common(5))
        graphs = f", {counters['stats'].get('unique_graphs', 0) - graphs_before} graph(s) compiled" if scope else ""
        print(f"{spec:<12} {sum(counts[spec].values()):>7} aten ops per forward + backward; first step "
              f"{seconds[0]:.1f} s, second {seconds[1]:.2f} s{graphs}  (most: {top})", flush=True)
        if args.by_function and not scope:
            where = ops_by_function(trainer, trainer._batches())  # a fresh pass: a small split may be spent
            print(f"  {sum(where.values())} operators below autograd; by origin: " + ", ".join(
                f"{name} {n}" for name, n in where.most_common(args.by_function)), flush=True)
            if hasattr(trainer.student.image_tower, "_eager_blocks"):
                print(f"  the image tower's blocks alone, forward + backward: "
                      f"{tower_block_ops(trainer.student, args.batch_size)} operators below autograd", flush=True)
            heads = grid_head_ops(trainer.student, args.batch_size)
            if heads:
                print(f"  the heads on the patch grid alone (--cuda-graphs-heads), forward + backward: {heads} "
                      "operators below autograd", flush=True)
            print(f"  the loss terms on the global embeddings alone (--cuda-graphs-losses), forward + backward: "
                  f"{global_term_ops(trainer, trainer._batches())} operators below autograd", flush=True)
        if args.inference_casts and not scope:
            one, three = (inference_casts(trainer.student, args.batch_size, n) for n in (1, 3))
            print(f"  a validation pass under bf16 autocast: {one} casts for its first batch, {(three - one) / 2:.0f} "
                  "for each later one", flush=True)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
