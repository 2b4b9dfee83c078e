"""The text tower on the real tokens only (cxrdr/train/models/packed_text.py): the padded forward's states,
gradients and pooled vectors, the packing index from the tokenizer to the tower, and its compilation."""
from __future__ import annotations

import pytest
import torch

from cxrdr.train.models.packed_text import (encode_packed, packed_layer, packing_index, stack_token_batches,
                                            supports_packing)
from cxrdr.train.models.text_towers import build_text_tower, build_tokenizer
from tests.varlen_reference import reference_varlen

TEXTS = ["no acute cardiopulmonary process.",
         "moderate right pleural effusion with adjacent atelectasis. the heart size is normal. no pneumothorax.",
         "cardiomegaly.",
         "small left apical pneumothorax. left chest tube in place. the lungs are otherwise clear."]


def _tower(name: str, **text_kwargs):
    torch.manual_seed(0)
    return build_text_tower(name, 32, text_kwargs=text_kwargs or None), build_tokenizer(name, 32)


def _padded_and_packed(tower, tok, token_layer):
    """The tower's (token states, pooled) padded and packed, on the same batch."""
    outs = []
    for pack in (False, True):
        tower.pack = pack
        outs.append(tower(tok["input_ids"], tok["attention_mask"], token_layer, tok["token_index"]))
    return outs


