"""The frozen stem's memo (cxrdr/train/models/frozen_memo.py): the same outputs, the same training run."""
from __future__ import annotations

import json

import pytest
import torch

from cxrdr.train.models.frozen_memo import RowMemo, enable_memos, in_chunks, suspended
from cxrdr.train.models.hybrid_tower import lite0_stem

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def stem():
    torch.manual_seed(0)
    return lite0_stem(8, pretrained=False, frozen=True)


def test_a_row_memo_computes_only_new_rows_and_stays_within_its_bytes():
    calls = []

    def double(x):
        calls.append(len(x))
        return x * 2

    x = torch.arange(12.0).reshape(4, 3)
    memo = RowMemo(max_bytes=3 * 12)  # three rows of 3 floats
    assert torch.equal(memo(double, x[:2], context=("w", 1)), x[:2] * 2)
    assert torch.equal(memo(double, x[[1, 3, 0]], context=("w", 1)), x[[1, 3, 0]] * 2)
    assert calls == [2, 1] and (memo.hits, memo.misses) == (2, 3)
    memo(double, x[[2]], context=("w", 1))  # a fourth row: the least recently used one (row 1) goes
    assert len(memo.rows) == 3 and memo.bytes == 36
    memo(double, x[[1]], context=("w", 1))
    assert calls[-1] == 1
    memo(double, x[[1]], context=("w", 2))  # other weights: nothing remembered is used
    assert calls[-1] == 1 and memo.describe()["rows"] == 1
    same_bytes_other_shape = x[:2].reshape(2, 1, 3)
    memo(double, same_bytes_other_shape, context=("w", 2))
    assert calls[-1] == 2  # a key holds the row's shape, not only its bytes


def test_rows_in_chunks_give_the_same_bits_whatever_else_their_batch_holds(stem):
    """On one thread a batch of 1-15 rows through the stem rounds differently from one of 16 or more (oneDNN's choice
    of kernel); in chunks of 16 a row's output is the same in any batch."""
    x = torch.rand(40, 3, 64, 64)
    with torch.no_grad():
        whole = in_chunks(stem._features, x)
        assert whole.shape == (40, *stem._features(x[:1]).shape[1:])
        for rows in ([3], [7, 1, 30], list(range(5, 22)), list(range(39, -1, -1))):
            assert torch.equal(in_chunks(stem._features, x[rows]), whole[rows])
        assert torch.equal(stem._features(x), whole)  # here as the whole batch rounds (16 or more rows)


def test_the_stem_gives_the_same_bits_with_its_memo_and_forgets_when_its_weights_change(stem):
    x = torch.rand(6, 3, 32, 32)
    with torch.no_grad():
        direct = in_chunks(stem._features, x)  # the rows as the memo computes them, 16 a call
    [memo] = enable_memos(stem, max_mb=16)
    try:
        assert torch.equal(stem(x[:4]), direct[:4])
        assert torch.equal(stem(x[[5, 0, 2, 4]]), direct[[5, 0, 2, 4]])  # partly remembered, partly new
        assert torch.equal(stem(torch.cat([x, x[:1]])), torch.cat([direct, direct[:1]]))
        assert (memo.hits, memo.misses) == (2 + 7, 4 + 2)
        with suspended(stem):
            assert stem.output_memo is None
            stem(x)
        assert memo.hits == 9 and stem.output_memo is memo

        changed = {k: v * 0.5 if v.is_floating_point() else v for k, v in stem.state_dict().items()}
        stem.load_state_dict(changed)  # written in place: the remembered rows are another stem's
        with torch.no_grad():
            expected = in_chunks(stem._features, x)
        assert not torch.equal(expected, direct)
        assert torch.equal(stem(x), expected) and memo.misses == 6 + 6
    finally:
        stem.output_memo = None


SMALL = {  # the recipes at 32 px, untrained weights: a hybrid of one block, an EfficientNet with stages 0-3 frozen
    "cpu-D": {"image_size": 32, "image_kwargs": {"stem_stride": 8, "width": 32, "depth": 1, "num_heads": 2,
                                                 "mlp_ratio": 2.0, "freeze_stem": True, "pretrained": False}},
    "tiny-cnn-D": {"image_size": 32, "image_kwargs": {"stride": 16, "freeze_stages": 4, "pretrained": False}},
}


