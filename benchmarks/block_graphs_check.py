"""Do the image tower's blocks replayed as CUDA graphs (``--cuda-graphs``) compute what the eager blocks compute?
And the packed text tower's layers (``--cuda-graphs-text``, ``--text``), the heads on the patch grid
(``--cuda-graphs-heads``, ``--heads``) and the loss terms on the global embeddings (``--cuda-graphs-losses``,
``--losses``)?

Runs a student's image tower (the real one, e.g. ViT-S/16 of D or E, stochastic depth off so that two runs agree)
on a few batches of random images, each step forward and backward, once eagerly and once through
``models/block_graphs.py`` (the capture at the first step, replays after, on new inputs: a graph fed stale inputs
would show), and prints the largest differences of the output and of the parameters' gradients, relative to their
size. A speed figure says nothing about this; the GPU suite's loop_graphs section runs it before timing.

    python benchmarks/block_graphs_check.py --device cuda --model E --batch-size 32
    python benchmarks/block_graphs_check.py --device cpu --model tiny-E --stand-in   # the plumbing only (CPU)
    python benchmarks/block_graphs_check.py --device cuda --model E --text           # the text tower
    python benchmarks/block_graphs_check.py --device cuda --model E --heads          # the heads on the patch grid
    python benchmarks/block_graphs_check.py --device cuda --model D --losses --batch-size 256   # the loss terms
    python benchmarks/block_graphs_check.py --device cuda --model D --compile-blocks # compiled blocks as graphs

``--compile-blocks`` compiles every block first (``--compile-scope blocks``, inductor), so both runs use the compiled
blocks: it checks that a graph replays what the compiled blocks compute (``--cuda-graphs on`` with them), not that
compilation computes what eager does (its fused kernels round otherwise; the loop's losses say that).

The text check runs the student's text tower on texts of random lengths (a new count of real tokens each step, so
the tokens' padding to their bucket changes), dropout off. It needs FlashAttention (CUDA): elsewhere the packed
layers attend on the grid, no graph applies and it reports none captured.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def _tower_step(tower, images):
    """Loss and gradients of one forward + backward of the tower (E's mask-chosen tokens through its score path)."""
    import torch

    tower.zero_grad(set_to_none=True)
    if getattr(tower, "patch_score", None) == "mask":  # E: the scores the student's mask would give, stood in for
        tokens = tower.embed(images)
        out = tower.forward_tokens(tokens, None, scores=torch.sigmoid(tokens[:, 1:].float().mean(-1)))
    else:
        out = tower(images, step=None)
    loss = out.pooled.float().square().mean() + out.patches.float().mean()
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in tower.named_parameters() if p.grad is not None}
    return out.pooled.detach().float(), grads


def _differences(results, where: str) -> tuple[float, float]:
    """The largest differences, relative to the largest value, of the output and of any gradient between the eager
    and the graphed run's ``(output, {parameter: gradient})``."""
    (out_e, grads_e), (out_g, grads_g) = results
    if grads_e.keys() != grads_g.keys():
        raise AssertionError(f"{where}: the graphed run's gradients reach other parameters")

    def rel(a, b) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
    return rel(out_g, out_e), max((rel(grads_g[n], g) for n, g in grads_e.items()), default=0.0)


def _setup(model: str, device: str, capture, compile_backend: str | None = None):
    """The student (stochastic depth off, training mode; its blocks compiled in place with ``compile_backend``), its
    device, the loop's autocast dtype (bf16 on CUDA) and an empty BlockGraphs (``capture``: a stand-in for CPU
    tests)."""
    import torch

    from cxrdr.train.compiling import compile_blocks
    from cxrdr.train.device import amp_dtype_for
    from cxrdr.train.models import StudentConfig, build_student
    from cxrdr.train.models.block_graphs import BlockGraphs

    dev = torch.device(device)
    torch.manual_seed(0)
    student = build_student(StudentConfig.from_yaml(model, drop_path_rate=0.0)).to(dev).train()
    if compile_backend:
        compile_blocks(student, compile_backend)
    amp = amp_dtype_for("bf16", dev) if dev.type == "cuda" else None
    graphs = BlockGraphs(**({"capture": capture, "on_device": lambda x: True} if capture is not None else {}))
    return student, dev, amp, graphs


