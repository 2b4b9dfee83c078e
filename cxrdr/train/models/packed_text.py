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

On a GPU with FlashAttention (sm80+, half precision, eager) the attention runs packed too: FlashAttention's
variable-length kernel takes each text's tokens as one sequence (``cu_seqlens``: the row offsets, from the mask
with tensor arithmetic). On the grid, the mask-capable kernel computed every (B, L, L) score, padding included:
a step's reports and captions share one grid of the longest report's bucket (reports ~65 tokens and captions ~19
on a 128 grid on the phantom), so ~7x the scores the texts have, and the H100's A step spent ~8 ms of its ~95 ms
there (``benchmarks/results/profiles/nvidia-h100-0ef6026-A.txt``: ``fmha_cutlass`` forward and backward).
Elsewhere (the CPU, fp32, a compiled layer) the grid runs, as before.

With ``--cuda-graphs-text`` the packed layers on FlashAttention also run as CUDA graphs (``models/block_graphs.py``):
a graph is fixed to its input's shape, and a batch's count of real tokens changes every step, so the packed tokens
are padded to a bucket (``pack_bucket``: a power of two, at most a 16th of them), the padding rows forming one more
sequence of their own that attends only among itself, and every sequence is bounded by one length
(``graph_max_length``). The real tokens' states are the unpadded run's (to float rounding; the padding rows are
dropped after the layers, and their gradient is zero).
"""
from __future__ import annotations

import warnings

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


_flash_varlen_failed = False  # set once FlashAttention's variable-length call raised: the grid from then on


def sequence_offsets(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B + 1,) int32: where each row's real tokens start in the packed order, then their total (``cu_seqlens``)."""
    return F.pad(attention_mask.sum(1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))


def flash_varlen_applies(x: torch.Tensor, head_dim: int) -> bool:
    """Whether the layers' attention can run on ``x``'s device with FlashAttention's variable-length kernel: CUDA
    at sm80 or later, in half precision (the autocast dtype, or ``x``'s own), a head size it takes, eager."""
    if _flash_varlen_failed or not x.is_cuda or torch.compiler.is_compiling():
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    return (dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, max_length: int,
                 dropout_p: float, scale: float) -> torch.Tensor:
    """(T, H, Dh) each -> (T, H, Dh): each sequence's tokens (``offsets``) attending among themselves. The aten op
    under PyTorch's jagged-tensor attention and ``torch.nn.attention.varlen`` (which has no dropout, and the text
    towers train with theirs); ``max_length`` bounds the sequences (the grid's length: no read of the lengths)."""
    return torch.ops.aten._flash_attention_forward(q, k, v, offsets, offsets, max_length, max_length, dropout_p,
                                                   False, False, scale=scale)[0]


