"""The cosine local head's pair similarity (the token-region term's B_text x B_image x words cosines), both forms.

``heads.CosineLocalAlign.pair_similarity`` computes cos(v~_{j<-i,k}, t_{i,k}) for every text i, word k and image
j in one of two ways: fused attention over each image (``pooled_cosine_by_sdpa``) or the scores and each image's
Gram matrix (``pooled_cosine_by_gram``); it takes the Gram form where that counts fewer forward FLOPs
(``heads.gram_form_is_cheaper``). This prints, per shape, each form's forward + backward time (median of
``--rounds``), FLOPs (``efficiency.gflops``), memory traffic (``traffic_mb``), their largest difference and which
form the head takes. Beside the Gram form (its backward written out, ``models.gram_cosine``) it times the same
expression under autograd's own backward (``gram_by_autograd``, what the head ran before), whose traffic the
written-out backward was made to cut: at the GPU's shape both are memory-bound, so on a GPU MB moved, not FLOPs,
says which is faster, and that is a figure any machine can count.

    python benchmarks/pair_similarity.py                         # CPU: the CPU students' and ViT-S/16's shapes
    python benchmarks/pair_similarity.py --device cuda --batch 256 --amp   # the GPU step's shape, bf16 autocast

A shape is batch x words x patches x dims: the GPU default D draws 8 words a text (``loss.local_tokens``) over
ViT-S/16's 196 patches in 512 dims; the CPU students' 144 patches are 64-dim.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

FORMS = ("fused", "gram", "gram_autograd")


def gram_by_autograd(words, patches, values, temperature: float, patch_mask=None):
    """The Gram form's expression as the head computed it before its backward was written out: autograd
    differentiates it (values and padded patches left out: the head pools neither in this form)."""
    import torch

    if values is not None or patch_mask is not None:
        raise ValueError("gram_by_autograd times the head's own case only: no values, no padded patches")
    (b_txt, length, width), b_img = words.shape, patches.shape[0]
    with torch.autocast(words.device.type, enabled=False):
        flat, keys = words.reshape(b_txt * length, width).float(), patches.float()
        scores = flat @ keys.transpose(1, 2)  # (B_image, Q, N), transposed in memory (the matmul folds)
        attn = (scores / temperature).softmax(-1)
        norm_sq = ((attn @ (keys @ keys.transpose(1, 2))) * attn).sum(-1)
        cosine = (attn * scores).sum(-1) / norm_sq.clamp_min(1e-24).sqrt()
    return cosine.reshape(b_img, b_txt, length).transpose(0, 1)


def traffic_mb(run) -> float:
    """MB that ``run()`` reads and writes through aten operators: each operator's tensor inputs and outputs once
    (an expanded input counts its storage), views and aliases left out. A lower bound on a GPU's memory traffic
    (a matrix product re-reads its tiles) that ranks memory-bound code as its kernels' time would."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def nbytes(t) -> int:
        return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func._schema.name != "aten::detach":
                tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
                Count.total += sum(nbytes(t) for t in tensors)
            return out

    with Count():
        run()
    return Count.total / 2 ** 20


def time_form(form, words, patches, temperature: float, rounds: int, sync, amp: bool) -> tuple[float, object]:
    """Median seconds of forward + backward of ``form`` and its (last) output."""
    import torch

    times, out = [], None
    for _ in range(rounds + 1):  # the first is a warm-up
        w, p = words.detach().requires_grad_(), patches.detach().requires_grad_()
        sync()
        start = time.perf_counter()
        with torch.autocast(w.device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            out = form(w, p, None, temperature)
        out.float().sum().backward()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), out.detach().float()


def grouped_gram(group: int):
    """The Gram form over each text's group of ``group`` images only (``loss.local_group_size``)."""
    from cxrdr.train.models.heads import grouped_pair_similarity, pooled_cosine_by_gram

    def form(words, patches, values, temperature: float):
        return grouped_pair_similarity(lambda w, p: pooled_cosine_by_gram(w, p, values, temperature), words, patches,
                                       group)
    return form


