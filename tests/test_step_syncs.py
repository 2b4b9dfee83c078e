"""The training step reads nothing back from the device on steps that do not log (issue 35).

On a GPU every host read (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, a boolean index, a
``nonzero``) waits for all queued kernels. This machine has no GPU, so the reads are counted where
they are made: a TorchDispatchMode sees every aten op whose result the host must wait for, and the
Python-level reads (``tolist``, ``cpu``, ``numpy``) are wrapped. Data loading and the optimiser's own
CPU step counters are not device work and are left out (the loader runs in workers on a GPU host;
AdamW keeps its step counts on the host unless fused, which reads none).
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")]

aten = torch.ops.aten
# ops whose result (a Python value, or an output shape) depends on tensor values
READ_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
            aten.is_nonzero.default, aten.equal.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.repeat_interleave.Tensor}


class HostReads(TorchDispatchMode):
    """Counts host reads per training step: ``counts[step] = n`` for the step the trainer is in."""

    def __init__(self):
        super().__init__()
        self.counts: dict[int, int] = {}
        self.where: dict[int, list[str]] = {}
        self.step: int | None = None
        self.paused = 0

    def count(self, what: str) -> None:
        if self.paused or self.step is None:
            return
        self.counts[self.step] = self.counts.get(self.step, 0) + 1
        self.where.setdefault(self.step, []).append(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        boolean_index = func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
            torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] or []))
        if func in READ_OPS or boolean_index:
            self.count(str(func))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def pause(self):
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1


def _python_reads(monkeypatch, reads: HostReads) -> None:
    for name in ("tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, __original=original, __name=name, **kwargs):
            reads.count(f"Tensor.{__name}")
            with reads.pause():  # what it calls inside is the same read
                return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)


@pytest.mark.parametrize("model", ["tiny-D", "tiny-E"])
def test_a_step_that_does_not_log_reads_nothing_from_the_device(phantom_shards, tmp_path, monkeypatch, model):
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer

    reads = HostReads()
    trainer = Trainer(TrainConfig(shards=str(phantom_shards), model=model, out=str(tmp_path / "run"), steps=8,
                                  batch_size=4, workers=0, progress=False, device="cpu", log_every=4,
                                  balance_every=4, save_every=0, eval_every=0))  # every logging step its balance
    batches_of = trainer._batches
    train_step = trainer.train_step
    optimizer_step = trainer.optimizer.step
    logged: dict[int, bool] = {}

    def batches():
        it = batches_of()
        while True:
            with reads.pause():  # the loader: host data, in workers on a GPU host
                batch = next(it)
            yield batch

    def step_and_record(batches, log_balance):
        reads.step, logged[trainer.step] = trainer.step, log_balance
        return train_step(batches, log_balance)

    def optimizer_step_paused(*args, **kwargs):
        with reads.pause():
            return optimizer_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "_batches", batches)
    monkeypatch.setattr(trainer, "train_step", step_and_record)
    monkeypatch.setattr(trainer.optimizer, "step", optimizer_step_paused)
    _python_reads(monkeypatch, reads)
    with reads:
        summary = trainer.run()
    reads.step = None
    assert summary["steps"] == 8 and sorted(logged) == list(range(8))
    quiet = [s for s, log in logged.items() if not log]
    assert quiet == [1, 2, 4, 5, 6]  # log_every 4: steps 0, 3, 7 log
    per_quiet_step = {s: reads.counts.get(s, 0) for s in quiet}
    print("host reads per quiet step", per_quiet_step, "per logging step", {s: reads.counts.get(s, 0) for s in (0, 3, 7)})
    assert max(per_quiet_step.values()) <= 2, {s: reads.where.get(s) for s in quiet}
    # the counter sees reads: the logging steps read the terms (one transfer) and the finiteness flag
    assert all(reads.counts.get(s, 0) >= 1 for s in (0, 3, 7)), reads.where


# D, and E as the GPU students' E drops tokens (default.yaml: the mask picks the 40 % its blocks see from block 0)
@pytest.mark.parametrize("model,overrides", [
    ("tiny-D", {}),
    ("tiny-E", {"head_layer": 0, "drop_layer": 0, "patch_score": "mask", "keep_rate": 0.4, "k_ratio": 0.4})])
def test_compiled_step_gives_the_eager_losses_and_compiles_once(phantom_shards, tmp_path, monkeypatch, model,
                                                                overrides):
    """--compile: one graph for the whole run (texts padded to the context length and packed, their token counts
    dynamic sizes; no step number in the graph) and the eager run's losses. The test compiles with aot_eager
    (dynamo's tracing and AOT autograd, which find graph breaks and recompiles, without inductor's minutes of C++
    builds on CPU)."""
    import json

    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import train

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return aot_autograd(fw_compiler=boxed_nop)(gm, example_inputs)

    torch._dynamo.reset()
    backend = f"cxrdr_test_counting_{model}"  # one registered name per test: the registry keeps them all
    torch._dynamo.register_backend(counting_backend, name=backend)
    common = dict(shards=str(phantom_shards), model=model, model_overrides=overrides, steps=4, batch_size=4,
                  workers=0, progress=False, device="cpu", log_every=1, save_every=0, eval_every=0)
    losses = {}
    for name, extra in (("eager", {}), ("compiled", dict(compile=True, compile_backend=backend))):
        with monkeypatch.context() as patch:
            if name == "eager":  # the texts as the compiled run pads them: the token draws of the local
                # loss depend on the padded length, which is not what this test compares
                patch.setattr("cxrdr.train.models.text_towers.default_bucket", lambda context_length: context_length)
            train(TrainConfig(out=str(tmp_path / name), **common, **extra))
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if r["kind"] == "train"]
    torch._dynamo.reset()
    assert len(graphs) == 1  # four steps of reports and captions of every length: one compilation
    assert len(losses["compiled"]) == 4
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4, abs=1e-5)


def test_block_compiled_step_gives_the_eager_losses_with_one_graph_per_block_shape(phantom_shards, tmp_path):
    """--compile-scope blocks: every ViT block and text layer compiled in place, the blocks of a tower sharing one
    compiled graph per input shape; the step number and the texts' length buckets stay as in eager mode; the
    losses and the checkpoint's names are the eager run's."""
    import json

    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    from cxrdr.train.checkpoint import read_checkpoint
    from cxrdr.train.compiling import repeated_blocks
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer, train
    from cxrdr.train.models import build_student

    graphs = []  # (input shapes, grad mode) of each compilation

    def counting_backend(gm, example_inputs):
        graphs.append((tuple(tuple(x.shape) for x in example_inputs if torch.is_tensor(x)), torch.is_grad_enabled()))
        return aot_autograd(fw_compiler=boxed_nop)(gm, example_inputs)

    student = build_student("tiny-E")
    n_blocks = len(repeated_blocks(student))
    assert n_blocks == len(student.image_tower.trunk.blocks) + len(student.text_tower.model.encoder.layer) > 2
    torch._dynamo.reset()
    torch._dynamo.register_backend(counting_backend, name="cxrdr_test_blocks")
    common = dict(shards=str(phantom_shards), model="tiny-E", steps=4, batch_size=4, workers=0, progress=False,
                  device="cpu", log_every=1, save_every=0, eval_every=0)
    losses = {}
    for name, extra in (("eager", {}), ("blocks", dict(compile=True, compile_scope="blocks",
                                                       compile_backend="cxrdr_test_blocks"))):
        train(TrainConfig(out=str(tmp_path / name), **common, **extra))
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if r["kind"] == "train"]
    torch._dynamo.reset()
    # one compilation per input shape and grad mode, shared by every block that sees it (the image blocks before
    # and after E's drop, the text layers at each length bucket; the final validation without grad): never one per
    # block. Compiled block by block, each shape would come once per block.
    assert len(set(graphs)) == len(graphs) and len(graphs) >= 2, graphs
    lengths = {shape[1] for shapes, grad in graphs if grad for shape in shapes if len(shape) == 3}
    n = student.image_tower.grid_size[0] * student.image_tower.grid_size[1]
    kept = student.image_tower.num_kept(n)
    assert {1 + n, 1 + kept} <= lengths and kept < n  # E's blocks after the drop run on the shorter sequence
    assert losses["blocks"] == pytest.approx(losses["eager"], rel=1e-4, abs=1e-5)
    eager, compiled = (read_checkpoint(tmp_path / n / "last.pt")["model"] for n in ("eager", "blocks"))
    assert list(eager) == list(compiled)  # compiled in place: the eager model's names


def test_finite_watch_names_the_first_non_finite_step_and_its_terms():
    from cxrdr.train.health import FiniteWatch

    watch = FiniteWatch()
    for step, total in enumerate([1.0, 2.0, float("nan"), float("inf"), 3.0]):
        watch.observe({"clip": torch.tensor(total / 2), "total": torch.tensor(total)}, step)
    with pytest.raises(FloatingPointError, match=r"non-finite loss at step 2: \{'clip': nan, 'total': nan\}"):
        watch.check()
    fine = FiniteWatch()
    fine.observe({"total": torch.tensor(1.0)}, 0)
    fine.check()  # all finite: nothing to say


def test_a_nan_loss_stops_the_run_at_the_next_logging_step_before_any_save(phantom_shards, tmp_path, monkeypatch):
    """The check is read at logging and saving steps only, and names the step the loss went bad at;
    no checkpoint is written after it (last.pt stays the one before)."""
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer
    from cxrdr.train.checkpoint import load_training_state

    trainer = Trainer(TrainConfig(shards=str(phantom_shards), model="tiny-A", out=str(tmp_path / "run"), steps=12,
                                  batch_size=4, workers=0, progress=False, device="cpu", log_every=4,
                                  save_every=2, eval_every=0))
    forward = trainer.task.forward
    steps_run = []

    def nan_from_step_5(batch, step, **kwargs):
        steps_run.append(step)
        terms = forward(batch, step, **kwargs)
        if step >= 5:
            terms = {**terms, "total": terms["total"] * float("nan")}
        return terms

    monkeypatch.setattr(trainer.task, "forward", nan_from_step_5)
    with pytest.raises(FloatingPointError, match="non-finite loss at step 5"):
        trainer.run()
    assert max(steps_run) == 5  # the save after step 6 checks first: nothing trained on past it
    assert load_training_state(tmp_path / "run" / "last.pt")["step"] == 4  # the save before the NaN


def test_training_cuda_math_applies_the_loop_settings_and_restores_the_previous_ones():
    """The flags are process-wide torch settings (no GPU needed to set them): a measurement inside the
    block runs with the loop's TF32 / attention choice, and the process keeps its own after it."""
    from cxrdr.train.device import training_cuda_math

    def flags():
        return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                torch.get_float32_matmul_precision(), torch.backends.cuda.cudnn_sdp_enabled())

    before = flags()
    with training_cuda_math():
        assert flags() == (True, True, "high", False)
    assert flags() == before