def _agreement(tower, graphs, steps: int, make_inputs, run_step, where: str) -> tuple[float, float]:
    """The largest relative differences (output, gradients) over ``steps`` steps, each on fresh ``make_inputs()``
    run by ``run_step`` eagerly and then through ``graphs`` (captured at the first graphed step, replayed after)."""
    worst_out = worst_grad = 0.0
    for step in range(steps):
        inputs = make_inputs()
        results = []
        for graphed in (False, True):
            tower.block_graphs, graphs.active = (graphs if graphed else None), graphed
            results.append(run_step(inputs))
        out_diff, grad_diff = _differences(results, f"step {step}{where}")
        worst_out, worst_grad = max(worst_out, out_diff), max(worst_grad, grad_diff)
    tower.block_graphs = None
    return worst_out, worst_grad


def compare(model: str = "D", device: str = "cuda", batch_size: int = 32, steps: int = 3, capture=None,
            compile_backend: str | None = None) -> dict:
    """Largest relative differences (graphed vs eager) of the tower's output and its gradients over ``steps`` steps
    of fresh random images, and how many graphs were captured. ``capture``: a stand-in for CPU tests;
    ``compile_backend``: both runs with the blocks compiled (``--compile-scope blocks``) by that backend."""
    import torch

    from cxrdr.train.device import autocast

    student, dev, amp, graphs = _setup(model, device, capture, compile_backend)
    tower = student.image_tower
    size = int(student.config.image_size)
    gen = torch.Generator().manual_seed(1)

    def run_step(images):
        with autocast(dev, amp, cache=False):
            return _tower_step(tower, images)

    worst_out, worst_grad = _agreement(tower, graphs, steps,
                                       lambda: torch.randn(batch_size, 3, size, size, generator=gen).to(dev),
                                       run_step, "")
    return {"model": model, "device": str(dev), "batch_size": batch_size, "steps": steps,
            "compiled_blocks": compile_backend, "graphs_captured": len(graphs), "capture_failed": graphs.failed,
            "max_rel_diff_output": worst_out, "max_rel_diff_grad": worst_grad}


def compare_heads(model: str = "E", device: str = "cuda", batch_size: int = 32, steps: int = 3, capture=None) -> dict:
    """``compare`` for the heads on the patch grid (``--cuda-graphs-heads``: the head convs, then the Patch-IB mask at
    its final K): their outputs (the convs' patches, z, the soft scores) and the gradients of their parameters and of
    the patches they read, graphed vs eager, on random patches."""
    import types

    import torch

    from cxrdr.train.device import autocast
    from cxrdr.train.models.heads import grid_heads

    student, dev, amp, graphs = _setup(model, device, capture)
    if student.head_conv is None and student.mask_head is None:
        raise ValueError(f"{model} has no heads on the patch grid (head convs or a mask) to replay")
    holder = types.SimpleNamespace(block_graphs=None)  # what _agreement switches between eager and graphed
    n, width = student.image_tower.num_patches, student.image_tower.width
    gen = torch.Generator().manual_seed(1)

    def run_step(patches):
        student.zero_grad(set_to_none=True)
        x = patches.clone().requires_grad_(True)
        with autocast(dev, amp, cache=False):
            out, z, soft = grid_heads(student.head_conv, student.mask_head, x, None, holder.block_graphs)
            loss = out.float().square().mean()
            if z is not None:
                loss = loss + (z.float() * torch.linspace(-1, 1, n, device=dev)).sum() + soft.float().square().sum()
        loss.backward()
        grads = {name: q.grad.detach().float().clone() for name, q in student.named_parameters() if q.grad is not None}
        grads["patches"] = x.grad.detach().float().clone()
        outputs = [t.detach().float().flatten() for t in (out, z, soft) if t is not None]
        return torch.cat(outputs), grads

    worst_out, worst_grad = _agreement(holder, graphs, steps,
                                       lambda: torch.randn(batch_size, n, width, generator=gen).to(dev), run_step,
                                       ", heads on the grid")
    return {"model": model, "tower": "heads", "device": str(dev), "batch_size": batch_size, "steps": steps,
            "graphs_captured": graphs.captured("heads"), "capture_failed": graphs.failed,
            "max_rel_diff_output": worst_out, "max_rel_diff_grad": worst_grad}


