"""What the text tower spends on padding, and what running it packed saves (cxrdr/train/models/packed_text.py).

Takes a training batch's texts as the loop sees them: the reports of phantom studies and one synthetic caption
each (the build's captioners), tokenized by the student's tokenizer (padded to the batch's longest, in buckets).
For each text kind it prints the real and the padded token counts, then the text tower's forward + backward FLOPs
per sample (``efficiency.gflops``, counted on one batch) padded and packed, and, with ``--time``, their wall
time on the device.

    python benchmarks/text_padding.py                          # MiniLM, batch 256, context 128 (the GPU students)
    python benchmarks/text_padding.py --time --batch-size 64   # also the seconds, on CPU

The FLOPs are the ones the loop's MFU counts: compare them with the suite's training GFLOPs per image
(benchmarks/results/<device>.md, section 3).
"""
from __future__ import annotations

import argparse
import random
import time


def batch_texts(n: int, seed: int, n_captions: int) -> dict[str, list[str]]:
    """The reports of phantom studies 0..n-1 of ``seed`` and one of each study's captions, drawn as the loader does."""
    from cxrdr.reinforce.captions import make_captions
    from cxrdr.reinforce.phantom.source import phantom_record

    rng = random.Random(seed)
    records = [phantom_record(seed, i) for i in range(n)]
    return {"report": [r.report for r in records],
            "caption": [rng.choice(make_captions(r, n_captions, seed)).text for r in records]}


def forward_backward(tower, tok: dict, pack: bool, token_layer: int | None):
    tower.pack = pack
    states, pooled = tower(tok["input_ids"], tok["attention_mask"], token_layer, tok["token_index"])
    (states.float().square().mean() + pooled.float().square().mean()).backward()


def measure(text_tower: str = "minilm", context: int = 128, batch_size: int = 256, seed: int = 0,
            n_captions: int = 5, token_layer: int | None = 0, device: str = "cpu", timed: bool = False,
            repeats: int = 3) -> list[dict]:
    import torch

    from cxrdr.train.evaluation.efficiency import gflops
    from cxrdr.train.models.text_towers import build_text_tower, build_tokenizer

    tokenizer = build_tokenizer(text_tower, context)
    tower = build_text_tower(text_tower, context).to(device).train()
    rows = []
    for kind, texts in batch_texts(batch_size, seed, n_captions).items():
        tok = {k: v.to(device) for k, v in tokenizer(texts).items()}
        row = {"texts": kind, "batch": batch_size, "padded_length": tok["input_ids"].shape[1],
               "real_tokens_per_text": tok["token_index"].numel() / batch_size}
        for pack in (False, True):
            name = "packed" if pack else "padded"
            row[f"{name}_gflops_per_text"] = gflops(lambda: forward_backward(tower, tok, pack, token_layer),
                                                    grad=True) / batch_size
            if timed:
                sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
                forward_backward(tower, tok, pack, token_layer)  # warm-up
                sync()
                start = time.perf_counter()
                for _ in range(repeats):
                    forward_backward(tower, tok, pack, token_layer)
                sync()
                row[f"{name}_ms"] = 1000 * (time.perf_counter() - start) / repeats
        tower.zero_grad(set_to_none=True)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text-tower", default="minilm")
    parser.add_argument("--context", type=int, default=128, help="context length (configs/models/default.yaml)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="phantom seed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--time", action="store_true", help="also time forward + backward (mean of 3 after one)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    rows = measure(args.text_tower, args.context, args.batch_size, args.seed, device=args.device, timed=args.time)
    print(f"text tower {args.text_tower}, context {args.context}, batch {args.batch_size} phantom studies "
          f"(seed {args.seed}), forward + backward")
    print(f"{'texts':<8} {'padded to':>9} {'real tok':>8} {'GFLOPs padded':>13} {'GFLOPs packed':>13} {'saved':>6}"
          + (f" {'ms padded':>10} {'ms packed':>10}" if args.time else ""))
    for r in rows:
        saved = 1 - r["packed_gflops_per_text"] / r["padded_gflops_per_text"]
        print(f"{r['texts']:<8} {r['padded_length']:9d} {r['real_tokens_per_text']:8.1f} "
              f"{r['padded_gflops_per_text']:13.2f} {r['packed_gflops_per_text']:13.2f} {100 * saved:5.0f}%"
              + (f" {r['padded_ms']:10.0f} {r['packed_ms']:10.0f}" if args.time else ""))
    padded = sum(r["padded_gflops_per_text"] for r in rows)
    packed = sum(r["packed_gflops_per_text"] for r in rows)
    print(f"per sample (report + caption): {padded:.2f} -> {packed:.2f} GFLOPs ({padded - packed:.2f} saved)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