def test_dispatch_count_benchmark_counts_a_steps_operators(phantom_shards, tmp_path):
    """benchmarks/dispatch_count.py: the aten operators of one forward + backward, none of the optimiser's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import dispatch_count
    import train_step

    base = {**train_step.bench_config(phantom_shards, 2, 0, "cpu"), "out": str(tmp_path / "run")}
    trainer, batches = train_step.make_trainer(base, model="tiny-A")
    try:
        counts = dispatch_count.count_step_ops(trainer, batches)
        where = dispatch_count.ops_by_function(trainer, batches)
        global_terms = dispatch_count.global_term_ops(trainer, batches)
    finally:
        batches.close()
    assert counts["aten::mm"] > 0 and sum(counts.values()) > 100
    # by origin: the autograd engine's and the project's own functions (an operator inside timm counts for the
    # cxrdr function that called timm), each operator once, so fewer than the profiler's nested events
    assert where["backward"] > 0 and where["train/models/image_towers.py:run_block"] > 0
    assert all(name in ("backward", "other") or name.count(":") == 1 for name in where)
    assert sum(where.values()) < sum(counts.values())
    assert not any("adam" in name for name in counts)  # the optimiser step is left out
    assert all(p.grad is None for p in trainer.student.parameters())  # and its gradients cleared
    # the image tower's blocks alone (what --cuda-graphs replays): a share of the step's operators, as many at E's
    # kept tokens as at A's full grid, and no gradient left behind
    blocks = dispatch_count.tower_block_ops(trainer.student, 2)
    assert 0 < blocks < sum(where.values())
    assert all(p.grad is None for p in trainer.student.parameters())
    from cxrdr.train.models import StudentConfig, build_student

    assert dispatch_count.tower_block_ops(build_student(StudentConfig.from_yaml("tiny-E")), 2) == blocks
    # the heads on the grid alone (what --cuda-graphs-heads replays): none for A, more with head convs than without
    assert dispatch_count.grid_head_ops(trainer.student, 2) == 0
    mask_only, with_convs = (dispatch_count.grid_head_ops(build_student(StudentConfig.from_yaml(
        "tiny-D", head_conv_depth=depth)), 2) for depth in (0, 1))
    assert 0 < mask_only < with_convs
    # the loss terms on the global embeddings alone (what --cuda-graphs-losses replays): a share of the step's
    assert 0 < global_terms < sum(where.values())


def test_dispatch_count_benchmark_says_how_many_graphs_a_compiled_configuration_made(phantom_shards, capsys):
    """dispatch_count VARIANT:SCOPE: beside the operators, the graphs dynamo compiled over its steps (one: no break,
    no recompilation), with the backend asked for; eager configurations print none."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import dispatch_count

    try:
        assert dispatch_count.main(["A", "A:model", "--size", "tiny", "--backend", "aot_eager", "--shards",
                                    str(phantom_shards), "--threads", "1"]) == 0
    finally:
        torch._dynamo.reset()
    eager, compiled = [line for line in capsys.readouterr().out.splitlines() if "aten ops" in line]
    assert "graph(s) compiled" not in eager and ", 1 graph(s) compiled" in compiled


