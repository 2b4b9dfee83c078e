"""The text tower's attention on the padded grid against FlashAttention's variable-length kernel (packed_text).

A training step's reports and one caption each (phantom studies, the build's captioners) go through the
student's text tower stacked on one grid, as ``Student._texts`` runs them; the tower runs packed, and its
attention either on the (B, L) grid with the padding mask, or on the packed tokens by their row offsets
(``packed_text.flash_varlen``, a GPU at sm80+ in half precision). Prints, for each: forward + backward
milliseconds (best of ``--repeats`` rounds after a warm-up) under the loop's autocast, and the largest difference
of the last states between the two (eval mode: no dropout), which should be bf16 rounding.

    python benchmarks/text_attention.py --device cuda          # MiniLM, batch 256, context 128, bf16
    python benchmarks/text_attention.py --batch-size 16        # the CPU: the grid only (no FlashAttention there)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # sibling benchmarks and the repository's packages

from text_padding import batch_texts  # noqa: E402 - a sibling benchmark


def measure(text_tower: str = "minilm", context: int = 128, batch_size: int = 256, seed: int = 0,
            device: str = "cuda", repeats: int = 5) -> dict:
    import torch

    import cxrdr.train.models.packed_text as packed_text
    from cxrdr.train.device import amp_dtype_for, autocast
    from cxrdr.train.models.text_towers import build_text_tower, build_tokenizer

    dev = torch.device(device)
    tokenizer = build_tokenizer(text_tower, context)
    tower = build_text_tower(text_tower, context).to(dev)
    batches = [tokenizer(texts) for texts in batch_texts(batch_size, seed, 5).values()]
    ids, mask, index = (t.to(dev) for t in packed_text.stack_token_batches(
        [(b["input_ids"], b["attention_mask"], b["token_index"]) for b in batches]))
    amp = amp_dtype_for("bf16", dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    applies = packed_text.flash_varlen_applies

    def step(varlen: bool) -> torch.Tensor:
        packed_text.flash_varlen_applies = applies if varlen else (lambda x, head_dim: False)
        try:
            with autocast(dev, amp):
                states, pooled = tower(ids, mask, None, index)
            if torch.is_grad_enabled():
                (states.float().square().mean() + pooled.float().square().mean()).backward()
            return states
        finally:
            packed_text.flash_varlen_applies = applies

    head_dim = tower.model.config.hidden_size // tower.model.config.num_attention_heads
    with autocast(dev, amp):
        usable = applies(torch.empty(1, device=dev), head_dim)
    ways = {"grid": False, **({"varlen": True} if usable else {})}
    out = {"device": str(dev), "rows": int(ids.shape[0]), "grid_length": int(ids.shape[1]),
           "real_tokens": int(index.numel()), "amp": str(amp), "ms": {}}
    tower.train()
    for name, varlen in ways.items():
        best = float("inf")
        for _ in range(repeats + 1):  # the first round warms up
            sync()
            start = time.perf_counter()
            step(varlen)
            sync()
            best = min(best, time.perf_counter() - start)
            tower.zero_grad(set_to_none=True)
        out["ms"][name] = 1000 * best
    if usable:
        tower.eval()
        with torch.no_grad():
            real = mask.bool()
            grid, varlen = step(False)[real].float(), step(True)[real].float()
        out["max_abs_diff"] = float((grid - varlen).abs().max())
        out["state_abs_max"] = float(grid.abs().max())
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text-tower", default="minilm")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    m = measure(args.text_tower, args.context, args.batch_size, device=args.device, repeats=args.repeats)
    print(f"{m['rows']} texts (reports and captions) on a grid of {m['grid_length']}, {m['real_tokens']} real tokens "
          f"({m['real_tokens'] / (m['rows'] * m['grid_length']):.0%} of the grid); {m['device']}, autocast {m['amp']}")
    for name, ms in m["ms"].items():
        print(f"  attention on the {name:6s}: {ms:7.2f} ms forward + backward (best of {args.repeats})")
    if "varlen" in m["ms"]:
        print(f"  grid / varlen: {m['ms']['grid'] / m['ms']['varlen']:.2f}x; largest state difference "
              f"{m['max_abs_diff']:.3g} (states up to {m['state_abs_max']:.3g})")
    else:
        print("  FlashAttention's variable-length kernel does not apply here (it needs a CUDA GPU, sm80+, half "
              "precision): the grid only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
