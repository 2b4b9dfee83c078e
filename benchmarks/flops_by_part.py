"""FLOPs of one real training step (forward + backward), split by the student's parts, per variant.

    python benchmarks/flops_by_part.py A D E                 # full size: ViT-S/16 224 + MiniLM, batch 8, CPU
    python benchmarks/flops_by_part.py A E --batch-size 16 --mode plain

What bounds E / A on a GPU (issue 35 asks >= 1.5x A's training img/s): at equal kernel efficiency the ratio is A's
FLOPs over E's. E drops 60 % of the image tokens, but the text tower, D's heads (the ConvNeXt head convs and the
mask on the whole grid, the local alignment) and the losses stay; this prints how much each part is of a step, and
the ceiling the FLOPs set. Counted with ``cxrdr.train.evaluation.efficiency.flop_counter`` (matrix products,
convolutions and attention, the CPU's attention kernel included) on ``Trainer._micro_step`` of the real loop, its
batch a phantom build's (the texts' real token counts: packed texts run their real tokens only). The parts that pair
every text with every image (the local alignment's pair similarity, the losses' similarity matrices) grow with the
batch per image: at the GPU's batch 256 they are a few GFLOPs more (the suite counts D's step at 37.7 GFLOPs an
image there, 36.8 here at batch 8).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

# part -> the student's submodules (dotted names under the student) whose FLOPs it holds; the first match wins
PARTS = (("image blocks", ("image_tower.trunk.blocks",)), ("patch embedding", ("image_tower.trunk.patch_embed",)),
         ("text tower", ("text_tower",)), ("head convs + mask", ("head_conv", "mask_head")),
         ("local alignment", ("local_align",)), ("projections", ("image_proj", "text_proj", "teacher_heads")))


def forward_flops_by_part(trainer, batch) -> dict[str, float]:
    """FLOPs of the forward of the trainer's step (``Task.forward``: the student and the objective) on ``batch``, by
    ``PARTS``, the student's other work ("student, rest") and what runs outside the student ("losses": the
    objective's similarity matrices and distillation). Forward only: torch's counter files a backward under the
    modules whose hooks fire then, which leaves ModuleList children and wrapped towers misattributed."""
    from cxrdr.train.evaluation.efficiency import flop_counter

    counter = flop_counter()
    with counter:
        trainer.task.forward(batch, trainer.step)
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = min((n for n in counts if n.endswith(".student") or n == "student"), key=len)  # the student module

    def flops_of(path: str) -> float:
        """A submodule's FLOPs, or its numbered children's (a ModuleList is never called itself)."""
        name = f"{root}.{path}"
        if name in counts:
            return counts[name]
        return sum(v for k, v in counts.items() if k.startswith(name + ".") and k[len(name) + 1:].isdigit())

    out = {part: sum(flops_of(p) for p in paths) for part, paths in PARTS}
    out["student, rest"] = counts[root] - sum(out.values())
    out["losses"] = counts["Global"] - counts[root]
    return out


def step_flops(trainer, batch) -> float:
    """FLOPs of one forward + backward of the trainer's step on ``batch`` (the gradients cleared after)."""
    from cxrdr.train.evaluation.efficiency import flop_counter

    counter = flop_counter()
    with counter:
        trainer._micro_step(batch, sync=True, log_balance=False)
    trainer.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def main(argv=None) -> int:
    import torch

    import train_step

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+", help="A-E of configs/models/default.yaml")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--mode", choices=("plain", "reinforced"), default=None)
    parser.add_argument("--shards", help="shard folder (default: a 224-px phantom build in a temp folder)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    tmp = tempfile.TemporaryDirectory(prefix="cxrdr-flops-")
    shards = Path(args.shards) if args.shards else train_step.build_phantom(Path(tmp.name) / "shards", 32, 224)
    table, totals = {}, {}
    for i, variant in enumerate(args.variants):
        base = {**train_step.bench_config(shards, args.batch_size, 0, "cpu"), "out": f"{tmp.name}/run{i}",
                **({"mode": args.mode} if args.mode else {})}
        trainer, batches = train_step.make_trainer(base, model=variant)
        trainer.train_step(batches, log_balance=False)  # warm-up (the loader, lazy buffers)
        batch = next(batches)
        per_image = 1e9 * args.batch_size
        table[variant] = {k: v / per_image for k, v in forward_flops_by_part(trainer, batch).items()}
        totals[variant] = step_flops(trainer, batch) / per_image
        batches.close()
    print(f"GFLOPs per image of the training step's forward by part, batch {args.batch_size}, "
          f"mode {args.mode or 'reinforced'} (share of the variant's forward):")
    print(f"{'part':<20}" + "".join(f"{v:>16}" for v in table))
    for part in table[args.variants[0]]:
        print(f"{part:<20}" + "".join(f"{t[part]:>8.2f} ({100 * t[part] / sum(t.values()):3.0f} %)"
                                      for t in table.values()))
    print(f"{'forward':<20}" + "".join(f"{sum(t.values()):>16.2f}" for t in table.values()))
    print(f"{'forward + backward':<20}" + "".join(f"{totals[v]:>16.2f}" for v in table))
    if "A" in totals:
        for variant in (v for v in totals if v != "A"):
            print(f"{variant} / A img/s at equal kernel efficiency (A's step FLOPs over {variant}'s): "
                  f"{totals['A'] / totals[variant]:.2f}x")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