def test_train_step_benchmark_times_the_former_heads_and_counts_flops_on_request(phantom_shards, tmp_path):
    """benchmarks/train_step.py --former-heads --count-flops: D beside D with the former heads, FLOPs counted on CPU,
    each configuration its own count (D with padded texts is not D)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import train_step

    out = tmp_path / "rows.json"
    assert train_step.main(["--shards", str(phantom_shards), "--size", "tiny", "--only", "D", "--former-heads",
                            "--padded-texts", "--count-flops", "--teachers", "", "--steps", "1", "--warmup", "0",
                            "--batch-size", "4", "--json-out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == ["D plain (no teacher)", "D stored", "D stored, former heads", "D stored, padded texts"]
    assert all(r["gflops_per_img"] > 0 for r in rows.values())
    assert rows["D stored, former heads"]["model"] == "tiny-D"
    assert rows["D stored, padded texts"]["gflops_per_img"] > rows["D stored"]["gflops_per_img"]
    # the former heads are default.yaml's D as it was before it took the CPU ladder's heads
    from cxrdr.train.models.config import StudentConfig
    from tests.test_models import ADDED_FIELDS, CHANGED, OLD_CONFIGS

    assert StudentConfig.from_yaml("D", **train_step.FORMER_HEADS).to_dict() == {**ADDED_FIELDS, **OLD_CONFIGS["D"]}
    assert StudentConfig.from_yaml("E", **train_step.FORMER_HEADS_E).to_dict() == {
        **ADDED_FIELDS, **OLD_CONFIGS["E"], **CHANGED["E"]}  # token_dropping.py's E-former-heads


def test_train_step_benchmark_times_each_part_switched_off_and_prints_what_it_costs(phantom_shards, tmp_path, capsys):
    """benchmarks/train_step.py --parts: E beside E without each part (A without its captions), every such trainer
    built without that part, and each part's cost read as its variant's step less the step without it."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import train_step

    out = tmp_path / "rows.json"
    assert train_step.main(["--shards", str(phantom_shards), "--size", "tiny", "--only", "A,E", "--parts",
                            "--teachers", "", "--steps", "1", "--warmup", "0", "--batch-size", "4",
                            "--json-out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == sorted(["A stored", "E stored", "A stored, without B_syn captions",
                                   *(f"E stored, without {part}" for part in train_step.PARTS_OFF)])
    printed = capsys.readouterr().out
    for cost in train_step.part_costs(list(rows.values())):
        full = rows[f"{cost['variant']} stored"]["step_ms"]
        without = rows[f"{cost['variant']} stored, without {cost['part']}"]["step_ms"]
        assert cost["ms"] == pytest.approx(full - without)
        assert cost["share_pct"] == pytest.approx(100 * cost["ms"] / full)
        assert f"{cost['variant']:<3} {cost['part']:<32} {cost['ms']:8.1f} ms/step" in printed
    assert len(train_step.part_costs(list(rows.values()))) == 1 + len(train_step.PARTS_OFF)
    assert train_step.part_costs([{"name": "E stored, without head convs", "step_ms": 1.0}]) == []  # no full step


