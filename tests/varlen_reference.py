"""What FlashAttention's variable-length kernel computes, on the CPU: the packed text tower's tests stand it in where
the kernel (CUDA only) would run."""
from __future__ import annotations

import torch


def reference_varlen(q, k, v, offsets, max_length, dropout_p, scale):
    """``packed_text.flash_varlen``'s result, one sequence at a time (its dropout drawn by SDPA's, not the kernel's);
    every sequence within the bound."""
    assert int((offsets[1:] - offsets[:-1]).max()) <= max_length
    out = torch.empty_like(q)
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        seq = [t[start:end].transpose(0, 1) for t in (q, k, v)]  # (H, n, Dh)
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(*seq, scale=scale,
                                                                          dropout_p=dropout_p).transpose(0, 1)
    return out


def use_reference_varlen(monkeypatch) -> None:
    """The packed layers attend by sequence offsets on the CPU, through ``reference_varlen``."""
    import cxrdr.train.models.packed_text as packed_text

    monkeypatch.setattr(packed_text, "flash_varlen_applies", lambda x, head_dim: True)
    monkeypatch.setattr(packed_text, "flash_varlen", reference_varlen)