def compare_losses(model: str = "D", device: str = "cuda", batch_size: int = 32, steps: int = 3, capture=None) -> dict:
    """``compare`` for the loss terms on the global embeddings (``--cuda-graphs-losses``,
    ``losses.objective.GlobalTerms``: CLIP and distillation of B_real and B_syn, Patch-IB's) under the default loss
    config: the terms and the gradients of the embeddings, the mask and the logit scale, graphed vs eager, on random
    unit embeddings (the student's width), a random mask over the student's grid and a random stored teacher's
    embeddings (image, report, caption)."""
    import types

    import torch
    import torch.nn.functional as F

    from cxrdr.train.losses import LossConfig, Objective

    student, dev, _, graphs = _setup(model, device, capture)
    objective = Objective(LossConfig(), student.embed_dim, dev)
    holder = types.SimpleNamespace(block_graphs=None)  # what _agreement switches between eager and graphed
    gen = torch.Generator().manual_seed(1)
    d, n = student.embed_dim, student.image_tower.num_patches
    widths = {"img": d, "txt": d, "syn": d, "masked": d, "t_img": 64, "t_txt": 64, "t_syn": 64}

    def make_inputs():
        x = {k: F.normalize(torch.randn(batch_size, w, generator=gen), dim=-1) for k, w in widths.items()}
        return {**x, "mask": torch.rand(batch_size, n, generator=gen)}

    def run_step(x):
        img, txt, syn, masked, mask = (x[k].to(dev).clone().requires_grad_(True)  # leaves of this run's own
                                       for k in ("img", "txt", "syn", "masked", "mask"))
        scale = torch.tensor(14.3, device=dev, requires_grad=True)
        teachers = {"t": {"img": x["t_img"].to(dev), "txt": x["t_txt"].to(dev), "syn": x["t_syn"].to(dev)}}
        out = types.SimpleNamespace(image_emb=img, text_emb=txt, masked_image_emb=masked, mask=mask)
        lam = objective.cfg.lambda_distill
        objective.graphs = holder.block_graphs
        terms = None if objective.graphs is None else objective._graphed_global_terms(
            out, img, txt, syn, scale, lam, teachers, None, None, None, 0.0)
        if terms is None:
            terms = objective._pair_terms(img, txt, scale, lam, teachers, "txt", None, None, 0.0)
            terms.update(objective._pair_terms(img, syn, scale, lam, teachers, "syn", None, None, 0.0))
            terms.update(objective.patch_ib({"img": img, "txt": txt, "masked_img": masked, "mask": mask},
                                            {"txt": txt, "masked_img": masked}, scale))
        torch.stack(list(terms.values())).sum().backward()
        grads = {"img": img.grad, "txt": txt.grad, "syn": syn.grad, "masked": masked.grad, "mask": mask.grad,
                 "scale": scale.grad.reshape(1)}
        return torch.stack([v.detach().float() for v in terms.values()]), {k: g.float() for k, g in grads.items()}

    worst_out, worst_grad = _agreement(holder, graphs, steps, make_inputs, run_step, ", loss terms")
    return {"model": model, "tower": "losses", "device": str(dev), "batch_size": batch_size, "steps": steps,
            "graphs_captured": graphs.captured("losses"), "capture_failed": graphs.failed,
            "max_rel_diff_output": worst_out, "max_rel_diff_grad": worst_grad}


WORDS = ("no", "acute", "left", "right", "pleural", "effusion", "small", "pneumothorax", "heart", "size", "is",
         "normal", "mild", "cardiomegaly", "lungs", "are", "clear", "basilar", "atelectasis", "the", "with", "stable")