def test_train_step_benchmark_times_a_setting_beside_its_variant_and_prints_what_it_saves(phantom_shards, tmp_path,
                                                                                          capsys):
    """benchmarks/train_step.py --with KEY=VALUE: each variant beside itself with the setting (a TrainConfig path,
    its value read as YAML), the saving printed; a malformed setting is refused naming the form."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import train_step

    out = tmp_path / "rows.json"
    assert train_step.main(["--shards", str(phantom_shards), "--size", "tiny", "--only", "D",
                            "--with", "loss.local_group_size=2", "--teachers", "", "--steps", "1", "--warmup", "0",
                            "--batch-size", "4", "--json-out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert "D stored, with loss.local_group_size=2" in rows
    (cost,) = train_step.part_costs(list(rows.values()))
    assert cost["part"] == "with loss.local_group_size=2" and cost["ms"] == pytest.approx(
        rows["D stored"]["step_ms"] - rows["D stored, with loss.local_group_size=2"]["step_ms"])
    assert "with loss.local_group_size=2" in capsys.readouterr().out
    assert train_step.setting("loss.local_group_size=64") == ("loss.local_group_size", 64)
    with pytest.raises(Exception, match="KEY=VALUE"):
        train_step.setting("loss.local_group_size")


@pytest.mark.parametrize("part", ["B_syn captions", "Patch-IB global terms", "mask follows words",
                                  "token-region term", "head convs"])
def test_each_part_switched_off_is_left_out_of_the_step(phantom_shards, tmp_path, part):
    """What a PARTS_OFF setting leaves out of tiny-E's step: the loss terms it names are gone (and only they, but
    the mask-follows-words term without the words the token-region term draws), the head convs are not built."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import train_step

    base = {**train_step.bench_config(phantom_shards, 4, 0, "cpu"), "out": str(tmp_path / "full")}
    terms = {}
    for name, off in (("full", {}), ("off", train_step.PARTS_OFF[part])):
        trainer, batches = train_step.make_trainer({**base, "out": str(tmp_path / name)}, model="tiny-E", **off)
        try:
            losses = trainer.task.forward(next(batches), trainer.step)
        finally:
            batches.close()
        terms[name] = set(losses)
        if name == "off" and part == "head convs":
            assert trainer.student.head_conv is None
    left_out = {"B_syn captions": {"clip_syn", "distill_syn"}, "Patch-IB global terms": {"mask_nce", "consistency",
                "sparsity"}, "mask follows words": {"mask_words"}, "token-region term": {"local", "mask_words"},
                "head convs": set()}[part]
    assert left_out <= terms["full"] and terms["full"] - terms["off"] == left_out


