"""``--cuda-graphs``: a ViT tower's runs of transformer blocks replayed as CUDA graphs, forward and backward (with
``--cuda-graphs-text`` the packed text tower's layers, ``packed_text``; with ``--cuda-graphs-heads`` the heads on the
patch grid, ``heads.grid_heads``: several outputs, released at the first backward through any of them; with
``--cuda-graphs-losses`` the loss terms on the global embeddings, ``losses.objective.GlobalTerms``).

On by default where it applies (``--cuda-graphs auto``: one CUDA process, no compilation, activation checkpointing
or gradient accumulation): on an H200 at 65e9f61 it made A, D and E train 1.22-1.31x faster, the graphed tower's
outputs and gradients equal to the eager one's (docs/gpu.md, "Fifth GPU session").

Why: an eager training step issues every operator from Python. On the H100 (docs/gpu.md) token dropping's (E) step
was bound by the host, 60 % of the GPU busy: its blocks run on 40 % of the tokens, so their kernels shrink while the
host still issues as many operators as A's. A CUDA graph replays a whole run of blocks, and its backward, as one
launch each. PyTorch's ``torch.cuda.make_graphed_callables`` does the capture (warm-up on a side stream, a graph for
the forward and one for the backward, in an autograd node); this module decides where it applies and keeps it safe:

- A graph is fixed to its input's shape: one is captured per (blocks, shape, dtype, autocast dtype) on first use,
  at most ``MAX_GRAPHS``, and only while ``active`` (the Trainer sets it once the keep-rate warm-up, which changes
  E's token count every step, is over). Evaluation (eval mode, no grad), CPU tensors and anything else run eagerly.
- A replay overwrites the graph's outputs and the activations its backward reads. A second call of the same graph
  before the first one's backward ran would corrupt that backward, so it runs eagerly instead (``_live``: a
  gradient hook on the output releases it).
- A replay's backward runs once: the capture freed the activations its backward reads as it went (PyTorch's
  ``make_graphed_callables`` captures the backward without ``retain_graph``), so the memory is reused within the
  backward, and a second backward through the same replay reads overwritten activations. On an H200 a logging
  step's loss balance (one ``autograd.grad`` per loss term) gave its second term an infinite gradient norm and the
  step NaN weights. The Trainer runs such steps eagerly; anything else that backpropagates a replay twice gets an
  error at the second backward (``_release``) instead of wrong gradients.
- The parameters' gradients come back in the graph's own buffers, which autograd may keep as ``.grad``: a second
  backward into them before the optimiser step (gradient accumulation) would add a buffer to itself, so the Trainer
  refuses ``accum_steps > 1`` with graphs, and DDP, a model compiled whole and activation checkpointing, which
  capture does not cover. Blocks compiled one by one (``--compile-scope blocks``) are captured as they run, their
  compiled kernels replayed (what ``torch.compile``'s "reduce-overhead" mode does), by default too: compiled blocks
  ran slower than eager without graphs on an H200, 1.09-1.30x the graphs alone with them.
- The autocast cache must be off (make_graphed_callables refuses it): the Trainer's autocast turns it off.
- A capture that fails warns once, with the reason, and that tower runs eagerly until the next training stage.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings
from typing import Callable

import torch
import torch.nn as nn

MAX_GRAPHS = 4  # per tower: the default A, D and E need one, an E dropping after block L1 > 0 two (before and
# after the drop), heads at a middle layer one more; beyond that, shapes that change. The packed text tower: one per
# token bucket (packed_text.pack_bucket), two or three at batch 256


def capture_cuda_graphs(module: nn.Module, *inputs: torch.Tensor, make: Callable | None = None) -> nn.Module:
    """``module`` (in training mode) with its forward and backward on inputs shaped like ``inputs`` as CUDA graphs
    (``make``: torch.cuda.make_graphed_callables, or a stand-in). The capture is thread-local, so the loader's
    pin-memory thread may go on allocating page-locked memory (in the default "global" mode such a call from another
    thread would fail the capture, or that thread). An input that reaches the outputs without a gradient path gets no
    gradient, as eagerly: the loss terms read the full image's embedding detached (Patch-IB's consistency), which
    make_graphed_callables' warm-up backward refuses by default."""
    make = make or torch.cuda.make_graphed_callables
    sample = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
    with quiet_side_stream_gradients():
        if "capture_error_mode" in inspect.signature(make).parameters:
            return make(module, sample, allow_unused_input=True, capture_error_mode="thread_local")
        with thread_local_capture():  # an older torch: make_graphed_callables has no such argument
            return make(module, sample, allow_unused_input=True)


@contextlib.contextmanager
def quiet_side_stream_gradients():
    """Without PyTorch's warning that a parameter's gradient accumulator was made on another stream, for the block.
    The capture runs its warm-up and capture backwards on a side stream, and the eager steps before it made those
    accumulators on the default stream; the capture synchronises the streams itself, and its replays run on the
    default stream (on the H200 the warning came at the capture, and replays matched eager exactly). Only the capture
    is quieted: should a later step raise it, it still shows. On the H200 at 87a6120 it showed once a process, at the
    first backward after a capture (that step's loss balance): likely the capture's own autograd graph, which
    make_graphed_callables' static outputs keep alive, holding accumulators made on the side stream (not verified;
    a GPU-side wait, no host sync)."""
    setter = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if setter is None:  # a PyTorch without the warning
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)  # its default; PyTorch offers no getter to restore another