@pytest.mark.parametrize("name", ["tiny", "minilm"])
def test_packed_tower_gives_the_padded_states_of_the_real_tokens(name):
    tower, tokenizer = _tower(name)
    tower.eval()
    tok = tokenizer(TEXTS)
    real = tok["attention_mask"].bool()
    assert real.sum() < real.numel()  # the batch holds padding, which packing skips
    assert supports_packing(tower.model)
    with torch.no_grad():
        for token_layer in (None, 0, 1):
            (padded, padded_pooled), (packed, packed_pooled) = _padded_and_packed(tower, tok, token_layer)
            assert packed.shape == padded.shape
            torch.testing.assert_close(packed[real], padded[real], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(packed_pooled, padded_pooled, rtol=1e-4, atol=1e-5)
            if token_layer != 0:  # the layers' padded rows are not computed: zeros (the embeddings are computed)
                assert not packed[~real].any()


def test_packed_gradients_equal_the_padded_ones_with_and_without_checkpointing():
    tower, tokenizer = _tower("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    tower.train()
    tok = tokenizer(TEXTS)
    real = tok["attention_mask"].bool()
    weights = torch.randn(real.shape + (tower.width,))

    def grads(pack: bool, checkpointing: bool) -> dict:
        tower.zero_grad()
        tower.pack = pack
        tower.set_grad_checkpointing(checkpointing)
        states, pooled = tower(tok["input_ids"], tok["attention_mask"], 1, tok["token_index"])
        ((states * weights)[real].sum() + pooled.square().sum()).backward()
        return {n: p.grad.clone() for n, p in tower.named_parameters() if p.grad is not None}

    padded = grads(False, False)
    for checkpointing in (False, True):
        packed = grads(True, checkpointing)
        assert packed.keys() == padded.keys() and len(packed) > 10
        for name in padded:
            torch.testing.assert_close(packed[name], padded[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_tokenizer_gives_the_real_tokens_positions():
    tok = build_tokenizer("tiny", 32)(TEXTS)
    mask = tok["attention_mask"]
    index = tok["token_index"]
    assert index.dtype == torch.long and index.shape == (int(mask.sum()),)
    assert torch.equal(index, packing_index(mask))
    rows, cols = index // mask.shape[1], index % mask.shape[1]
    assert mask[rows, cols].all() and torch.equal(rows, rows.sort().values)  # row by row


def test_a_layout_it_cannot_pack_runs_padded():
    from transformers import BertConfig, BertModel

    decoder = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32, is_decoder=True, add_cross_attention=True))
    assert not supports_packing(decoder)
    assert not supports_packing(torch.nn.Linear(2, 2))
    from cxrdr.train.models.text_towers import HFTextTower

    tower = HFTextTower(decoder, "cls")
    assert tower.pack is False


def test_a_compiled_packed_layer_is_one_graph_for_every_layer_and_batch():
    """compiling.compile_blocks compiles ``packed_layer`` for dynamic shapes: the layers of the tower share it, and
    the batches' token counts, lengths and sizes differ: not a compilation per layer or batch."""
    from torch._dynamo.testing import CompileCounter

    tower, tokenizer = _tower("tiny")
    tower.eval()
    counter = CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(packed_layer, backend=counter, dynamic=True)  # as compile_blocks does
    try:
        with torch.no_grad():
            for texts in (TEXTS, TEXTS[:3], TEXTS[1:], TEXTS[::2]):
                tok = tokenizer(texts)
                args = (tok["input_ids"], tok["attention_mask"], tok["token_index"])
                eager = encode_packed(tower.model, *args)[0]
                torch.testing.assert_close(encode_packed(tower.model, *args, layer_fn=compiled)[0], eager)
    finally:
        torch._dynamo.reset()
    assert len(tower.model.encoder.layer) >= 2 and counter.frame_count == 1


def test_the_loop_hands_the_packing_index_to_the_text_tower(phantom_shards, tmp_path, monkeypatch):
    """Reports and captions reach the tower with the tokenizer's index (on a GPU the tower cannot read it from the
    mask without a sync), stacked into one call; --no-pack-text runs them padded, in two."""
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer
    from cxrdr.train.models import text_towers

    seen = []
    forward = text_towers.HFTextTower.forward

    def spy(self, input_ids, attention_mask, token_layer=None, token_index=None):
        seen.append((self.pack, token_index is not None and token_index.numel() == int(attention_mask.sum()),
                     input_ids.shape[0]))
        return forward(self, input_ids, attention_mask, token_layer, token_index)

    monkeypatch.setattr(text_towers.HFTextTower, "forward", spy)
    for pack in (True, False):
        seen.clear()
        trainer = Trainer(TrainConfig(shards=str(phantom_shards), model="tiny-D", out=str(tmp_path / str(pack)),
                                      steps=1, batch_size=4, workers=0, progress=False, device="cpu", log_every=1,
                                      save_every=0, eval_every=0, pack_text=pack))
        trainer.run()
        assert trainer.student.text_tower.pack is pack
        # the step's report and caption forwards: packed with the loader's index in one call, or padded in two
        step_calls = [(True, True, 8)] if pack else [(False, False, 4), (False, False, 4)]
        assert seen[:len(step_calls)] == step_calls and all(rows != 4 for *_, rows in seen[len(step_calls):])


def test_stacked_batches_give_each_batch_its_own_states():
    """Reports and captions in one packed call (stack_token_batches): each row's states and pooled vector are those
    of its own batch's call, whatever the other batch's length."""
    tower, tokenizer = _tower("tiny")
    tower.eval()
    reports, captions = tokenizer(TEXTS), tokenizer(["effusion.", "no pneumothorax.", "normal.", "cardiomegaly."])
    assert captions["input_ids"].shape[1] < reports["input_ids"].shape[1]  # the captions are right-padded
    ids, mask, index = stack_token_batches([tuple(b[k] for k in ("input_ids", "attention_mask", "token_index"))
                                            for b in (captions, reports)])
    assert ids.shape == (8, max(reports["input_ids"].shape[1], captions["input_ids"].shape[1]))
    assert torch.equal(index, packing_index(mask))  # the index of the stacked grid, made without reading the mask
    with torch.no_grad():
        states, pooled = tower(ids, mask, 1, index)
        for rows, batch in ((slice(0, 4), captions), (slice(4, 8), reports)):
            alone, alone_pooled = tower(batch["input_ids"], batch["attention_mask"], 1, batch["token_index"])
            real = batch["attention_mask"].bool()
            torch.testing.assert_close(states[rows, :real.shape[1]][real], alone[real], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(pooled[rows], alone_pooled, rtol=1e-4, atol=1e-5)


def test_a_step_with_reports_and_captions_in_one_call_gives_the_two_calls_losses(phantom_shards, tmp_path):
    """The Task's loss terms, caption terms included, are those of separate padded calls (eval mode: no dropout)."""
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer

    trainer = Trainer(TrainConfig(shards=str(phantom_shards), model="tiny-D", out=str(tmp_path / "run"), steps=1,
                                  batch_size=4, workers=0, progress=False, device="cpu", eval_every=0))
    batch = next(trainer._batches())
    trainer.student.eval()
    terms = {}
    for pack in (True, False):
        trainer.student.text_tower.pack = pack
        torch.manual_seed(1)  # the local loss draws tokens
        with torch.no_grad():
            terms[pack] = {k: float(v) for k, v in trainer.task.forward(dict(batch), trainer.step).items()}
    assert {"clip_syn", "distill_syn", "local"} <= terms[True].keys() == terms[False].keys()
    assert terms[True] == pytest.approx(terms[False], rel=1e-5, abs=1e-6)


def test_text_padding_benchmark_counts_less_work_packed():
    """benchmarks/text_padding.py: per text kind, the padded length, the real tokens per text and the forward +
    backward FLOPs padded and packed (packed the smaller, as the batch holds padding); its timing is optional."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import text_padding

    rows = text_padding.measure("tiny", context=32, batch_size=6, timed=True, repeats=1)
    assert [r["texts"] for r in rows] == ["report", "caption"]
    for r in rows:
        assert 0 < r["real_tokens_per_text"] < r["padded_length"] <= 32
        assert 0 < r["packed_gflops_per_text"] < r["padded_gflops_per_text"]
        assert r["padded_ms"] > 0 and r["packed_ms"] > 0


def test_the_packed_attention_on_sequence_offsets_gives_the_grids_states_and_gradients(monkeypatch):
    """Where FlashAttention's variable-length kernel applies (a GPU: here its computation stands in, on the CPU),
    the layers attend on the packed tokens by their row offsets: the grid's states and gradients, for a step's
    reports and captions stacked on one grid."""
    import cxrdr.train.models.packed_text as packed_text

    tower, tokenizer = _tower("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    tower.train()
    reports, captions = tokenizer(TEXTS), tokenizer(["effusion.", "no pneumothorax.", "cardiomegaly.", "clear."])
    ids, mask, index = stack_token_batches([(t["input_ids"], t["attention_mask"], t["token_index"])
                                            for t in (reports, captions)])
    offsets = packed_text.sequence_offsets(mask)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, *mask.sum(1).cumsum(0).tolist()]
    weights = torch.randn(mask.shape + (tower.width,))
    calls = []

    def run(varlen: bool):
        monkeypatch.setattr(packed_text, "flash_varlen_applies", lambda x, head_dim: varlen)
        monkeypatch.setattr(packed_text, "flash_varlen", lambda *a: calls.append(a[3]) or reference_varlen(*a))
        tower.zero_grad()
        states, pooled = tower(ids, mask, None, index)
        ((states * weights)[mask.bool()].sum() + pooled.square().sum()).backward()
        return states, {n: p.grad.clone() for n, p in tower.named_parameters() if p.grad is not None}

    grid_states, grid_grads = run(False)
    assert not calls
    varlen_states, varlen_grads = run(True)
    assert len(calls) == tower.depth and all(torch.equal(c, offsets) for c in calls)
    torch.testing.assert_close(varlen_states, grid_states, rtol=1e-4, atol=1e-5)
    assert varlen_grads.keys() == grid_grads.keys()
    for name, grad in grid_grads.items():
        # float32 sums of terms up to the gradient's largest entry: entries that cancel to near 0 carry its rounding
        scale = max(1.0, grad.abs().max().item())
        torch.testing.assert_close(varlen_grads[name], grad, rtol=1e-4, atol=1e-6 * scale, msg=name)


def test_a_refused_packed_attention_warns_once_and_attends_on_the_grid(monkeypatch):
    import cxrdr.train.models.packed_text as packed_text

    tower, tokenizer = _tower("tiny")
    tower.eval()
    tok = tokenizer(TEXTS)
    with torch.no_grad():
        expected = tower(tok["input_ids"], tok["attention_mask"], None, tok["token_index"])[0]
    calls = []

    def refuses(*args):
        calls.append(1)
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    monkeypatch.setattr(packed_text, "_flash_varlen_failed", False)
    monkeypatch.setattr(packed_text, "flash_varlen_applies", lambda x, head_dim: not packed_text._flash_varlen_failed)
    monkeypatch.setattr(packed_text, "flash_varlen", refuses)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="Ampere GPUs or newer.*attend on the padded grid"):
        got = tower(tok["input_ids"], tok["attention_mask"], None, tok["token_index"])[0]
    torch.testing.assert_close(got, expected)
    with torch.no_grad():
        tower(tok["input_ids"], tok["attention_mask"], None, tok["token_index"])
    assert len(calls) == 1  # not tried again


def test_text_graphs_pad_the_packed_tokens_to_a_bucket_and_give_the_unpadded_states_and_gradients(monkeypatch):
    """--cuda-graphs-text (a stand-in for the capture and for FlashAttention on the CPU): the layers run on the packed
    tokens padded to their bucket, the padding one sequence of its own within the length bound, as one graph per run
    of layers and bucket; the real tokens' states and the gradients are the unpadded run's."""
    import cxrdr.train.models.packed_text as packed_text
    from cxrdr.train.models.block_graphs import BlockGraphs

    tower, tokenizer = _tower("tiny", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    tower.train()
    calls, captured = [], []

    def varlen(q, k, v, offsets, max_length, dropout_p, scale):
        assert int(offsets.diff().max()) <= max_length  # every sequence, the padding's too, within the bound
        calls.append((q.shape[0], max_length))
        return reference_varlen(q, k, v, offsets, max_length, dropout_p, scale)

    def stand_in(module, *inputs):
        captured.append((len(module), tuple(inputs[0].shape)))
        return module

    monkeypatch.setattr(packed_text, "flash_varlen_applies", lambda x, head_dim: True)
    monkeypatch.setattr(packed_text, "flash_varlen", varlen)

    def run(tok, token_layer, graphs):
        tower.block_graphs = graphs
        tower.zero_grad()
        states, pooled = tower(tok["input_ids"], tok["attention_mask"], token_layer, tok["token_index"])
        weights = torch.linspace(-1, 1, states.numel()).view_as(states)
        ((states * weights).sum() + pooled.square().sum()).backward()
        return states, {n: p.grad.clone() for n, p in tower.named_parameters() if p.grad is not None}

    graphs = BlockGraphs(capture=stand_in, on_device=lambda x: True)
    graphs.active = True
    tok = tokenizer(TEXTS)
    real = int(tok["attention_mask"].sum())
    bucket, padded = packed_text.pack_bucket(real), packed_text.padded_rows(real)
    assert padded % bucket == 0 and real < padded <= real + bucket
    for token_layer, runs in ((None, [(2, (padded, tower.width))]), (1, [(1, (padded, tower.width))] * 2)):
        calls.clear()
        eager_states, eager_grads = run(tok, token_layer, None)
        assert calls == [(real, tok["input_ids"].shape[1])] * tower.depth  # unpadded, bounded by the grid's length
        calls.clear()
        graphed_states, graphed_grads = run(tok, token_layer, graphs)
        assert calls == [(padded, packed_text.graph_max_length(tower.model, bucket))] * tower.depth
        assert captured[-len(runs):] == runs
        torch.testing.assert_close(graphed_states, eager_states, rtol=1e-5, atol=1e-6)
        assert graphed_grads.keys() == eager_grads.keys()
        for name in eager_grads:
            torch.testing.assert_close(graphed_grads[name], eager_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    assert graphs.captured("text") == 3 and graphs.captured("image") == 0
    other = tokenizer(TEXTS[:3] + ["no acute process."])  # fewer real tokens, the same bucket: no new graph
    assert packed_text.padded_rows(int(other["attention_mask"].sum())) == padded
    run(other, None, graphs)
    assert len(captured) == 3


def test_the_pack_bucket_pads_by_at_most_a_sixteenth_and_keeps_sizes_few():
    from cxrdr.train.models.packed_text import pack_bucket, padded_rows

    assert pack_bucket(21_658) == 1024 and pack_bucket(40) == 64 and pack_bucket(2_000) == 64
    assert padded_rows(21_658) == 22_528 and padded_rows(2_048) == 2_176  # a full bucket still gets a padding row
    for tokens in range(1_024, 60_000, 37):
        bucket = pack_bucket(tokens)
        assert bucket & (bucket - 1) == 0 and 0 < padded_rows(tokens) - tokens <= tokens / 16
    sizes = {padded_rows(t) for t in range(20_800, 22_500)}  # ~ +-2 sd of the tokens at batch 256
    assert len(sizes) <= 3