def packed_layer(layer: nn.Module, x: torch.Tensor, index: torch.Tensor, keep: torch.Tensor,
                 batch: int, length: int, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """One encoder layer on the packed tokens ``x`` (T, d) -> (T, d). ``index``: their positions in the
    (batch, length) grid; ``keep``: (batch, 1, 1, length) bool, which keys may be attended to; ``offsets``
    (``sequence_offsets``, where ``flash_varlen_applies``): attend on the packed tokens instead of the grid."""
    global _flash_varlen_failed
    att = layer.attention.self
    heads, head_dim = att.num_attention_heads, att.attention_head_size
    dropout_p = att.dropout.p if layer.training else 0.0
    # one product for query, key and value: one kernel instead of three
    weight = torch.cat([att.query.weight, att.key.weight, att.value.weight])
    bias = torch.cat([att.query.bias, att.key.bias, att.value.bias])
    qkv = F.linear(x, weight, bias)
    context = None
    if offsets is not None and not _flash_varlen_failed:
        q, k, v = qkv.view(-1, 3, heads, head_dim).transpose(0, 1).contiguous().unbind(0)  # one copy
        try:
            context = flash_varlen(q, k, v, offsets, length, dropout_p, att.scaling).reshape(-1, heads * head_dim)
        except RuntimeError as exc:  # an argument the kernel refuses: checked on the host, so nothing ran
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise  # a CUDA graph's capture failed (block_graphs runs these layers eagerly), not the kernel
            _flash_varlen_failed = True
            warnings.warn(f"FlashAttention's variable-length kernel failed ({exc}); the text towers attend on the "
                          "padded grid from now on", RuntimeWarning, stacklevel=2)
    if context is None:
        grid = qkv.new_zeros(batch * length, qkv.shape[-1]).index_copy(0, index, qkv)
        q, k, v = grid.view(batch, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=att.scaling, dropout_p=dropout_p)
        context = context.transpose(1, 2).reshape(batch * length, heads * head_dim).index_select(0, index)
    attended = layer.attention.output(context, x)
    return layer.output(layer.intermediate(attended), attended)


def pack_bucket(tokens: int) -> int:
    """Rows the packed tokens are padded to a multiple of under CUDA graphs (``padded_rows``): the largest power of
    two at most a 16th of ``tokens`` (at least 64), so padding adds at most ~6 % and a batch of ~22k tokens (batch
    256 of reports and captions on the phantom) meets two or three sizes."""
    return max(64, 1 << max(0, (int(tokens) // 16).bit_length() - 1))


def padded_rows(tokens: int) -> int:
    """The packed tokens' row count under CUDA graphs: the next multiple of their ``pack_bucket`` above ``tokens``,
    so the padding's own sequence always has a row (at most a bucket's: FlashAttention never sees an empty one)."""
    bucket = pack_bucket(tokens)
    return (int(tokens) // bucket + 1) * bucket


def graph_max_length(model: nn.Module, bucket: int) -> int:
    """The sequence length bound FlashAttention gets under CUDA graphs: one for every batch (a graph holds it), above
    any text (the model's position limit) and the padding's own sequence (below a bucket)."""
    return max(int(getattr(model.config, "max_position_embeddings", 512)), int(bucket))


class PackedLayers(nn.Module):
    """Encoder layers on packed tokens attending by ``offsets`` on FlashAttention, the module a CUDA graph captures:
    (x (T, d), offsets (S + 1,)) -> (T, d)."""

    def __init__(self, layers, max_length: int):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.max_length = int(max_length)

    def __len__(self) -> int:
        return len(self.layers)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:  # the grid's index and mask stay unused on FlashAttention
            x = packed_layer(layer, x, None, None, 0, self.max_length, offsets)
        return x


def encode_packed(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor,
                  token_layer: int | None = None, layer_fn=packed_layer,
                  graphs=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden states (B, L, d), the states after ``token_layer`` layers (B, L, d); 0: the embeddings,
    None: the last) of a BERT-layout ``model`` run on the real tokens only; padded rows are zeros.
    ``layer_fn``: ``packed_layer`` or its torch.compile (``compiling.compile_blocks``); ``graphs``: a
    ``BlockGraphs`` (``--cuda-graphs-text``), used where the layers run packed on FlashAttention."""
    batch, length = input_ids.shape
    embedded = model.embeddings(input_ids=input_ids)
    width = embedded.shape[-1]

    def to_grid(packed: torch.Tensor) -> torch.Tensor:
        return packed.new_zeros(batch * length, width).index_copy(0, index, packed).view(batch, length, width)

    x = embedded.reshape(batch * length, width).index_select(0, index)
    keep = attention_mask.bool()[:, None, None, :]
    layers = model.encoder.layer
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    # a compiled layer (compile_blocks) keeps the grid, whose graph the compile tests check
    offsets = sequence_offsets(attention_mask) if layer_fn is packed_layer and flash_varlen_applies(x, head_dim) \
        else None
    chosen = embedded if token_layer == 0 else None
    # transformers >= 4.52 flags each layer, older versions the encoder
    checkpointed = getattr(model.encoder, "gradient_checkpointing", False)
    if graphs is not None and offsets is not None and graphs.applies(model, x, "text") and not checkpointed \
            and not any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        return _graphed_layers(model, graphs, x, offsets, token_layer, to_grid, chosen)
    for depth, layer in enumerate(layers, start=1):
        if (checkpointed or getattr(layer, "gradient_checkpointing", False)) and layer.training \
                and torch.is_grad_enabled():
            x = checkpoint(layer_fn, layer, x, index, keep, batch, length, offsets, use_reentrant=False)
        else:
            x = layer_fn(layer, x, index, keep, batch, length, offsets)
        if token_layer == depth and depth < len(layers):
            chosen = to_grid(x)
    last = to_grid(x)
    return last, (last if chosen is None else chosen)


def _graphed_layers(model: nn.Module, graphs, x: torch.Tensor, offsets: torch.Tensor, token_layer: int | None,
                    to_grid, chosen: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``encode_packed``'s layers as CUDA graphs: the tokens padded to their bucket (module docstring), one graph
    per run of layers (two where ``token_layer`` splits them) and bucket."""
    layers = model.encoder.layer
    real = x.shape[0]  # a shape: known on the host without reading the tensor
    padded = padded_rows(real)
    max_length = graph_max_length(model, pack_bucket(real))
    x = F.pad(x, (0, 0, 0, padded - real))
    offsets = F.pad(offsets, (0, 1), value=padded)  # the padding rows: one more sequence
    stops = [token_layer] if token_layer is not None and 0 < token_layer < len(layers) else []
    start = 0
    for stop in [*stops, len(layers)]:
        run = PackedLayers(layers[start:stop], max_length)  # the graph's module, or run eagerly where none may run
        x = graphs.run_module("text", (start, stop, max_length), lambda run=run: run, (x, offsets), run)
        if stop == token_layer and stop < len(layers):
            chosen = to_grid(x[:real])
        start = stop
    last = to_grid(x[:real])
    return last, (last if chosen is None else chosen)