@contextlib.contextmanager
def thread_local_capture():
    """``torch.cuda.graph`` capturing in "thread_local" mode unless told otherwise, for the block: what
    ``make_graphed_callables`` uses where it cannot be told (PyTorch releases before its ``capture_error_mode``)."""
    base = torch.cuda.graph

    class ThreadLocalGraph(base):
        def __init__(self, *args, capture_error_mode: str = "thread_local", **kwargs):
            super().__init__(*args, capture_error_mode=capture_error_mode, **kwargs)

    torch.cuda.graph = ThreadLocalGraph
    try:
        yield
    finally:
        torch.cuda.graph = base


class BlockGraphs:
    """The graphs of one student's block runs, captured on first use while ``active``: the image tower's (``run``)
    and, with ``--cuda-graphs-text``, the packed text tower's layers (``run_module``, tag "text"), with
    ``--cuda-graphs-heads`` the heads on the patch grid (tag "heads"), with ``--cuda-graphs-losses`` the loss terms on
    the global embeddings (tag "losses"). Each tower (tag) has at most ``MAX_GRAPHS``
    and fails on its own: a text capture that fails leaves the image graphs."""

    def __init__(self, capture: Callable[..., nn.Module] = capture_cuda_graphs,
                 on_device: Callable[[torch.Tensor], bool] = lambda x: x.is_cuda):
        self._capture, self._on_device = capture, on_device
        self._graphed: dict[tuple, nn.Module] = {}
        self._live: set[tuple] = set()
        self.active = False
        self.failed: str | None = None  # why capturing stopped (the first failure), None while it works
        self._failed_tags: set[str] = set()
        # CUDA memory the captures reserved (MB): the graphs' activations live in a pool of their own, allocated at
        # capture, which a peak of allocated memory measured over later steps leaves out
        self.pool_mb = 0.0
        self._warned: set[str] = set()

    def __deepcopy__(self, memo) -> "BlockGraphs":
        """A copy of the model (efficiency measurements) starts without graphs: its blocks are other modules."""
        return BlockGraphs(self._capture, self._on_device)

    def applies(self, module: nn.Module, x: torch.Tensor, tag: str = "image") -> bool:
        """Whether a block run of ``module`` on ``x`` goes through a graph (training with gradients, on the
        graphs' device, active, no failure of this tower's so far)."""
        return (self.active and tag not in self._failed_tags and module.training and torch.is_grad_enabled()
                and self._on_device(x))

    def clear(self) -> None:
        """Forget every graph (the Trainer calls it when a training stage changes which parameters train), and try
        again where a capture failed: a stage with frozen towers captures other graphs (``failed`` keeps its note)."""
        self._graphed.clear()
        self._live.clear()
        self._failed_tags.clear()

    def __len__(self) -> int:
        return len(self._graphed)

    def captured(self, tag: str) -> int:
        """How many graphs of one tower ("image", "text") are held."""
        return sum(key[0] == tag for key in self._graphed)

    def describe(self) -> dict:
        """What a run's summary says of its graphs: how many each tower holds, the memory their captures reserved,
        and the first failure (None: none failed)."""
        return {"image": self.captured("image"), "text": self.captured("text"), "heads": self.captured("heads"),
                "losses": self.captured("losses"), "pool_mb": round(self.pool_mb, 1), "failed": self.failed}

    def run(self, blocks: nn.ModuleList, start: int, stop: int, x: torch.Tensor,
            eager: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``blocks[start:stop]`` on ``x``: the graph of this run and shape (captured now if new), or ``eager(x)``
        where no graph may run (see the module docstring)."""
        return self.run_module("image", (start, stop), lambda: nn.Sequential(*blocks[start:stop]), (x,), eager)

    def run_module(self, tag: str, run: tuple, build: Callable[[], nn.Module], inputs: tuple[torch.Tensor, ...],
                   eager: Callable[..., torch.Tensor | tuple]) -> torch.Tensor | tuple:
        """``build()(*inputs)`` (a tensor, or a tuple of them: the heads') as the graph of ``run`` (what the module
        computes, e.g. its blocks) and the inputs' shapes, captured now if new; ``eager(*inputs)`` where no graph
        may run."""
        x = inputs[0]
        device_type = x.device.type
        amp = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        key = (tag, *run, *((tuple(t.shape), t.dtype, t.requires_grad) for t in inputs), amp)
        if key in self._live:
            self._warn("live", "a block run's CUDA graph was called again before the backward of its last call; "
                               "that call runs eagerly (a replay would overwrite what the pending backward reads)")
            return eager(*inputs)
        graphed = self._graphed.get(key)
        if graphed is None:
            if self.captured(tag) >= MAX_GRAPHS:
                self._warn(f"full {tag}", f"{MAX_GRAPHS} CUDA graphs of {_named(tag, 'block runs')} are captured "
                                          f"already (input shapes that change?); {tuple(x.shape)} runs eagerly")
                return eager(*inputs)
            reserved = torch.cuda.memory_reserved(x.device) if x.is_cuda else 0
            try:
                graphed = self._capture(build(), *inputs)
            except Exception as exc:  # noqa: BLE001 - a capture the host cannot make: eager from now on
                message = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                self.failed = self.failed or message
                self._failed_tags.add(tag)
                self._warn(f"failed {tag}", f"capturing {_named(tag, 'blocks')} as a CUDA graph failed ({message}); "
                                            "they run eagerly")
                return eager(*inputs)
            self._graphed[key] = graphed
            grown = (torch.cuda.memory_reserved(x.device) - reserved) / 2**20 if x.is_cuda else 0.0
            self.pool_mb += grown
            print(f"note: {_what_runs(tag, run)} captured as a CUDA graph for inputs {tuple(x.shape)} ({grown:.0f} "
                  "MB reserved); later steps replay it", file=sys.stderr)
        out = graphed(*inputs)
        release = functools.partial(self._release, key, tag, [])
        if isinstance(out, tuple):
            if any(t.requires_grad for t in out):
                self._live.add(key)
                out = _ReleasedAtBackward.apply(release, *out)
        elif out.requires_grad:
            self._live.add(key)
            out.register_hook(release)
        return out

    def _release(self, key: tuple, tag: str, backwards: list, grad: torch.Tensor) -> None:
        """The gradient hook on a replay's output: releases the graph at its first backward, refuses a second
        (``backwards`` is this replay's own list of them)."""
        if backwards:
            raise RuntimeError(f"a second backward through one replay of {_named(tag, 'CUDA graph')} (retain_graph, "
                               "or autograd.grad per loss term): the first one overwrote the activations it reads. "
                               "Run such a step with BlockGraphs.active = False, or train with --cuda-graphs off")
        backwards.append(True)
        self._live.discard(key)

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


# what the graphs of tags that are no tower replay, in messages
NOT_TOWERS = {"heads": "the heads on the patch grid", "losses": "the loss terms on the global embeddings"}


def _named(tag: str, what: str) -> str:
    """A tower's ``what`` in a message ("the image tower's blocks"), or what a tag that is no tower replays."""
    return NOT_TOWERS.get(tag) or f"the {tag} tower's {what}"


def _what_runs(tag: str, run: tuple) -> str:
    """What a graph of ``run_module`` replays, for its note."""
    if tag in NOT_TOWERS:
        return f"{_named(tag, '')} ({run[1]})"
    return f"{_named(tag, 'layers' if tag == 'text' else 'blocks')} {run[0]}-{run[1] - 1}"


class _ReleasedAtBackward(torch.autograd.Function):
    """The outputs of a replay with several of them, unchanged, and ``release`` called once at each backward through
    them: a tensor hook on one output would not run where only the others reach the loss."""

    @staticmethod
    def forward(ctx, release, *outputs):
        ctx.release = release
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.release(None)
        return (None, *grads)


def enable_block_graphs(student: nn.Module, text: bool = False, warn: bool = True, warn_text: bool = True,
                        heads: bool = False, **kwargs) -> BlockGraphs | None:
    """Give the student's image tower (with ``text`` its packed text tower, with ``heads`` its heads on the patch
    grid: ``heads.grid_heads``) one BlockGraphs (``kwargs``: BlockGraphs'); None where the image tower has no
    transformer blocks to run (a CNN or hybrid tower), with a warning if ``warn`` (graphs asked for, not taken
    wherever they apply). A text tower that cannot run packed (not BERT-layout) stays eager, with a warning if
    ``warn_text``."""
    tower = student.image_tower
    if not hasattr(tower, "run_blocks"):
        if warn:
            warnings.warn(f"--cuda-graphs: the image tower {type(tower).__name__} has no transformer blocks to "
                          "replay; it runs eagerly", RuntimeWarning, stacklevel=2)
        return None
    tower.block_graphs = BlockGraphs(**kwargs)
    if heads and hasattr(student, "heads_graphs"):
        student.heads_graphs = tower.block_graphs
    if text:
        if getattr(student.text_tower, "pack", False):
            student.text_tower.block_graphs = tower.block_graphs
        elif warn_text:
            warnings.warn(f"--cuda-graphs-text: the text tower {type(student.text_tower).__name__} does not run "
                          "packed; it runs eagerly", RuntimeWarning, stacklevel=2)
    return tower.block_graphs


def shapes_settled(student: nn.Module, step: int) -> bool:
    """Whether the tower's block inputs keep their shapes from ``step`` on: E's kept tokens change every step of its
    keep-rate warm-up (TokenDroppingViT.warmup_steps); the other towers' never do."""
    return step >= getattr(student.image_tower, "warmup_steps", 0)
