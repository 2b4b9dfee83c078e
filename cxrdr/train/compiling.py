"""``--compile``: torch.compile of the student, as one graph or block by block (``--compile-scope``).

``model``: the whole forward (both towers, the Patch-IB heads, local alignment) is one graph. It fuses the most, but
inductor compiles the forward and backward of a ViT-S + MiniLM student for minutes (on an H200 three such graphs did
not finish in 350 s), and the graph may see no step number, so it runs only once the k-ratio and keep-rate schedules
are over (``Trainer._compiled_now``) and every text is padded to the context length (one shape); packed texts
(``models/packed_text.py``) run on their real tokens in it all the same, their count a dynamic size
(``Task._packing``).

``blocks``: each transformer block of both towers is compiled on its own, PyTorch's "regional compilation". The
blocks of a tower share their code, so torch.compile reuses one compiled block for all of them: compiling costs
about one block's worth per tower and input shape (E's blocks after the drop see a second length). Texts run
packed (``models/packed_text.py``: their real tokens only, a count that changes every batch): their layers share
one ``packed_layer`` compiled for dynamic shapes; padded texts (``--no-pack-text``, evaluation on a GPU) run the
compiled layers at their length buckets. The heads, losses and the glue between blocks stay eager and the step
number reaches the model as in eager mode.
"""
from __future__ import annotations

import torch
import torch.nn as nn

SCOPES = ("model", "blocks")


def repeated_blocks(student: nn.Module, text: bool = True) -> list[nn.Module]:
    """The repeated transformer blocks of the student's towers: a timm ViT's ``blocks`` and (``text``) a BERT-family
    text tower's encoder layers (a CNN or hybrid image tower has none: its stages differ from each other)."""
    blocks: list[nn.Module] = []
    trunk = getattr(student.image_tower, "trunk", None)
    if hasattr(student.image_tower, "depth") and hasattr(trunk, "blocks") and hasattr(trunk, "patch_embed") \
            and hasattr(trunk, "_pos_embed"):
        blocks += list(trunk.blocks)
    encoder = getattr(getattr(student.text_tower, "model", None), "encoder", None)
    if text and encoder is not None and hasattr(encoder, "layer"):
        blocks += list(encoder.layer)
    return blocks


class RateAsTensorDropPath(nn.Module):
    """timm's ``DropPath`` (stochastic depth) with its rate held as a tensor. timm's rates rise block by block
    (0, 0.009, 0.018, ...), and dynamo specialises a compiled block on a float attribute: every block would compile
    anew, until the recompile limit sent the rest back to eager mode. As a (non-persistent) buffer the rate is a graph
    input, so the blocks share one graph. Same computation: a per-sample Bernoulli keep mask, scaled by 1 / keep."""

    def __init__(self, rate: float, scale_by_keep: bool = True, device=None):
        super().__init__()
        self.register_buffer("rate", torch.tensor(float(rate), device=device), persistent=False)
        self.scale_by_keep = bool(scale_by_keep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = 1.0 - self.rate
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * (mask / keep if self.scale_by_keep else mask)


def _rates_as_tensors(blocks: list[nn.Module]) -> None:
    """Every ``drop_path1/2`` of timm blocks (an Identity where the rate is 0) as a RateAsTensorDropPath, where
    any block drops paths: one module type and one code path in every block."""
    slots = [(b, name) for b in blocks for name in ("drop_path1", "drop_path2") if hasattr(b, name)]
    if not any(type(getattr(b, name)).__name__ == "DropPath" for b, name in slots):
        return
    for block, name in slots:
        old = getattr(block, name)
        device = next(block.parameters()).device
        setattr(block, name, RateAsTensorDropPath(getattr(old, "drop_prob", 0.0), getattr(old, "scale_by_keep", True),
                                                  device=device))


def _allow_second_backward() -> None:
    """A logging step's loss balance (losses.objective.loss_balance) takes each term's gradient with the graph
    retained, a second backward through the compiled code, which AOT autograd's donated buffers refuse."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False


def compile_model(module: nn.Module, backend: str = "inductor") -> nn.Module:
    """``--compile-scope model``: the whole forward as one graph (the Trainer runs it once the schedules are over)."""
    _allow_second_backward()
    return torch.compile(module, backend=backend)


def compile_blocks(student: nn.Module, backend: str = "inductor", text: bool = True) -> int:
    """Compile each repeated block in place (``nn.Module.compile``: the state dict keeps its names, so
    checkpoints are the eager model's); returns how many were compiled. ``text`` False: the image tower's only, the
    text tower's layers left eager (for its CUDA graphs, which replay the packed layers on FlashAttention)."""
    _allow_second_backward()
    blocks = repeated_blocks(student, text=text)
    _rates_as_tensors(blocks)
    for block in blocks:
        block.compile(backend=backend)
    text_tower = getattr(student, "text_tower", None)
    if text and getattr(text_tower, "pack", False):  # the packed text layers (packed_text) bypass the layers' forward;
        # their token count changes every batch: compiled for any shape at once, not per shape first
        text_tower.packed_layer = torch.compile(text_tower.packed_layer, backend=backend, dynamic=True)
    return len(blocks)
