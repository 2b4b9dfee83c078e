"""A BERT-family encoder run on its real tokens only ("packed"), without the padding.

A batch of texts is padded to its longest (in buckets, ``TextTokenizer``): on the phantom's reports, 65 tokens
on average padded to 128 at batch 256, and its captions 19 padded to 64 (``benchmarks/text_padding.py``), so
about half of the text tower's work was padding. Packed, the linear layers, layer norms and activations run on the
(T, d) real tokens of the batch; only the attention puts them back on the (B, L) grid, where the padding mask
hides the padded keys as before. The real tokens' states equal the padded forward's (to float rounding); the
padded rows come back as zeros.

Why not transformers' own packing: it needs the flash-attention package (``DataCollatorWithFlattening``), and
PyTorch's jagged tensors do not pass through transformers' BERT. The layer's own modules are called here (the
query/key/value projections as one product, ``attention.output``, ``intermediate``, ``output``), so the weights
and the checkpoint names are the model's.

The packing index (the flat positions of the real tokens) must be known where the tokens are made: reading it
from a mask on a GPU is a host sync and gives the step a new shape under torch.compile. ``TextTokenizer`` adds
it to each batch (``token_index``), and the text tower packs where it is given (or where the mask is on the CPU,
where reading it costs nothing).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

_LAYER_PARTS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output",
                "intermediate", "output")


def packing_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(T,) long: the flat positions in the (B, L) grid of the mask's real tokens, row by row."""
    return attention_mask.reshape(-1).nonzero().squeeze(1)


def stack_token_batches(batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Several tokenized batches ``(input_ids, attention_mask, packing index)`` as one: their rows stacked on a grid
    of the longest's length (the shorter right-padded) and the packing index of that grid, made from theirs with
    tensor arithmetic (no read of the values, so no host sync on a GPU). Run packed, the padding costs nothing:
    one text tower call for a step's reports and captions instead of two, half the launches."""
    length = max(ids.shape[1] for ids, _, _ in batches)
    all_ids, all_masks, all_indices, row = [], [], [], 0
    for ids, mask, index in batches:
        rows, width = ids.shape
        all_ids.append(F.pad(ids, (0, length - width)))
        all_masks.append(F.pad(mask, (0, length - width)))
        all_indices.append((index // width + row) * length + index % width)
        row += rows
    return torch.cat(all_ids), torch.cat(all_masks), torch.cat(all_indices)


def supports_packing(model: nn.Module) -> bool:
    """Whether ``model`` is a BERT-layout encoder this module can run packed: embeddings + encoder layers of
    self-attention (absolute positions, no cross-attention, no feed-forward chunking) and the feed-forward."""
    config = getattr(model, "config", None)
    layers = getattr(getattr(model, "encoder", None), "layer", None)
    if config is None or layers is None or not hasattr(model, "embeddings"):
        return False
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return False
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return False
    if getattr(config, "chunk_size_feed_forward", 0):
        return False
    return all(_has(layer, part) for layer in layers for part in _LAYER_PARTS)


def _has(module: nn.Module, dotted: str) -> bool:
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            return False
    return True


def packed_layer(layer: nn.Module, x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor,
                 batch: int, length: int) -> torch.Tensor:
    """One encoder layer on the packed tokens ``x`` (T, d) -> (T, d). ``index``: their positions in the
    (batch, length) grid; ``keep``: (batch, 1, 1, length) bool, which keys may be attended to."""
    att = layer.attention.self
    heads, head_dim = att.num_attention_heads, att.attention_head_size
    # one product for query, key and value: one kernel instead of three
    weight = torch.cat([att.query.weight, att.key.weight, att.value.weight])
    bias = torch.cat([att.query.bias, att.key.bias, att.value.bias])
    qkv = F.linear(x, weight, bias)
    grid = qkv.new_zeros(batch * length, qkv.shape[-1]).index_copy(0, index, qkv)
    q, k, v = grid.view(batch, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=att.scaling,
                                             dropout_p=att.dropout.p if layer.training else 0.0)
    context = context.transpose(1, 2).reshape(batch * length, heads * head_dim).index_select(0, index)
    attended = layer.attention.output(context, x)
    return layer.output(layer.intermediate(attended), attended)


def encode_packed(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor,
                  token_layer: int | None = None, layer_fn=packed_layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden states (B, L, d), the states after ``token_layer`` layers (B, L, d); 0: the embeddings,
    None: the last) of a BERT-layout ``model`` run on the real tokens only; padded rows are zeros.
    ``layer_fn``: ``packed_layer`` or its torch.compile (``compiling.compile_blocks``)."""
    batch, length = input_ids.shape
    embedded = model.embeddings(input_ids=input_ids)
    width = embedded.shape[-1]

    def to_grid(packed: torch.Tensor) -> torch.Tensor:
        return packed.new_zeros(batch * length, width).index_copy(0, index, packed).view(batch, length, width)

    x = embedded.reshape(batch * length, width).index_select(0, index)
    keep = attention_mask.bool()[:, None, None, :]
    layers = model.encoder.layer
    chosen = embedded if token_layer == 0 else None
    # transformers >= 4.52 flags each layer, older versions the encoder
    checkpointed = getattr(model.encoder, "gradient_checkpointing", False)
    for depth, layer in enumerate(layers, start=1):
        if (checkpointed or getattr(layer, "gradient_checkpointing", False)) and layer.training \
                and torch.is_grad_enabled():
            x = checkpoint(layer_fn, layer, x, index, keep, batch, length, use_reentrant=False)
        else:
            x = layer_fn(layer, x, index, keep, batch, length)
        if token_layer == depth and depth < len(layers):
            chosen = to_grid(x)
    last = to_grid(x)
    return last, (last if chosen is None else chosen)