def test_the_step_marks_its_phases_for_the_profiler(phantom_shards, tmp_path):
    """Trainer.train_step runs its phases inside record_function ranges (cxrdr.train.loop.PHASES): the profile
    of a GPU step (benchmarks/profile_step.py) says in which of them the host was while the GPU waited."""
    from torch.profiler import ProfilerActivity, profile

    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import PHASES, Trainer

    trainer = Trainer(TrainConfig(shards=str(phantom_shards), model="tiny-A", out=str(tmp_path / "run"), steps=2,
                                  batch_size=4, workers=0, progress=False, device="cpu", eval_every=0))
    batches = trainer._batches()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.train_step(batches, log_balance=False)
    finally:
        batches.close()
    ranges = [e for e in prof.events() if e.name in PHASES.values()]
    assert sorted({e.name for e in ranges}) == sorted(PHASES.values())
    forward, backward = (next(e for e in ranges if e.name == PHASES[k]) for k in ("forward", "backward"))
    assert forward.time_range.end <= backward.time_range.start  # one after the other, not nested


def test_blocks_compiled_for_the_text_graphs_leave_the_text_tower_eager():
    """compile_blocks(text=False), what the Trainer does where the packed text layers go into CUDA graphs: the image
    tower's blocks are compiled in place, the text tower's layers and its packed layer stay as they are (a graph
    replays them on FlashAttention); with text=True both towers' are compiled."""
    from cxrdr.train.compiling import compile_blocks, repeated_blocks
    from cxrdr.train.models import build_student

    def compiled(module) -> bool:  # nn.Module.compile keeps the module and sets its compiled call
        return getattr(module, "_compiled_call_impl", None) is not None

    student = build_student("tiny-E")
    packed = student.text_tower.packed_layer
    assert repeated_blocks(student, text=False) == list(student.image_tower.trunk.blocks)
    assert compile_blocks(student, "aot_eager", text=False) == len(student.image_tower.trunk.blocks)
    assert all(compiled(b) for b in student.image_tower.trunk.blocks)
    assert not any(compiled(layer) for layer in student.text_tower.model.encoder.layer)
    assert student.text_tower.packed_layer is packed
    other = build_student("tiny-E")
    eager_packed = other.text_tower.packed_layer
    assert compile_blocks(other, "aot_eager") == len(repeated_blocks(other))
    assert all(compiled(layer) for layer in other.text_tower.model.encoder.layer)
    assert other.text_tower.packed_layer is not eager_packed  # torch.compile's wrapper in its place
    torch._dynamo.reset()