def measure(batch: int, words_per_text: int, shapes: list[tuple[int, int]], rounds: int = 5, device: str = "cpu",
            amp: bool = False, group: int = 0) -> list[dict]:
    """One row per (patches, dims) shape: each form's median ms and GFLOPs (forward + backward) and the largest
    difference of their outputs; ``group``: also the Gram form in groups of that many images ("grouped", its
    difference taken with the whole batch's cosines of the same pairs)."""
    import torch
    import torch.nn.functional as F

    from cxrdr.train.evaluation.efficiency import gflops
    from cxrdr.train.losses.local import group_images
    from cxrdr.train.models.heads import gram_form_is_cheaper, pooled_cosine_by_gram, pooled_cosine_by_sdpa

    forms = dict(zip(FORMS, (pooled_cosine_by_sdpa, pooled_cosine_by_gram, gram_by_autograd)))
    if group:
        forms["grouped"] = grouped_gram(group)

    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n, d in shapes:
        words = F.normalize(torch.randn(batch, words_per_text, d, generator=g), dim=-1).to(device)
        patches = F.normalize(torch.randn(batch, n, d, generator=g), dim=-1).to(device)
        row = {"patches": n, "dims": d, "head_takes": "gram" if gram_form_is_cheaper(batch * words_per_text, n, d)
               else "fused"}
        outs = []
        for name, form in forms.items():
            seconds, out = time_form(form, words, patches, 0.1, rounds, sync, amp)
            w, p = words.detach().requires_grad_(), patches.detach().requires_grad_()
            row[f"{name}_ms"] = 1000 * seconds
            row[f"{name}_gflops"] = gflops(lambda: form(w, p, None, 0.1).sum().backward(), grad=True)
            w, p = words.detach().requires_grad_(), patches.detach().requires_grad_()
            row[f"{name}_mb"] = traffic_mb(lambda: form(w, p, None, 0.1).sum().backward())
            outs.append(out)
        if group:  # the grouped cosines against the whole batch's of the same (text, image) pairs
            grouped, whole = outs.pop(), outs[1]
            columns = group_images(batch, group)
            real = columns < batch
            picked = whole.gather(1, columns.clamp(max=batch - 1).unsqueeze(-1).expand(-1, -1, whole.shape[-1]))
            row["grouped_max_diff"] = (grouped - picked)[real].abs().max().item()
        row["max_diff"] = max((o - outs[0]).abs().max().item() for o in outs[1:])
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32, help="texts = images in the batch")
    parser.add_argument("--words", type=int, default=8, help="words drawn a text (loss.local_tokens)")
    parser.add_argument("--shapes", default="144x64,196x512", help="patches x dims, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast, as the GPU loop runs")
    parser.add_argument("--group", type=int, default=0,
                        help="also the Gram form over each text's group of this many images (loss.local_group_size)")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    print(f"{args.batch} texts x {args.words} words against {args.batch} images on {args.device}"
          f"{', bf16 autocast' if args.amp else ''}; forward + backward, median of {args.rounds}")
    print("| patches x dims | form | ms | GFLOPs | MB moved | the head takes |")
    print("|---|---|---|---|---|---|")
    names = {"fused": "fused attention", "gram": "Gram", "gram_autograd": "Gram, autograd's backward (before)",
             "grouped": f"Gram, groups of {args.group} images"}
    for r in measure(args.batch, args.words, shapes, args.rounds, args.device, args.amp, args.group):
        for form in (*FORMS, "grouped") if args.group else FORMS:
            print(f"| {r['patches']} x {r['dims']} | {names[form]} | {r[f'{form}_ms']:.1f} | "
                  f"{r[f'{form}_gflops']:.2f} | {r[f'{form}_mb']:,.0f} | {r['head_takes']} |")
        print(f"(largest difference of the forms' outputs {r['max_diff']:.1e}"
              + (f"; the groups' against the whole batch's same pairs {r['grouped_max_diff']:.1e})" if args.group
                 else ")"))


if __name__ == "__main__":
    main()
