"""--cuda-graphs (cxrdr/train/models/block_graphs.py): which block runs go through a graph, and the guards around it.

A CUDA graph cannot be captured on the CPU; a stand-in capture (the run's blocks as they are, counted) takes its
place, so these tests check the plumbing: the same outputs and gradients as the eager tower, a graph per run and
shape, eager where a graph may not run, and the Trainer's settings."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings

import pytest
import torch

from cxrdr.train.config import TrainConfig
from cxrdr.train.device import autocast
from cxrdr.train.models import StudentConfig, build_student
from cxrdr.train.models.block_graphs import (MAX_GRAPHS, BlockGraphs, enable_block_graphs,
                                             quiet_side_stream_gradients, shapes_settled, thread_local_capture)
from cxrdr.train.losses.objective import GlobalTerms
from cxrdr.train.models.heads import GridHeads

TEXTS = ["left pleural effusion, no pneumothorax.", "heart size is normal. no focal consolidation."]


class CountingCapture:
    """Stands in for capture_cuda_graphs: the run's blocks (or the heads on the grid) as they are; counts captures
    (the number of blocks, or "heads", and the input's shape) and replays."""

    def __init__(self):
        self.captured: list[tuple[int, tuple]] = []
        self.replays = 0

    def __call__(self, module, *inputs):
        name = ("heads" if isinstance(module, GridHeads) else "losses" if isinstance(module, GlobalTerms)
                else len(module))
        self.captured.append((name, tuple(inputs[0].shape)))

        def replay(*t):
            self.replays += 1
            return module(*t)
        return replay


def _student(name: str, **overrides):
    torch.manual_seed(0)
    return build_student(StudentConfig.from_yaml(name, **overrides)).train()


def _images(n: int = 2):
    return torch.rand(n, 1, 64, 64, generator=torch.Generator().manual_seed(0))


def _loss_and_grads(model, images):
    tok = model.tokenize(TEXTS[:images.shape[0]] * (images.shape[0] // 2 or 1))
    torch.manual_seed(1)
    out = model(images, tok["input_ids"], tok["attention_mask"])
    loss = out.image_emb.square().sum() + out.patch_tokens.square().mean()
    if out.mask_scores is not None:  # the heads on the grid: the soft scores, and z through the masked embedding
        loss = loss + out.mask_scores.sum() + out.masked_image_emb[:, 0].sum()
    if out.local_visual is not None:  # the head convs' patches, through the local alignment
        loss = loss + out.local_visual.square().mean()
    model.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _with_graphs(model, capture):
    graphs = enable_block_graphs(model, capture=capture, on_device=lambda x: True, heads=True)
    graphs.active = True
    return graphs


HEADS = ("heads", (2, 64, 64))  # the heads (mask, head convs) on the whole 8x8 grid
KEPT_HEADS = ("heads", (2, 32, 64))  # on E's kept patches


@pytest.mark.parametrize("name, overrides, runs", [
    ("tiny-D", {}, [(4, (2, 65, 64)), HEADS]),                                   # one run of the 4 blocks
    ("tiny-D", {"head_layer": 1}, [(1, (2, 65, 64)), (3, (2, 65, 64)), HEADS]),  # split at the heads' layer
    ("tiny-D", {"head_conv_depth": 1}, [(4, (2, 65, 64)), HEADS]),               # head convs and mask, one graph
    ("tiny-C", {"head_conv_depth": 1}, [(4, (2, 65, 64)), HEADS]),               # the sigmoid mask (z is the scores)
    ("tiny-B", {"head_conv_depth": 1}, [(4, (2, 65, 64)), HEADS]),               # head convs, no mask
    ("tiny-E", {}, [(2, (2, 65, 64)), (2, (2, 33, 64)), KEPT_HEADS]),            # before and after the drop (keep 0.5)
    ("tiny-E", {"head_layer": 3}, [(2, (2, 65, 64)), (1, (2, 33, 64)), (1, (2, 33, 64)), KEPT_HEADS]),
    ("tiny-E", {"patch_score": "cls_attn"}, [(1, (2, 65, 64)), (1, (2, 65, 64)), (2, (2, 33, 64)), KEPT_HEADS]),
    # the full-size E's layout: the mask on the embedded grid picks the tokens every block sees
    ("tiny-E", {"patch_score": "mask", "drop_layer": 0, "head_layer": 0, "head_conv_depth": 1},
     [HEADS, (4, (2, 33, 64))]),
])
def test_graphed_runs_give_the_eager_towers_outputs_and_gradients(name, overrides, runs):
    eager_loss, eager_grads = _loss_and_grads(_student(name, **overrides), _images())
    model, capture = _student(name, **overrides), CountingCapture()
    graphs = _with_graphs(model, capture)
    loss, grads = _loss_and_grads(model, _images())
    assert capture.captured == runs and len(graphs) == len(runs)
    assert torch.allclose(loss, eager_loss, atol=1e-6)
    assert grads.keys() == eager_grads.keys()
    for key, grad in grads.items():
        assert torch.allclose(grad, eager_grads[key], atol=1e-6), key
    _loss_and_grads(model, _images())  # a second step replays what the first captured
    assert len(capture.captured) == len(runs) and capture.replays == 2 * len(runs)


def test_the_heads_run_eagerly_unless_their_graphs_are_asked_for():
    model, capture = _student("tiny-D"), CountingCapture()
    enable_block_graphs(model, capture=capture, on_device=lambda x: True).active = True
    eager_loss, _ = _loss_and_grads(_student("tiny-D"), _images())
    loss, _ = _loss_and_grads(model, _images())
    assert capture.captured == [(4, (2, 65, 64))] and model.heads_graphs is None
    assert torch.allclose(loss, eager_loss, atol=1e-6)


def test_the_heads_run_eagerly_while_the_top_k_anneals_and_replay_its_final_k_after():
    """A graph holds one K: while the mask's K anneals (k_ratio_start -> k_ratio) the heads on the grid run eagerly,
    from the anneal's end one graph replays, with the eager heads' masks."""
    model, capture = _student("tiny-D", k_ratio_start=0.9, k_anneal_steps=4), CountingCapture()
    eager = _student("tiny-D", k_ratio_start=0.9, k_anneal_steps=4)
    _with_graphs(model, capture)
    tok = model.tokenize(TEXTS)
    for step in range(7):
        out, want = (m(_images(), tok["input_ids"], tok["attention_mask"], step=step) for m in (model, eager))
        assert torch.equal(out.mask, want.mask) and torch.allclose(out.mask_scores, want.mask_scores, atol=1e-6)
        assert int(out.mask[0].sum()) == [58, 51, 45, 38, 32, 32, 32][step]  # 0.9 -> 0.5 of the 64 patches
        heads = [c for c in capture.captured if c[0] == "heads"]
        assert heads == ([] if step < 4 else [("heads", (2, 64, 64))]), step
        (out.image_emb.sum() + out.mask_scores.sum()).backward()


def test_no_graph_outside_training_with_gradients_on_the_graphs_device_while_active():
    model, capture = _student("tiny-D"), CountingCapture()
    graphs = _with_graphs(model, capture)
    tok = model.tokenize(TEXTS)
    with torch.no_grad():
        model(_images(), tok["input_ids"], tok["attention_mask"])
    model.eval()
    model(_images(), tok["input_ids"], tok["attention_mask"])
    model.train()
    graphs.active = False  # the Trainer's keep-rate warm-up
    model(_images(), tok["input_ids"], tok["attention_mask"])
    graphs.active, graphs._on_device = True, lambda x: x.is_cuda
    model(_images(), tok["input_ids"], tok["attention_mask"])
    assert capture.captured == [] and capture.replays == 0


def test_a_second_call_before_the_backward_runs_eagerly_and_the_backward_releases_the_graph():
    model, capture = _student("tiny-D", head_layer=0), CountingCapture()  # heads on the embedded patches
    _with_graphs(model, capture)
    tok = model.tokenize(TEXTS)
    first = model(_images(), tok["input_ids"], tok["attention_mask"])
    with pytest.warns(RuntimeWarning, match="called again before the backward of its last call"):
        second = model(_images(), tok["input_ids"], tok["attention_mask"])  # would overwrite what first's needs
    assert capture.replays == 2 and torch.allclose(first.image_emb, second.image_emb, atol=1e-6)  # blocks, heads
    assert torch.equal(first.mask, second.mask) and torch.allclose(first.mask_scores, second.mask_scores, atol=1e-6)
    first.image_emb.sum().backward(retain_graph=True)  # through the blocks alone: the heads' replay stays live
    third = model(_images(), tok["input_ids"], tok["attention_mask"])
    assert capture.replays == 3
    first.mask_scores.sum().backward()  # one of the heads' outputs reaches the loss: their replay is released
    third.image_emb.sum().backward()
    model(_images(), tok["input_ids"], tok["attention_mask"])
    assert capture.replays == 5 and len(capture.captured) == 2


def test_a_second_backward_through_one_replay_is_refused_and_the_next_forward_replays_again():
    """A CUDA replay's backward reads activations that its first backward overwrites (the capture freed them):
    a second backward through the same replay (retain_graph) raises instead of returning wrong gradients; the
    graph is released by the first, so the next forward replays it."""
    for tower in ("image", "heads"):
        model, capture = _student("tiny-D", head_layer=0), CountingCapture()  # the heads read the embedded patches
        _with_graphs(model, capture)
        tok = model.tokenize(TEXTS)
        out = model(_images(), tok["input_ids"], tok["attention_mask"])
        loss = out.image_emb.square().sum() if tower == "image" else out.mask.sum()
        params = [p for p in model.parameters() if p.requires_grad]
        first = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        assert any(g is not None and g.abs().sum() > 0 for g in first)
        with pytest.raises(RuntimeError, match="second backward through one replay of " + (
                "the image tower's CUDA graph" if tower == "image" else "the heads on the patch grid")):
            torch.autograd.grad(loss, params, allow_unused=True)
        if tower == "image":
            model(_images(), tok["input_ids"], tok["attention_mask"]).image_emb.sum().backward()  # a new replay
            assert capture.replays == 3 and len(capture.captured) == 2  # (the heads' first replay is still live)


def test_changing_shapes_stop_at_max_graphs_and_a_failed_capture_leaves_the_tower_eager():
    model, capture = _student("tiny-D"), CountingCapture()
    graphs = _with_graphs(model, capture)
    for n in range(1, MAX_GRAPHS + 2):
        if n == MAX_GRAPHS + 1:
            with pytest.warns(RuntimeWarning,
                              match=f"{MAX_GRAPHS} CUDA graphs of the image tower.s block runs are captured already"):
                _loss_and_grads(model, _images(2 * n))
        else:
            _loss_and_grads(model, _images(2 * n))
    assert graphs.captured("image") == graphs.captured("heads") == MAX_GRAPHS  # each on its own
    assert len(graphs) == len(capture.captured) == 2 * MAX_GRAPHS
    graphs.clear()
    assert len(graphs) == 0

    def refuse(module, x):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    model = _student("tiny-D")
    graphs = _with_graphs(model, refuse)
    eager_loss, _ = _loss_and_grads(_student("tiny-D"), _images())
    with pytest.warns(RuntimeWarning,
                      match="capturing the image tower.s blocks as a CUDA graph failed .*not permitted"):
        loss, _ = _loss_and_grads(model, _images())
    assert torch.allclose(loss, eager_loss, atol=1e-6)
    assert graphs.failed == "RuntimeError: operation not permitted when stream is capturing"
    assert not graphs.applies(model.image_tower, torch.zeros(1))
    assert graphs.applies(model.image_tower, torch.zeros(1), "text")  # the text tower's graphs fail on their own
    assert not graphs.applies(model.image_tower, torch.zeros(1), "heads")  # the heads' capture failed too
    graphs.clear()  # a new training stage tries again
    assert graphs.applies(model.image_tower, torch.zeros(1)) and graphs.failed.startswith("RuntimeError")


def test_a_copied_model_starts_without_graphs_and_cnn_towers_have_none():
    model = _student("tiny-D")
    graphs = _with_graphs(model, CountingCapture())
    _loss_and_grads(model, _images())
    twin = copy.deepcopy(model)
    assert len(graphs) == 2 and isinstance(twin.image_tower.block_graphs, BlockGraphs)  # the blocks, the heads
    assert len(twin.image_tower.block_graphs) == 0 and not twin.image_tower.block_graphs.active
    assert twin.heads_graphs is twin.image_tower.block_graphs  # the copy's heads replay through the copy's graphs
    with pytest.warns(RuntimeWarning, match="has no transformer blocks to replay"):
        assert enable_block_graphs(_student("tiny-cnn-D")) is None


def test_shapes_settle_after_es_keep_rate_warm_up_only():
    e = _student("tiny-E", keep_rate_warmup_steps=50)
    assert not shapes_settled(e, 49) and shapes_settled(e, 50)
    assert shapes_settled(_student("tiny-D"), 0)


def test_the_trainer_settings_that_graphs_exclude_and_the_autocast_without_cache():
    for flags, named in (({"compile": True}, r"--compile with --compile-scope model \(blocks can be graphed\)"),
                         ({"accum_steps": 2}, "--accum-steps > 1"),
                         ({"grad_checkpointing": True}, "--grad-checkpointing")):
        with pytest.raises(ValueError, match=f"--cuda-graphs on does not go with {named}"):
            TrainConfig.load(None, shards="s", cuda_graphs="on", **flags)
        assert TrainConfig.load(None, shards="s", **flags).cuda_graphs == "auto"  # auto just leaves them off
    # blocks compiled one by one can be captured: asked for, they are
    compiled_blocks = TrainConfig.load(None, shards="s", cuda_graphs="on", compile=True, compile_scope="blocks")
    assert compiled_blocks.cuda_graphs == "on"
    assert TrainConfig.load(None, shards="s").cuda_graphs == "auto"
    # YAML reads on / off as booleans, and config.yaml files before "auto" hold booleans
    assert [TrainConfig.load(None, shards="s", cuda_graphs=v).cuda_graphs for v in (True, False)] == ["on", "off"]
    with pytest.raises(ValueError, match=r"cuda_graphs must be one of \('auto', 'on', 'off'\), got 'yes'"):
        TrainConfig.load(None, shards="s", cuda_graphs="yes")
    for flags in ({"cuda_graphs": "off"}, {"pack_text": False}):
        with pytest.raises(ValueError, match="--cuda-graphs-text on .* needs --cuda-graphs auto or on, and --pack-"):
            TrainConfig.load(None, shards="s", cuda_graphs_text=True, **flags)  # a config.yaml's true: on
        assert not TrainConfig.load(None, shards="s", **flags).text_graphs()  # auto just leaves them off
    with pytest.raises(ValueError, match="--cuda-graphs-text on does not go with --compile-scope model: the compiled"):
        TrainConfig.load(None, shards="s", cuda_graphs_text="on", compile=True, compile_scope="model")
    assert not TrainConfig.load(None, shards="s", compile=True, compile_scope="model").text_graphs()
    # blocks compiled one by one: the image blocks compiled, the text layers eager in the graphs
    assert TrainConfig.load(None, shards="s", cuda_graphs="on", compile=True, compile_scope="blocks").text_graphs()
    # the text layers join the blocks' graphs by default (timed on an H200: docs/gpu.md, "Ninth GPU session")
    default = TrainConfig.load(None, shards="s")
    assert default.cuda_graphs_text == "auto" and default.text_graphs()
    assert not TrainConfig.load(None, shards="s", cuda_graphs_text=False).text_graphs()
    # the heads on the grid: off by default until timed on a GPU; auto and on wherever the blocks' graphs may run
    assert default.cuda_graphs_heads == "off" and not default.heads_graphs()
    assert [TrainConfig.load(None, shards="s", cuda_graphs_heads=v).heads_graphs() for v in ("auto", "on", True)] \
        == [True, True, True]
    assert not TrainConfig.load(None, shards="s", cuda_graphs="off", cuda_graphs_heads="auto").heads_graphs()
    with pytest.raises(ValueError, match="--cuda-graphs-heads on replays the heads with the image tower's graphs: it "
                                         "needs --cuda-graphs auto or on"):
        TrainConfig.load(None, shards="s", cuda_graphs="off", cuda_graphs_heads="on")
    # the loss terms alike
    assert default.cuda_graphs_losses == "off" and not default.losses_graphs()
    assert TrainConfig.load(None, shards="s", cuda_graphs_losses="auto").losses_graphs()
    assert not TrainConfig.load(None, shards="s", cuda_graphs="off", cuda_graphs_losses="auto").losses_graphs()
    with pytest.raises(ValueError, match="--cuda-graphs-losses on replays the loss terms with the image tower's"):
        TrainConfig.load(None, shards="s", cuda_graphs="off", cuda_graphs_losses="on")
    with autocast(torch.device("cpu"), torch.bfloat16, cache=False):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
    with autocast(torch.device("cpu"), torch.bfloat16):
        assert torch.is_autocast_cache_enabled()


def test_auto_graphs_where_they_apply_and_nowhere_else(phantom_shards, tmp_path, recwarn):
    """auto: graphs on one CUDA process without the settings they exclude, silently eager elsewhere; on: a warning
    off CUDA; off: never. The device is only named here (the Trainer's choice reads it, no tensor goes there)."""
    from cxrdr.train.loop import Trainer

    run = Trainer(TrainConfig(shards=str(phantom_shards), model="tiny-D", out=str(tmp_path / "run"), steps=2,
                              batch_size=4, workers=0, progress=False, device="cpu", eval_every=0))
    assert run.cfg.cuda_graphs == "auto" and run.block_graphs is None and not recwarn.list  # CPU: silently eager
    run.device = torch.device("cuda")
    graphs = run._block_graphs()  # auto: the text tower shares the image tower's
    assert isinstance(graphs, BlockGraphs) and not recwarn.list
    assert run.student.text_tower.block_graphs is graphs is run.student.image_tower.block_graphs
    assert run.student.heads_graphs is None  # the heads' graphs are off by default
    run.cfg = dataclasses.replace(run.cfg, cuda_graphs_heads="auto")
    assert run._block_graphs() is run.student.heads_graphs is run.student.image_tower.block_graphs
    run.student.heads_graphs = None
    run.student.text_tower.block_graphs = None
    run.cfg = dataclasses.replace(run.cfg, cuda_graphs_text="off", cuda_graphs_heads="off")
    assert isinstance(run._block_graphs(), BlockGraphs) and run.student.text_tower.block_graphs is None
    run.cfg = dataclasses.replace(run.cfg, cuda_graphs_text="auto")
    for setting in ({"cuda_graphs": "off"}, {"compile": True}, {"grad_checkpointing": True}, {"accum_steps": 2}):
        run.cfg = dataclasses.replace(run.cfg, **setting)
        assert run._block_graphs() is None, setting
        run.cfg = dataclasses.replace(run.cfg, cuda_graphs="auto", compile=False, compile_scope="model",
                                      grad_checkpointing=False, accum_steps=1)
    for setting in ("auto", "on"):  # blocks compiled one by one are captured (by default: faster than either alone),
        run.student.text_tower.block_graphs = None  # with the text layers graphed eager
        run.cfg = dataclasses.replace(run.cfg, cuda_graphs=setting, compile=True, compile_scope="blocks")
        graphs = run._block_graphs()
        assert isinstance(graphs, BlockGraphs) and run.student.text_tower.block_graphs is graphs
    run.cfg = dataclasses.replace(run.cfg, cuda_graphs="auto", compile=False, compile_scope="model")
    run.ddp = True
    assert run._block_graphs() is None and not recwarn.list
    run.cfg = dataclasses.replace(run.cfg, cuda_graphs="on")
    with pytest.warns(RuntimeWarning, match="--cuda-graphs needs one CUDA process"):
        assert run._block_graphs() is None


def test_the_trainer_captures_once_es_warm_up_is_over_and_replays_after(phantom_shards, tmp_path, capsys):
    """The loop's steps: no graph during the keep-rate warm-up (E's kept tokens change), then one per block run,
    replayed by every later step; --cuda-graphs without CUDA warns and leaves the blocks eager."""
    from cxrdr.train.loop import Trainer

    def trainer(name):
        return Trainer(TrainConfig(shards=str(phantom_shards), model="tiny-E", out=str(tmp_path / name), steps=6,
                                   batch_size=4, workers=0, progress=False, device="cpu", eval_every=0,
                                   model_overrides={"keep_rate_warmup_steps": 3}))

    run, capture = trainer("stand-in"), CountingCapture()
    run.cfg.cuda_graphs = "on"
    with pytest.warns(RuntimeWarning, match="--cuda-graphs needs one CUDA process"):
        assert run._block_graphs() is None
    run.block_graphs = enable_block_graphs(run.student, capture=capture, on_device=lambda x: True, heads=True)
    batches = run._batches()
    for step in range(5):
        run.train_step(batches, log_balance=False)
        assert len(capture.captured) == (0 if step < 3 else 3) and capture.replays == max(0, step - 2) * 3
    assert capture.captured == [(2, (4, 65, 64)), (2, (4, 33, 64)), ("heads", (4, 32, 64))]
    # a logging step's loss balance backpropagates each loss term: that step runs eagerly (a CUDA replay takes one
    # backward), its balance finite
    balance = run.train_step(batches, log_balance=True)["balance"]
    assert capture.replays == 2 * 3 and len(balance) >= 3 and all(math.isfinite(v) for v in balance.values())
    notes = [line for line in capsys.readouterr().err.splitlines() if "captured as a CUDA graph" in line]
    assert notes == ["note: the image tower's blocks 0-1 captured as a CUDA graph for inputs (4, 65, 64) (0 MB "
                     "reserved); later steps replay it", "note: the image tower's blocks 2-3 captured as a CUDA graph "
                     "for inputs (4, 33, 64) (0 MB reserved); later steps replay it", "note: the heads on the patch "
                     "grid (K 16) captured as a CUDA graph for inputs (4, 32, 64) (0 MB reserved); later steps replay "
                     "it"]  # said once each, at capture


class CompiledCountingCapture(CountingCapture):
    """CountingCapture that also notes whether every block it was given runs compiled (``nn.Module.compile``)."""

    def __init__(self):
        super().__init__()
        self.compiled: list[bool] = []

    def __call__(self, module, *inputs):
        if not isinstance(module, (GridHeads, GlobalTerms)):  # a run of blocks (the rest is not compiled)
            self.compiled.append(all(getattr(b, "_compiled_call_impl", None) is not None for b in module))
        return super().__call__(module, *inputs)


def test_blocks_compiled_one_by_one_are_captured_and_give_the_losses_of_the_same_compiled_run(phantom_shards,
                                                                                            tmp_path):
    """--compile-scope blocks with --cuda-graphs on: once E's warm-up is over the graphs capture the compiled blocks
    (a stand-in capture on the CPU: the plumbing, not CUDA's capture), every later step replays them, and the losses
    are those of the same compiled run without graphs."""
    from cxrdr.train.loop import Trainer

    def run(graphs: bool):
        config = TrainConfig(shards=str(phantom_shards), model="tiny-E", out=str(tmp_path / str(graphs)), steps=6,
                             batch_size=4, workers=0, progress=False, device="cpu", eval_every=0, compile=True,
                             compile_scope="blocks", compile_backend="aot_eager", cuda_graphs="on" if graphs else "off",
                             model_overrides={"keep_rate_warmup_steps": 2})
        with pytest.warns(RuntimeWarning, match="--cuda-graphs needs one CUDA process") if graphs \
                else contextlib.nullcontext():
            trainer = Trainer(config)
        capture = CompiledCountingCapture()
        if graphs:
            trainer.block_graphs = enable_block_graphs(trainer.student, capture=capture, on_device=lambda x: True,
                                                       heads=True)
        batches = trainer._batches()
        return [float(trainer.train_step(batches, log_balance=False)["terms"]["total"]) for _ in range(5)], capture

    plain, _ = run(graphs=False)
    graphed, capture = run(graphs=True)
    assert capture.captured == [(2, (4, 65, 64)), (2, (4, 33, 64)), ("heads", (4, 32, 64))]
    assert capture.compiled == [True, True]
    assert capture.replays == 3 * 3  # steps 2, 3 and 4, both runs of blocks and the heads
    assert graphed == pytest.approx(plain, rel=1e-6, abs=1e-7)


def test_the_trainer_with_text_graphs_captures_both_towers_and_trains(phantom_shards, tmp_path, monkeypatch):
    """--cuda-graphs-text in the loop (FlashAttention's computation and the capture stood in on the CPU): after E's
    warm-up the image blocks and the text layers are captured, every later step replays both, a logging step's
    repeated backward included, and the losses stay finite."""
    from cxrdr.train.loop import Trainer
    from tests.varlen_reference import use_reference_varlen

    use_reference_varlen(monkeypatch)
    with pytest.warns(RuntimeWarning, match="--cuda-graphs needs one CUDA process"):
        run = Trainer(TrainConfig(shards=str(phantom_shards), model="tiny-E", out=str(tmp_path / "run"), steps=6,
                                  batch_size=4, workers=0, progress=False, device="cpu", eval_every=0,
                                  cuda_graphs="on", cuda_graphs_text=True,
                                  model_overrides={"keep_rate_warmup_steps": 2}))
    capture = CountingCapture()
    run.block_graphs = enable_block_graphs(run.student, text=True, heads=True, capture=capture,
                                           on_device=lambda x: True)
    run.task.objective.graphs = run.block_graphs  # --cuda-graphs-losses
    assert run.student.text_tower.block_graphs is run.block_graphs
    batches = run._batches()
    for step in range(5):
        run.train_step(batches, log_balance=step == 4)  # a logging step (its loss balance) runs eagerly
        assert len(capture.captured) == 0 if step < 2 else run.block_graphs.captured("text") >= 1
    graphs = run.block_graphs
    assert graphs.captured("image") == 2 and graphs.captured("heads") == graphs.captured("losses") == 1
    assert len(capture.captured) == graphs.captured("image") + graphs.captured("text") + 2
    assert capture.replays >= 2 * 5  # two graphed steps: two image runs, the heads, the losses, a text run or more
    assert graphs.describe() == {"image": 2, "text": graphs.captured("text"), "heads": 1, "losses": 1, "pool_mb": 0.0,
                                 "failed": None}  # the run summary's "cuda_graphs" (no CUDA memory here)
    assert all(torch.isfinite(p).all() for p in run.student.parameters())


def _trainer_terms(shards, out, model: str, graphed: bool, steps: int = 3, capture=None, **fields):
    """The loss terms of ``steps`` training steps, with the blocks, the heads and the global loss terms through
    (stand-in) graphs (--cuda-graphs-losses) or eager; and the capture (default: a CountingCapture)."""
    from cxrdr.train.loop import Trainer

    trainer = Trainer(TrainConfig(shards=str(shards), model=model, out=str(out), steps=6, batch_size=4, workers=0,
                                  progress=False, device="cpu", eval_every=0, **fields))
    capture = capture or CountingCapture()
    if graphed:
        trainer.block_graphs = enable_block_graphs(trainer.student, capture=capture, on_device=lambda x: True,
                                                   heads=True)
        trainer.task.objective.graphs = trainer.block_graphs
    batches = trainer._batches()
    terms = [{k: float(v) for k, v in trainer.train_step(batches, log_balance=False)["terms"].items()}
             for _ in range(steps)]
    return terms, capture


def make_graphed_callables_warm_up(module, sample, allow_unused_input=False, capture_error_mode="global"):
    """torch.cuda.make_graphed_callables on the CPU up to its capture: its warm-up backward (which refuses an input
    without a gradient path unless ``allow_unused_input``), then the module as it is."""
    outputs = [o for o in torch.utils._pytree.tree_leaves(module(*sample)) if o.requires_grad]
    surface = [x for x in sample if x.requires_grad] + [p for p in module.parameters() if p.requires_grad]
    torch.autograd.grad(outputs, surface, grad_outputs=[torch.ones_like(o) for o in outputs],
                        allow_unused=allow_unused_input)
    return module


def test_every_graph_of_a_step_passes_the_captures_warm_up_backward(phantom_shards, tmp_path):
    """capture_cuda_graphs as it calls make_graphed_callables, up to the capture: D's blocks, heads and loss terms
    pass its warm-up backward (the loss terms read the full image's embedding detached, which it refuses unless told
    to allow unused inputs) and give the eager terms."""
    from cxrdr.train.models.block_graphs import capture_cuda_graphs

    captured = []

    def capture(module, *inputs):
        captured.append((module, tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)))
        return capture_cuda_graphs(module, *inputs, make=make_graphed_callables_warm_up)

    eager, _ = _trainer_terms(phantom_shards, tmp_path / "eager", "tiny-D", graphed=False, steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed, _ = _trainer_terms(phantom_shards, tmp_path / "graphed", "tiny-D", graphed=True, steps=2,
                                    capture=capture)
    assert not [w for w in caught if "as a CUDA graph failed" in str(w.message)]  # every capture went through
    assert graphed == eager
    assert sorted(type(m).__name__ for m, _ in captured) == ["GlobalTerms", "GridHeads", "Sequential"]
    terms, inputs = next((m, x) for m, x in captured if isinstance(m, GlobalTerms))
    with pytest.raises(RuntimeError, match="not have been used in the graph"):  # why allow_unused_input
        make_graphed_callables_warm_up(terms, inputs)


@pytest.mark.parametrize("model", ["tiny-A", "tiny-D"])
def test_the_loss_terms_graphed_give_the_eager_terms_step_after_step(phantom_shards, tmp_path, model):
    """--cuda-graphs-losses (the capture stood in for): the CLIP and distillation terms of B_real and B_syn, the
    stored teacher's among them, go through one graph and every term of every step equals the eager run's (the
    gradients too: later steps start from the weights they made)."""
    eager, _ = _trainer_terms(phantom_shards, tmp_path / "eager", model, graphed=False)
    graphed, capture = _trainer_terms(phantom_shards, tmp_path / "graphed", model, graphed=True)
    assert graphed == eager
    assert {"clip", "distill", "clip_syn", "distill_syn"} <= set(eager[0])
    assert [c for c in capture.captured if c[0] == "losses"] == [("losses", (4, 64))] and capture.replays >= 3


def test_the_trainer_hands_its_graphs_to_the_objective_only_where_asked(phantom_shards, tmp_path, monkeypatch):
    from cxrdr.train.loop import Trainer

    monkeypatch.setattr(Trainer, "_block_graphs", lambda self: enable_block_graphs(
        self.student, capture=CountingCapture(), on_device=lambda x: True))
    for setting, wired in (("off", False), ("auto", True)):
        run = Trainer(TrainConfig(shards=str(phantom_shards), model="tiny-D", out=str(tmp_path / setting), steps=2,
                                  batch_size=4, workers=0, progress=False, device="cpu", eval_every=0,
                                  cuda_graphs_losses=setting))
        assert (run.task.objective.graphs is run.block_graphs is not None) == wired, setting
        assert run.task.objective.graphs is None or wired


def test_the_loss_terms_run_eagerly_where_a_graph_would_hold_a_changing_input(phantom_shards, tmp_path):
    """A hard-negative beta that rises every step and a text queue (its contents change) keep the terms eager."""
    for name, loss in (("beta", {"beta_max": 0.5}), ("queue", {"queue_size": 8})):
        _, capture = _trainer_terms(phantom_shards, tmp_path / name, "tiny-D", graphed=True, steps=2, loss=loss)
        assert [c for c in capture.captured if c[0] == "losses"] == [], name


def _graphs_check():
    """benchmarks/block_graphs_check.py, which the GPU suite runs on the card before timing graphs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import block_graphs_check
    return block_graphs_check


def _stale_capture(module, *inputs):
    """A 'graph' that replays its capture's inputs, whatever it is given."""
    captured = [x.detach().clone() for x in inputs]
    return lambda *given: module(*(c + 0 * t for c, t in zip(captured, given)))


@pytest.mark.parametrize("check, model, graphs", [("compare", "tiny-E", 2), ("compare_heads", "tiny-D", 1),
                                                   ("compare_losses", "tiny-D", 1)])
def test_the_agreement_check_finds_a_graph_fed_stale_inputs(check, model, graphs):
    """Zero difference with the blocks (the heads: ``--heads``; the loss terms: ``--losses``) standing in for the
    capture, a large one in the outputs and the gradients from a 'graph' that replays its capture's inputs."""
    compare = getattr(_graphs_check(), check)
    same = compare(model, "cpu", 2, 2, capture=lambda module, *inputs: module)
    assert same["graphs_captured"] == graphs and same["max_rel_diff_output"] == same["max_rel_diff_grad"] == 0.0
    wrong = compare("tiny-D", "cpu", 2, 2, capture=_stale_capture)
    assert wrong["max_rel_diff_output"] > 0.01 and wrong["max_rel_diff_grad"] > 0.01


def test_the_agreement_checks_of_compiled_blocks_and_of_a_student_without_heads():
    block_graphs_check = _graphs_check()
    # --compile-blocks: both runs on the compiled blocks, the graphs around them (what --cuda-graphs on replays there)
    compiled = block_graphs_check.compare("tiny-D", "cpu", 2, 2, capture=_stale_capture, compile_backend="aot_eager")
    assert compiled["compiled_blocks"] == "aot_eager" and compiled["max_rel_diff_output"] > 0.01
    with pytest.raises(ValueError, match="tiny-A has no heads on the patch grid"):
        block_graphs_check.compare_heads("tiny-A", "cpu", 2, 2, capture=lambda module, x: module)


def test_the_text_agreement_check_captures_per_bucket_and_finds_stale_inputs(monkeypatch):
    """block_graphs_check.compare_text with FlashAttention's computation stood in on the CPU: the text tower's graphs
    per bucket agree with eager; a 'graph' replaying its capture's tokens is caught."""
    from tests.varlen_reference import use_reference_varlen

    block_graphs_check = _graphs_check()
    use_reference_varlen(monkeypatch)

    def stale(module, x, offsets):
        captured = x.detach().clone()
        return lambda t, o: module(captured + 0 * t, o)

    same = block_graphs_check.compare_text("tiny-E", "cpu", 4, 3, capture=lambda module, *inputs: module)
    assert same["graphs_captured"] >= 1 and same["capture_failed"] is None
    assert same["max_rel_diff_output"] < 1e-5 and same["max_rel_diff_grad"] < 1e-5
    wrong = block_graphs_check.compare_text("tiny-E", "cpu", 4, 3, capture=stale)
    assert wrong["max_rel_diff_output"] > 0.01 and wrong["max_rel_diff_grad"] > 0.01


def test_an_older_torchs_capture_is_made_thread_local_for_the_call_only():
    import inspect

    base = torch.cuda.graph
    with thread_local_capture():
        assert torch.cuda.graph is not base and issubclass(torch.cuda.graph, base)
        assert inspect.signature(torch.cuda.graph.__init__).parameters["capture_error_mode"].default == "thread_local"
    assert torch.cuda.graph is base


def test_the_capture_quiets_the_side_stream_warning_and_restores_it_on_failure(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", calls.append,
                        raising=False)
    with pytest.raises(RuntimeError, match="capture failed"):
        with quiet_side_stream_gradients():
            assert calls == [False]
            raise RuntimeError("capture failed")
    assert calls == [False, True]
    monkeypatch.delattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch")
    with quiet_side_stream_gradients():  # a PyTorch without the warning
        pass


def test_with_text_graphs_the_trainer_compiles_the_image_blocks_and_leaves_the_text_layers_eager(phantom_shards,
                                                                                               tmp_path, monkeypatch):
    """--compile-scope blocks where the text graphs take the packed text tower (the graphs stood in on the CPU):
    the image blocks are compiled, the text layers and the packed layer are left as they are for the graphs to
    replay; where no graph takes the text tower, its layers are compiled as before."""
    from cxrdr.train.loop import Trainer

    def compiled(module) -> bool:
        return getattr(module, "_compiled_call_impl", None) is not None

    def trainer(name: str) -> Trainer:
        return Trainer(TrainConfig(shards=str(phantom_shards), model="tiny-E", out=str(tmp_path / name), steps=2,
                                   batch_size=4, workers=0, progress=False, device="cpu", eval_every=0, compile=True,
                                   compile_scope="blocks", compile_backend="aot_eager"))

    monkeypatch.setattr(Trainer, "_block_graphs", lambda self: enable_block_graphs(self.student, text=True))
    graphed = trainer("graphed")
    assert graphed.student.text_tower.block_graphs is graphed.block_graphs is not None
    assert all(compiled(b) for b in graphed.student.image_tower.trunk.blocks)
    assert not any(compiled(layer) for layer in graphed.student.text_tower.model.encoder.layer)
    monkeypatch.setattr(Trainer, "_block_graphs", lambda self: None)  # the CPU's own answer: no graphs
    eager = trainer("eager")
    assert all(compiled(layer) for layer in eager.student.text_tower.model.encoder.layer)
    torch._dynamo.reset()