def test_flops_by_part_benchmark_splits_a_steps_forward_by_the_students_parts(phantom_shards, tmp_path):
    """benchmarks/flops_by_part.py: the forward's FLOPs split by part, none negative; E's blocks see its kept tokens
    only, while its text tower costs what D's does (tiny-E's heads read the kept tokens too: default.yaml's E, whose
    mask picks them, runs D's heads on the whole grid); the step (forward + backward) counts more."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import flops_by_part
    import train_step

    parts, steps = {}, {}
    for variant in ("tiny-D", "tiny-E"):
        base = {**train_step.bench_config(phantom_shards, 2, 0, "cpu"), "out": str(tmp_path / variant)}
        trainer, batches = train_step.make_trainer(base, model=variant)
        try:
            batch = next(batches)
            parts[variant] = flops_by_part.forward_flops_by_part(trainer, batch)
            steps[variant] = flops_by_part.step_flops(trainer, batch)
        finally:
            batches.close()
        assert all(p.grad is None for p in trainer.student.parameters())
        assert all(v >= 0 for v in parts[variant].values()), parts[variant]
        assert steps[variant] > 2 * sum(parts[variant].values())  # a backward costs about twice a forward
    d, e = parts["tiny-D"], parts["tiny-E"]
    assert 0 < e["image blocks"] < d["image blocks"] and d["text tower"] == e["text tower"] > 0
    assert 0 < e["head convs + mask"] <= d["head convs + mask"] and d["local alignment"] > 0