@pytest.mark.parametrize("model", SMALL)
def test_a_training_run_is_the_same_with_and_without_the_memo(model, phantom_shards, tmp_path):
    """A student with frozen layers on stored views that repeat: the same metrics at every step (batches of 16: the
    whole batch rounds as the memo's 16-row calls do, where batches of 1-15 round otherwise on one thread)."""
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import train

    common = dict(shards=str(phantom_shards), model=model, model_overrides=SMALL[model], steps=8, batch_size=16,
                  workers=0, progress=False, device="cpu", log_every=1, eval_every=0, balance_every=0)
    summaries = {mb: train(TrainConfig(out=str(tmp_path / f"memo{mb}"), frozen_memo_mb=mb, **common))
                 for mb in (0, 64)}
    assert summaries[0]["frozen_memo"] is None
    [used] = summaries[64]["frozen_memo"]
    assert used["hits"] > 0 and used["misses"] > 0

    def numbers(run):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        timings = ("samples_per_s", "eval_phase_s")
        return [{k: v for k, v in r.items() if "time" not in k and k not in timings} for r in rows]

    assert numbers("memo0") == numbers("memo64")


def test_a_plain_run_whose_views_never_repeat_gets_no_memo(phantom_shards, tmp_path):
    """--mode plain draws a fresh view each time: a memo would hash every row and find none (only reinforced runs
    replay their stored views), so the loop gives none; the summary says so."""
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer

    common = dict(shards=str(phantom_shards), model="tiny-cnn-D", model_overrides=SMALL["tiny-cnn-D"], workers=0,
                  progress=False, device="cpu", frozen_memo_mb=64)
    assert Trainer(TrainConfig(out=str(tmp_path / "plain"), mode="plain", **common)).memos == []
    assert len(Trainer(TrainConfig(out=str(tmp_path / "reinforced"), **common)).memos) == 1


def test_a_run_resumed_with_an_empty_memo_logs_what_the_uninterrupted_run_did(phantom_shards, tmp_path):
    """The resumed process remembers nothing: it computes the rows the uninterrupted one took from its memo."""
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer, train

    common = dict(shards=str(phantom_shards), model="cpu-D", model_overrides=SMALL["cpu-D"], steps=10, batch_size=16,
                  workers=0, progress=False, device="cpu", log_every=1, eval_every=0, balance_every=0)
    train(TrainConfig(out=str(tmp_path / "whole"), **common))
    cut = Trainer(TrainConfig(out=str(tmp_path / "cut"), **common))
    batches = cut._batches()
    for _ in range(6):
        cut.train_step(batches, log_balance=False)
    cut.save("last.pt")
    assert cut.memos[0].hits > 0
    del cut, batches
    resumed = train(TrainConfig(out=str(tmp_path / "cut"), resume=True, **common))
    assert resumed["start_step"] == 6 and resumed["frozen_memo"][0]["misses"] > 0

    def losses(run):
        rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if r["kind"] == "train" and r["step"] > 6}

    assert losses("cut") == losses("whole") and len(losses("whole")) == 4


def test_the_memo_ab_benchmark_times_one_run_with_its_memo_on_and_off(phantom_shards, tmp_path):
    """benchmarks/frozen_memo_ab.py: one trainer, blocks with the memo on and suspended in turn (on, off, off, on)."""
    from cxrdr.train.config import TrainConfig
    from cxrdr.train.loop import Trainer
    from tests.script_loader import load_script

    bench = load_script("benchmarks/frozen_memo_ab.py")
    assert [bench.memo_on(b) for b in range(8)] == [True, False, False, True] * 2
    trainer = Trainer(TrainConfig(shards=str(phantom_shards), model="tiny-cnn-D", model_overrides=SMALL["tiny-cnn-D"],
                                  batch_size=16, workers=0, progress=False, device="cpu", out=str(tmp_path / "run")))
    result = bench.measure(trainer, warmup=1, blocks=4, block=1)
    assert result["on_ms"] > 0 and result["off_ms"] > 0
    [memo] = result["memo"]
    assert memo["hits"] + memo["misses"] == 3 * 16  # the warm-up step and the two blocks on; the off blocks count none