def _texts(n: int, gen) -> list[str]:
    import torch

    lengths = torch.randint(2, 60, (n,), generator=gen).tolist()
    return [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (k,), generator=gen).tolist()) + "." for k in lengths]


def compare_text(model: str = "E", device: str = "cuda", batch_size: int = 64, steps: int = 3, capture=None) -> dict:
    """``compare`` for the packed text tower (``--cuda-graphs-text``): its token states after the student's local
    alignment layer and its pooled vectors, and its gradients, graphed vs eager, dropout off."""
    import torch

    from cxrdr.train.device import autocast

    student, dev, amp, graphs = _setup(model, device, capture)
    tower = student.text_tower
    for module in tower.modules():  # two runs must draw the same: no dropout (its masks would differ)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    token_layer = student.config.local_text_layer  # the layer whose states the local alignment reads (None: last)
    gen = torch.Generator().manual_seed(1)

    def run_step(tok):
        tower.zero_grad(set_to_none=True)
        with autocast(dev, amp, cache=False):
            states, pooled = tower(*(tok[k].to(dev) for k in ("input_ids", "attention_mask")), token_layer,
                                   tok["token_index"].to(dev))
            loss = states.float().square().mean() + pooled.float().mean()
        loss.backward()
        return (states.detach().float(),
                {n: q.grad.detach().float().clone() for n, q in tower.named_parameters() if q.grad is not None})

    worst_out, worst_grad = _agreement(tower, graphs, steps, lambda: student.tokenize(_texts(2 * batch_size, gen)),
                                       run_step, ", text tower")
    return {"model": model, "tower": "text", "device": str(dev), "batch_size": batch_size, "steps": steps,
            "graphs_captured": graphs.captured("text"), "capture_failed": graphs.failed,
            "max_rel_diff_output": worst_out, "max_rel_diff_grad": worst_grad}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="D", help="student config (D, E, tiny-E, ...)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--text", action="store_true", help="the packed text tower's layers (--cuda-graphs-text)")
    parser.add_argument("--heads", action="store_true",
                        help="the heads on the patch grid, head convs and mask (--cuda-graphs-heads)")
    parser.add_argument("--losses", action="store_true",
                        help="the loss terms on the global embeddings (--cuda-graphs-losses)")
    parser.add_argument("--stand-in", action="store_true",
                        help="no CUDA graph: the blocks as they are stand in for the capture (checks the plumbing)")
    parser.add_argument("--compile-blocks", nargs="?", const="inductor", metavar="BACKEND",
                        help="compile every block first (default backend inductor): graphed vs not, both compiled")
    args = parser.parse_args(argv)
    if (args.text or args.heads or args.losses) and args.compile_blocks:
        parser.error("--compile-blocks checks the image tower's blocks: leave out --text, --heads and --losses")
    if args.text + args.heads + args.losses > 1:
        parser.error("one check a command: --text, --heads or --losses")
    capture = (lambda module, *inputs: module) if args.stand_in else None
    if args.text:
        r = compare_text(args.model, args.device, args.batch_size, args.steps, capture)
    elif args.heads:
        r = compare_heads(args.model, args.device, args.batch_size, args.steps, capture)
    elif args.losses:
        r = compare_losses(args.model, args.device, args.batch_size, args.steps, capture)
    else:
        r = compare(args.model, args.device, args.batch_size, args.steps, capture, args.compile_blocks)
    compiled = f" (blocks compiled, {r['compiled_blocks']})" if r.get("compiled_blocks") else ""
    what = " text tower" if args.text else " heads on the patch grid" if args.heads else \
        " loss terms" if args.losses else ""
    print(f"{r['model']}{what}{compiled} on {r['device']}, batch {r['batch_size']}, "
          f"{r['steps']} steps: {r['graphs_captured']} "
          f"graph(s) captured{'; capture failed: ' + r['capture_failed'] if r['capture_failed'] else ''}; largest "
          f"relative difference to the tower without graphs: output {r['max_rel_diff_output']:.2e}, gradients "
          f"{r['max_rel_diff_grad']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
