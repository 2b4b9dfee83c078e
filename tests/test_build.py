"""`reinforce build` and the shard tooling (merge, resume, ranks, add-teacher, inspect, verify).

Small real builds: phantom:16 records, K=2 augmentations, S=2 captions, 64 px stored images,
teachers random:tiny + text:minilm (loaded once per session and handed to ``build``).
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from cxrdr.common.augment import replay
from cxrdr.common.shards import SCHEMA_VERSION, check_stored_meta, iter_tar_samples, load_meta, read_dataset_info
from cxrdr.reinforce.build import BuildOptions, build
from cxrdr.reinforce.summary import summary_text
from cxrdr.common.errors import UserError
from cxrdr.common.labels import CHEXPERT14
from cxrdr.common.shards import npy_load, sample_embedding
from cxrdr.reinforce.verify import verify
from cxrdr.reinforce.writer import TarOut, is_shard_complete
from tests import forked_cli

REPO = Path(__file__).resolve().parents[1]

N = 16
SOURCE_SEED = 4  # phantom seed whose first 16 studies span train (12), val (2) and test (2)
SPEC = "random:tiny,text:minilm"


def options(out, **overrides) -> BuildOptions:
    base = dict(source=f"phantom:{N}", teachers=SPEC, out=Path(out), n_aug=2, n_captions=2, store_size=64,
                shard_size=4, workers=1, batch_size=4, device="cpu", progress=False, merge_timeout=120,
                source_options={"seed": SOURCE_SEED})
    base.update(overrides)
    return BuildOptions(**base)


def read_samples(shards_dir) -> dict[str, dict]:
    info = read_dataset_info(shards_dir)
    out = {}
    for shard in info["shards"]:
        for key, sample in iter_tar_samples(Path(shards_dir) / shard["name"]):
            out[key] = sample
    return out


def manifest_rows(shards_dir) -> list[dict]:
    return pq.read_table(Path(shards_dir) / "manifest.parquet").to_pylist()


def assert_same_samples(a: dict, b: dict, atol: float = 2e-3) -> None:
    """Same keys and members; images/json/txt byte-identical, embeddings equal within atol."""
    assert list(a) == list(b)
    for key in a:
        assert sorted(a[key]) == sorted(b[key]), key
        for ext in a[key]:
            if ext.endswith(".npy"):
                np.testing.assert_allclose(npy_load(a[key][ext]).astype(np.float32),
                                           npy_load(b[key][ext]).astype(np.float32), atol=atol, err_msg=key)
            else:
                assert a[key][ext] == b[key][ext], (key, ext)


def app():
    import typer

    from cxrdr.reinforce.add_teacher import cli_add_teacher
    from cxrdr.reinforce.build_cli import cli_build
    from cxrdr.reinforce.inspect import cli_inspect
    from cxrdr.reinforce.manifest import cli_merge
    from cxrdr.reinforce.verify import cli_verify

    a = typer.Typer()
    for name, fn in [("build", cli_build), ("merge", cli_merge), ("inspect", cli_inspect),
                     ("verify", cli_verify), ("add-teacher", cli_add_teacher)]:
        a.command(name)(fn)
    return a


@pytest.fixture(scope="session")
def teachers():
    from cxrdr.teachers import load_teachers

    return load_teachers(SPEC, device="cpu")


@pytest.fixture(scope="session")
def fresh(tmp_path_factory, teachers) -> Path:
    out = tmp_path_factory.mktemp("fresh")
    build(options(out, workers=2), teachers=teachers)
    return out


@pytest.fixture(scope="session")
def plain(tmp_path_factory, teachers) -> Path:
    """The same build as uncompressed tars (--compression none), for byte surgery on tar members."""
    out = tmp_path_factory.mktemp("plain")
    build(options(out, workers=0, compression="none"), teachers=teachers)
    return out


def test_fresh_build_follows_the_contract(fresh):
    problems, totals = verify(fresh)
    assert problems == []
    info = read_dataset_info(fresh)
    assert [t["name"] for t in info["teachers"]] == ["random-tiny", "minilm"]
    assert info["teachers"][0].get("test_only") is True
    assert info["total_samples"] == N == sum(info["counts"].values()) == totals["samples"]
    assert (info["n_aug"], info["n_captions"], info["store_size"], info["emb_dtype"]) == (2, 2, 64, "float16")
    assert set(info["bytes_per_sample"]) >= {"image", "text", "json", "random-tiny", "minilm", "total"}
    assert set(info["build"]["time_split_seconds"]) == {"decode_augment", "teacher", "write", "loader_wait", "write_wait"}
    assert info["build"]["samples_per_second"] > 0
    sizes = json.loads((fresh / "sizes.json").read_text())
    assert sizes == {s["name"]: s["samples"] for s in info["shards"]}
    assert info["build"]["ranks"][0]["replay"] == "cpu"  # --replay auto on a CPU teacher: the workers replay
    choice = info["build"]["ranks"][0]["cpu_threads"]  # where the CPU policy prepared, and why
    assert choice["workers"] == 2 and choice["workers_used"] in (0, 2) and choice["teacher_threads"] >= 1
    assert choice["prepare_ms_per_sample"] > 0 and choice["teacher_ms_per_sample"] > 0
    assert choice["line"].startswith(f"cpu threads: teacher {choice['teacher_threads']} thread")
    assert ("in this process instead of 2 workers" in choice["line"]) == (choice["workers_used"] == 0)

    rows = manifest_rows(fresh)
    assert len(rows) == N and len({r["key"] for r in rows}) == N
    assert set(CHEXPERT14) <= set(rows[0]) and rows[0]["n_aug"] == 2 and rows[0]["n_captions"] == 2
    # Shards never mix splits, and splits come in the order train, val, test.
    split_of = {}
    for r in rows:
        assert split_of.setdefault(r["shard"], r["split"]) == r["split"]
    order = [split_of[s["name"]] for s in info["shards"]]
    assert order == sorted(order, key=["train", "val", "test"].index)
    assert info["counts"] == {"train": 12, "val": 2, "test": 2} and len(info["shards"]) == 5

    key, sample = next(iter(read_samples(fresh).items()))
    assert sample_embedding(sample, "random-tiny", "img").shape == (2, 64)
    assert sample_embedding(sample, "random-tiny", "syn").shape == (2, 64)
    assert sample_embedding(sample, "random-tiny", "txt").shape == (64,)
    assert sample_embedding(sample, "minilm", "syn").shape[0] == 2
    assert sample_embedding(sample, "minilm", "img") is None  # text-only teacher
    # Schema 2: one member per teacher, rows img (K), syn (S), txt (1).
    assert set(sample) == {"jpg", "txt", "json", "random-tiny.npy", "minilm.npy"}
    stored = npy_load(sample["random-tiny.npy"])
    assert stored.dtype == np.float16 and stored.shape == (2 + 2 + 1, 64)
    np.testing.assert_array_equal(stored[:2].astype(np.float32), sample_embedding(sample, "random-tiny", "img"))
    assert npy_load(sample["minilm.npy"]).shape == (2 + 1, 384)
    meta = json.loads(sample["json"])
    assert meta["key"] == key and len(meta["captions"]) == 2 and len(meta["aug"]) == 2
    assert min(meta["image_size"]) == 64 and len(meta["label_vector"]) == 14
    for box in meta["boxes"]:
        x0, y0, x1, y1 = box["box"]
        assert 0 <= x0 <= x1 <= meta["image_size"][0] + 1 and 0 <= y0 <= y1 <= meta["image_size"][1] + 1


def test_stored_embeddings_are_those_of_the_replayed_stored_pixels(fresh, teachers):
    """Stage 2 decodes the stored image, replays aug[k]: the teacher saw exactly that tensor."""
    tiny, minilm = teachers
    for key, sample in list(read_samples(fresh).items())[:3]:
        meta = load_meta(sample["json"])
        image = Image.open(io.BytesIO(sample["jpg"])).convert("L")
        crops = torch.stack([replay(image, p, tiny.image_size) for p in meta["aug"]])
        expected = tiny.encode_images(crops).numpy()
        np.testing.assert_allclose(sample_embedding(sample, "random-tiny", "img"), expected, atol=2e-3)
        texts = [sample["txt"].decode()] + [c["text"] for c in meta["captions"]]
        expected = minilm.encode_texts(texts).numpy()
        np.testing.assert_allclose(sample_embedding(sample, "minilm", "txt"), expected[0], atol=2e-3)
        np.testing.assert_allclose(sample_embedding(sample, "minilm", "syn"), expected[1:], atol=2e-3)


def test_cpu_teacher_threads_leave_the_workers_the_cores_they_need():
    from cxrdr.reinforce.cpu_policy import teacher_threads

    # issue 26: an open_clip ViT-B-32 (940 ms CPU a sample on 2 cores) beside 10 ms of preparation:
    # the worker needs a twentieth of a core, rounded up to one, so the teacher gets the other one
    assert teacher_threads(10, 940, cores=2, workers=1, cap=2) == (1, pytest.approx(2 * 10 / 950))
    # random:tiny is preparation-bound (8 ms vs 2.4 ms): the workers keep their cores
    assert teacher_threads(8, 2.4, cores=2, workers=2, cap=2)[0] == 1
    assert teacher_threads(8, 2.4, cores=16, workers=2, cap=16) == (14, 2.0)  # 2 workers use 2 cores at most
    # a heavy teacher on many cores: preparation needs a third of a core, one is left to it
    assert teacher_threads(10, 470, cores=16, workers=2, cap=16)[0] == 15
    assert teacher_threads(10, 470, cores=16, workers=2, cap=4)[0] == 4  # never above torch's threads
    # cores in proportion to the CPU each stage needs; at least one thread
    assert teacher_threads(20, 20, cores=4, workers=4, cap=4)[0] == 2
    assert teacher_threads(20, 60, cores=4, workers=4, cap=4)[0] == 3
    assert teacher_threads(20, 61, cores=4, workers=4, cap=4)[0] == 3
    assert teacher_threads(100, 0.1, cores=2, workers=2, cap=2)[0] == 1
    # no workers: preparation runs between the forwards, the teacher gets every core
    assert teacher_threads(50, 1, cores=4, workers=0, cap=4) == (4, 0.0)


def test_preparation_runs_where_a_sample_costs_less():
    from cxrdr.reinforce.cpu_policy import where_to_prepare

    # issue 26, 2 cores, 1 worker given. MiniLM (29.4 ms a sample on both cores) beside 2 ms of
    # preparation: with the worker the teacher would get one core (58.8 ms a sample); preparing in
    # this process in turn takes 31.4 -> this process, the teacher on every core
    c = where_to_prepare(2.0, 29.4, cores=2, workers=1, cap=2)
    assert (c["workers_used"], c["teacher_threads"]) == (0, 2)
    assert c["in_process_ms"] == pytest.approx(31.4) and c["with_workers_ms"] == pytest.approx(58.8)
    # an open_clip ViT: the same
    assert where_to_prepare(9.0, 330.0, cores=2, workers=1, cap=2)["workers_used"] == 0
    # random:tiny is preparation-bound: the worker prepares while the teacher runs on the other core
    c = where_to_prepare(6.7, 1.0, cores=2, workers=1, cap=2)
    assert (c["workers_used"], c["teacher_threads"]) == (1, 1)
    assert c["with_workers_ms"] == pytest.approx(6.7) and c["in_process_ms"] == pytest.approx(7.7)
    # many cores: MiniLM on 14 threads beside 2 workers beats preparing 6 ms a sample in turn
    c = where_to_prepare(6.0, 5.0, cores=16, workers=2, cap=16)
    assert (c["workers_used"], c["teacher_threads"]) == (2, 14)
    assert c["with_workers_ms"] == pytest.approx(5.0 * 16 / 14)
    # no workers given: this process, every core (never above torch's threads)
    assert where_to_prepare(50.0, 1.0, cores=4, workers=0, cap=3) == {
        "workers_used": 0, "teacher_threads": 3, "in_process_ms": 51.0, "with_workers_ms": None,
        "prepare_cores": 0.0}


def test_the_cpu_policy_probes_two_batches_in_this_process_then_prints_one_line(monkeypatch):
    from types import SimpleNamespace

    from cxrdr.reinforce import cpu_policy

    lines, threads = [], torch.get_num_threads()
    monkeypatch.setattr(cpu_policy, "available_cores", lambda: 2)
    say = lambda line, file=None: lines.append(line)  # noqa: E731
    try:
        torch.set_num_threads(2)
        policy = cpu_policy.CpuPolicy([SimpleNamespace(device="cpu")], workers=1, say=say)
        policy.start()
        assert torch.get_num_threads() == 2 and lines == [] and policy.probe_records(16) == 32
        policy.observe(0.32, 0.8, 16)  # the first batch (first-call costs) decides nothing
        assert torch.get_num_threads() == 2 and lines == []
        policy.observe(0.32, 0.032, 16)  # the second: preparation 20 ms, teacher 2 ms -> the worker
        assert torch.get_num_threads() == 1 and len(lines) == 1 and policy.workers_to_use() == 1
        assert lines[0] == ("cpu threads: teacher 1 thread, 1 worker: per sample, preparation 20.0 ms and the "
                            "teacher 2.0 ms on 2 threads; with 1 worker about 20.0 ms, in this process 22.0 ms")
        policy.observe(0.0, 1.0, 16)  # later batches change nothing
        policy.settle()
        assert torch.get_num_threads() == 1 and len(lines) == 1
        assert policy.result()["cpu_threads"]["workers_used"] == 1

        torch.set_num_threads(2)
        heavy = cpu_policy.CpuPolicy([SimpleNamespace(device="cpu")], workers=1, say=say)
        heavy.start()
        heavy.observe(0.032, 0.47, 16)  # the build ended within the probe: settle decides
        heavy.settle()
        assert heavy.workers_to_use() == 0 and torch.get_num_threads() == 2 and len(lines) == 2
        assert lines[1].startswith("cpu threads: teacher 2 threads, preparation in this process instead of "
                                   "1 worker: per sample, preparation 2.0 ms and the teacher 29.4 ms")

        torch.set_num_threads(2)
        skipped = cpu_policy.CpuPolicy([SimpleNamespace(device="cpu")], workers=1, say=say)
        skipped.start()
        skipped.observe(0.0, 0.1, 0)  # every probe record skipped: nothing measured
        assert skipped.workers_to_use() == 1 and torch.get_num_threads() == 1  # the worker keeps its core
        assert lines[2] == "cpu threads: teacher 1 thread, 1 worker: no probe batch was measured"

        torch.set_num_threads(2)  # a GPU teacher: no probe; the build's process keeps to the core left
        gpu = cpu_policy.CpuPolicy([SimpleNamespace(device="cuda:0")], workers=1, say=say)
        gpu.start()
        assert gpu.probe_records(16) == 0 and gpu.workers_to_use() == 1 and torch.get_num_threads() == 1
        gpu.observe(0.08, 0.4, 16)
        gpu.settle()
        assert len(lines) == 3 and torch.get_num_threads() == 1  # nothing printed, nothing changed
        assert gpu.result()["cpu_threads"] == {"teacher_threads": 1, "workers": 1, "workers_used": 1, "cores": 2,
                                               "line": "cpu threads: the build's process 1, 1 worker (GPU teacher)"}
        torch.set_num_threads(2)
        alone = cpu_policy.CpuPolicy([SimpleNamespace(device="cuda:0")], workers=0, say=say)
        alone.start()  # no workers: every core stays the build's
        assert torch.get_num_threads() == 2 and alone.result() == {}
    finally:
        torch.set_num_threads(threads)


def test_preparation_cpu_counts_the_preparing_thread_only():
    """Stage CPU seconds are the preparing thread's: a thread of the same process that computes
    meanwhile (as the writer and the teacher's threads do beside preparation in the build's
    process) adds nothing, so no record's stages sum to more than its wall time."""
    import threading

    from cxrdr.common.augment import AugConfig
    from cxrdr.reinforce.phantom import PhantomSource
    from cxrdr.reinforce.prepare import PrepareSpec, prepare_record

    spec = PrepareSpec(images=True, store_size=64, image_format="jpg", jpeg_quality=95, n_aug=2, n_captions=2,
                       aug=AugConfig(), seed=0, sizes=(32,))
    stop, a = threading.Event(), np.random.default_rng(0).random((300, 300))

    def busy():  # matmul releases the GIL: CPU on the other core while preparation runs
        while not stop.is_set():
            a @ a

    neighbour = threading.Thread(target=busy, daemon=True)
    neighbour.start()
    try:
        prepared = [prepare_record(0, f"{i:06d}", rec, spec) for i, rec in enumerate(PhantomSource(6, size=96))]
    finally:
        stop.set()
        neighbour.join()
    for b in prepared:
        assert set(b["stage_seconds"]) == {"load_resize", "encode_decode", "params_replay", "captions", "rest"}
        assert all(v >= -1e-4 for v in b["stage_seconds"].values()), b["stage_seconds"]
        assert sum(b["stage_seconds"].values()) <= b["prep_seconds"] + 1e-4, (b["stage_seconds"], b["prep_seconds"])


def test_shards_prepared_in_workers_equal_those_prepared_in_this_process(fresh, teachers, tmp_path, monkeypatch):
    from cxrdr.reinforce.cpu_policy import CpuPolicy

    monkeypatch.setattr(CpuPolicy, "PROBE", 0)  # no probe: every record goes to the 2 workers
    info = build(options(tmp_path / "workers", workers=2), teachers=teachers)
    assert info["build"]["ranks"][0]["cpu_threads"]["workers_used"] == 2
    assert manifest_rows(tmp_path / "workers") == manifest_rows(fresh)
    assert_same_samples(read_samples(tmp_path / "workers"), read_samples(fresh))


def test_device_replay_builds_the_shards_of_cpu_replay(fresh, teachers, tmp_path, monkeypatch):
    """--replay device: the workers only decode and this process replays each batch's views at once (on
    the CPU here, as on a GPU); same-size images replay to the very crops of the per-sample replay, so
    the shards equal a CPU-replay build's. The folder says which replay it was built with."""
    from cxrdr.reinforce.cpu_policy import CpuPolicy

    monkeypatch.setattr(CpuPolicy, "PROBE", 0)  # every record through the worker, its chunks regrouped
    out = tmp_path / "device"
    info = build(options(out, workers=1, replay="device"), teachers=teachers)
    rank = info["build"]["ranks"][0]
    assert rank["replay"] == "device" and rank["time_split_seconds"]["replay"] > 0
    assert "params_replay" in rank["prepare_cpu_seconds"]
    assert manifest_rows(out) == manifest_rows(fresh)
    assert_same_samples(read_samples(out), read_samples(fresh))
    inspected = CliRunner().invoke(app(), ["inspect", str(out)])
    assert inspected.exit_code == 0 and "replay: device (each batch's views replayed at once" in inspected.output
    assert "replay: cpu (each image's views replayed on the CPU" in CliRunner().invoke(app(), ["inspect", str(fresh)]).output
    assert "- replay of the views the teachers embedded: device (" in (out / "README.md").read_text()
    assert "- replay of the views the teachers embedded: cpu (" in (fresh / "README.md").read_text()


def test_device_replay_of_stored_images_of_different_sizes():
    """The build's device replay of worker chunks holding images of different sizes (zero-padded into
    one canvas per chunk, then per batch) gives each sample's per-sample replay within 1/255."""
    from cxrdr.common.augment import AugConfig, replay_many, sample_param_sets
    from cxrdr.reinforce.options import resolve_replay
    from cxrdr.reinforce.pipeline import _regroup
    from cxrdr.reinforce.prepare import collate_prepared, replay_on_device

    assert [resolve_replay(r, d) for r, d in [("auto", "cuda:1"), ("auto", "cpu"), ("cpu", "cuda"), ("device", "cpu")]] \
        == ["device", "cpu", "cpu", "device"]
    rng = np.random.default_rng(0)
    prepared, images = [], []
    for i, (w, h) in enumerate([(80, 64), (64, 96), (64, 64), (120, 64)]):
        pixels = torch.from_numpy(rng.integers(0, 256, (h, w), dtype=np.uint8))
        params = sample_param_sets(f"s{i}", w, h, 3, AugConfig(max_angle=10, hflip=True), seed=i)
        prepared.append({"key": str(i), "pixels": pixels.unsqueeze(0), "aug": params, "image_size": [w, h]})
        images.append(pixels.numpy())
    batch = next(_regroup([collate_prepared(prepared[:2]), collate_prepared(prepared[2:])], batch_size=4))
    assert batch["pixels"].shape == (4, 1, 96, 120) and batch["pixels"].dtype == torch.uint8
    crops = replay_on_device(batch["pixels"], batch["samples"], (32, 48), "cpu")
    for size in (32, 48):
        expected = torch.cat([replay_many(image, p["aug"], size) for image, p in zip(images, prepared)])
        assert crops[size].shape == expected.shape
        assert float((crops[size] - expected).abs().max()) <= 1 / 255


def test_inspect_and_verify_commands(fresh):
    runner = CliRunner()
    result = runner.invoke(app(), ["inspect", str(fresh)])
    assert result.exit_code == 0, result.output
    for text in ("random-tiny", "minilm", "bytes/sample", "captions:", "aug params", "TEST ONLY"):
        assert text in result.output
    info = read_dataset_info(fresh)
    disk = sum((fresh / s["name"]).stat().st_size for s in info["shards"]) / info["total_samples"]
    found = re.search(r"on disk: (\d+) bytes/sample for (\d+) bytes/sample of payload \(x([\d.]+); 5 members",
                      result.output)
    assert found, result.output
    assert int(found.group(1)) == round(disk) and int(found.group(2)) == round(info["bytes_per_sample"]["total"])
    assert "random-tiny      128 bytes/vector (D=64, float16) x 5 rows" in result.output
    result = runner.invoke(app(), ["verify", str(fresh)])
    assert result.exit_code == 0, result.output
    assert "OK" in result.output


def test_inspect_draws_a_samples_views_and_ranks_its_report_by_each_image_teacher(fresh, tmp_path):
    """--views: a PNG of the stored image and its K views; under each view the rank of the sample's own report
    among its shard's by each teacher with image embeddings (the text-only MiniLM has none)."""
    from cxrdr.common.shards import decode_sample
    from cxrdr.reinforce.views_sheet import report_ranks

    info = read_dataset_info(fresh)
    shard = fresh / info["shards"][0]["name"]
    samples = [decode_sample({"__key__": k, "__url__": str(shard), **m}) for k, m in iter_tar_samples(shard)]
    sample = next(s for s in samples if s.meta["boxes"])
    png = tmp_path / "views.png"
    result = CliRunner().invoke(app(), ["inspect", str(fresh), "--key", sample.key, "--views", str(png),
                                        "--view-size", "48"])
    assert result.exit_code == 0, result.output
    with Image.open(png) as image:
        assert image.format == "PNG" and image.width > 400
    ranks = report_ranks(shard, sample, ["random-tiny", "minilm"])
    assert list(ranks) == ["random-tiny"] and ranks["random-tiny"]["n"] == len(samples)
    # the rank, counted here one report at a time: 1 + the reports the view is closer to than to its own
    unit = [s.embeddings("random-tiny")["txt"] / np.linalg.norm(s.embeddings("random-tiny")["txt"]) for s in samples]
    own = next(i for i, s in enumerate(samples) if s.key == sample.key)
    for k, view in enumerate(sample.embeddings("random-tiny")["img"]):
        cosines = [float(view @ u) / float(np.linalg.norm(view)) for u in unit]
        assert ranks["random-tiny"]["cosines"][k] == pytest.approx(cosines[own], abs=1e-6)
        assert ranks["random-tiny"]["ranks"][k] == 1 + sum(c > cosines[own] + 1e-9 for c in cosines)
    listed = "/".join(str(r) for r in ranks["random-tiny"]["ranks"])
    assert (f"wrote {png}: 2 views of {sample.key} at 48 px; random-tiny: report #{listed} of {len(samples)}"
            in result.output)
    default = CliRunner().invoke(app(), ["inspect", str(fresh), "--views", str(tmp_path / "first.png")])
    assert default.exit_code == 0 and f"at {info['teachers'][0]['image_size']} px" in default.output


def test_inspect_teacher_check_ranks_every_view_and_caption_against_the_splits_reports(fresh):
    """--teacher-check: each stored view (image teachers) and caption (every teacher) ranks its own report among
    the split's reports by the teacher's stored embeddings; counted here one query at a time."""
    from cxrdr.common.shards import decode_sample
    from cxrdr.reinforce.teacher_check import teacher_check

    info = read_dataset_info(fresh)
    samples = [decode_sample({"__key__": k, **m}) for shard in info["shards"] if shard["split"] == "train"
               for k, m in iter_tar_samples(fresh / shard["name"])]
    result = teacher_check(fresh, info, "train", limit=None)
    assert set(result["teachers"]) == {"random-tiny", "minilm"} and "views" not in result["teachers"]["minilm"]
    for name, part, label in (("random-tiny", "img", "views"), ("random-tiny", "syn", "captions"),
                              ("minilm", "syn", "captions")):
        reports = np.stack([s.embeddings(name)["txt"] for s in samples])
        reports /= np.linalg.norm(reports, axis=1, keepdims=True)
        ranks = []
        for own, sample in enumerate(samples):
            for query in sample.embeddings(name)[part]:
                scores = reports @ (query / np.linalg.norm(query))
                ranks.append(1 + int((scores > scores[own] + 1e-9).sum()))
        got = result["teachers"][name][label]
        assert got["queries"] == len(ranks) == len(samples) * info["n_aug" if part == "img" else "n_captions"]
        assert got["R@1"] == pytest.approx(np.mean(np.array(ranks) <= 1))
        assert got["R@5"] == pytest.approx(np.mean(np.array(ranks) <= 5))
        assert got["median_rank"] == np.median(ranks) and got["chance_median_rank"] == (len(samples) + 1) / 2
    assert teacher_check(fresh, info, "train", limit=5)["teachers"]["minilm"]["reports"] == 5
    result = CliRunner().invoke(app(), ["inspect", str(fresh), "--teacher-check", "--split", "train"])
    assert result.exit_code == 0, result.output
    assert "minilm           views     (a text-only teacher: no image embeddings)" in result.output
    assert re.search(r"random-tiny +views +R@1 [\d.]+ \[0\.083\].*median rank \d+ of 12 \[6\]  \(24 queries\)",
                     result.output), result.output
    missing = CliRunner().invoke(app(), ["inspect", str(fresh), "--teacher-check", "--split", "nope"])
    assert isinstance(missing.exception, UserError) and "split 'nope' holds no sample" in str(missing.exception)


def _last_member_end(path: Path) -> int:
    with tarfile.open(path) as tf:
        last = tf.getmembers()[-1]
    return last.offset_data + (last.size + 511) // 512 * 512


@pytest.mark.parametrize("compression,cut", [("gzip", "half"), ("none", "half"), ("none", "member-boundary")])
def test_verify_names_a_truncated_shard(fresh, plain, tmp_path, compression, cut):
    damaged = tmp_path / "damaged"
    shutil.copytree(fresh if compression == "gzip" else plain, damaged)
    suffix = ".tar.gz" if compression == "gzip" else ".tar"
    tar = damaged / f"shard-000001{suffix}"
    size = tar.stat().st_size // 2 if cut == "half" else _last_member_end(tar)
    with open(tar, "r+b") as f:
        f.truncate(size)
    result = CliRunner().invoke(app(), ["verify", str(damaged)])
    assert result.exit_code == 1, result.output
    assert f"shard-000001{suffix}" in result.output
    assert "shard-000000" not in result.output


def test_gzip_and_plain_shards_hold_the_same_samples(fresh, plain):
    """--compression changes the file, not a byte of any member; gzip is the smaller one."""
    gz, tar = read_dataset_info(fresh), read_dataset_info(plain)
    assert [s["name"] for s in gz["shards"]] == [s["name"] + ".gz" for s in tar["shards"]]
    assert (gz["compression"], tar["compression"]) == ("gzip", "none")
    assert read_samples(fresh) == read_samples(plain)
    assert gz["bytes_per_sample"] == tar["bytes_per_sample"]
    gz_bytes = sum((fresh / s["name"]).stat().st_size for s in gz["shards"])
    tar_bytes = sum((plain / s["name"]).stat().st_size for s in tar["shards"])
    assert gz_bytes < 0.8 * tar_bytes
    # a shard of either kind is the same tar: gunzip gives the plain shard byte for byte
    import gzip

    assert gzip.decompress((fresh / gz["shards"][0]["name"]).read_bytes()) == (plain / tar["shards"][0]["name"]).read_bytes()


def test_resuming_with_another_compression_is_refused_with_the_one_it_was_built_with(plain, teachers, tmp_path):
    out = tmp_path / "plain"
    shutil.copytree(plain, out)
    with pytest.raises(UserError, match=r"\(compression, shards\); use another --out folder \(or pass --compression none"):
        build(options(out, resume=True), teachers=teachers)  # the default is gzip
    assert not list(out.glob("*.tar.gz"))


def test_a_damaged_gzip_shard_yields_the_samples_before_the_damage(fresh, tmp_path):
    """A gzip shard cut short: the intact samples before the cut still read, then the damage is raised."""
    tar = tmp_path / "shard-000000.tar.gz"
    data = (fresh / "shard-000000.tar.gz").read_bytes()
    tar.write_bytes(data[:int(len(data) * 0.9)])
    complete = [key for key, _ in iter_tar_samples(fresh / "shard-000000.tar.gz")]
    read = []
    with pytest.raises(tarfile.ReadError, match="damaged gzip stream"):
        for key, _ in iter_tar_samples(tar):
            read.append(key)
    assert 1 <= len(read) <= len(complete) and read == complete[:len(read)]


def test_verify_names_a_bad_sample(fresh, tmp_path):
    """A NaN embedding (rewritten tar, consistent size) is reported with its shard and key."""
    damaged = tmp_path / "nan"
    shutil.copytree(fresh, damaged)
    tar = damaged / "shard-000000.tar.gz"
    samples = list(iter_tar_samples(tar))
    bad_key = samples[1][0]
    nan = np.full((5, 64), np.nan, dtype=np.float16)
    buf = io.BytesIO()
    np.save(buf, nan)
    samples[1][1]["random-tiny.npy"] = buf.getvalue()
    with open(tar, "wb") as f:
        writer = TarOut(f, "gzip")
        for key, sample in samples:
            writer.write({"__key__": key, **sample})
        writer.close()
    problems, _ = verify(damaged)
    assert any("shard-000000.tar.gz" in p and bad_key in p and "NaN" in p for p in problems), problems


def test_resume_after_a_kill_gives_the_same_shards(fresh, teachers, tmp_path):
    from cxrdr.reinforce.pipeline import SimulatedKill

    out = tmp_path / "resumed"
    with pytest.raises(RuntimeError) as excinfo:
        build(options(out), fail_after_shards=2, teachers=teachers)
    assert isinstance(excinfo.value.__cause__, SimulatedKill)
    complete = [i for i in range(5) if is_shard_complete(out, i)]
    assert complete == [0, 1]
    assert not (out / "dataset.json").exists()
    (out / "shard-000003.tar.gz.tmp").write_bytes(b"half a shard left by a kill")

    with pytest.raises(UserError, match="--resume"):
        build(options(out), teachers=teachers)
    info = build(options(out, resume=True, workers=0), teachers=teachers)
    assert info["build"]["ranks"][0]["shards_skipped_as_complete"] == 2
    assert manifest_rows(out) == manifest_rows(fresh)
    assert_same_samples(read_samples(out), read_samples(fresh))
    assert verify(out)[0] == []
    assert not list(out.glob("*.tmp"))


@pytest.mark.slow
def test_two_ranks_then_merge_equal_a_single_process_build(fresh, tmp_path):
    out = tmp_path / "ranks"
    base = ["build", "--source", f"phantom:{N}", "--teachers", SPEC, "--out", str(out),
            "--source-seed", str(SOURCE_SEED), "--n-aug", "2", "--n-captions", "2", "--store-size", "64", "--shard-size", "4", "--workers", "0",
            "--batch-size", "4", "--device", "cpu", "--quiet", "--world-size", "2", "--merge-timeout", "150"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # two processes of their own, forked from a server that imported cxrdr once (tests/forked_cli.py)
    procs = [forked_cli.CliProcess("cxrdr.reinforce.cli", base + ["--rank", str(r)], env, REPO) for r in (0, 1)]
    outputs = ["".join(p.communicate(timeout=200)) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "rank 0 merges" in outputs[1]
    ranks = json.loads((out / "dataset.json").read_text())["build"]["ranks"]
    assert sorted(r["shards_built"] for r in ranks) == [2, 3]
    assert manifest_rows(out) == manifest_rows(fresh)
    assert_same_samples(read_samples(out), read_samples(fresh))
    # `reinforce merge` again (e.g. after ranks finished separately) gives the same manifest.
    (out / "manifest.parquet").unlink()
    result = CliRunner().invoke(app(), ["merge", str(out)])
    assert result.exit_code == 0, result.output
    assert manifest_rows(out) == manifest_rows(fresh)
    assert verify(out)[0] == []


def test_add_teacher_replays_stored_augmentations(fresh, teachers, tmp_path):
    from cxrdr.reinforce.add_teacher import add_teachers

    out = tmp_path / "int8"
    info = build(options(out, teachers="random:tiny", emb_dtype="int8", image_format="png"),
                 teachers=teachers[:1])
    assert 0 < info["int8_max_abs_error"]["random-tiny"]["img"] < 0.01
    assert 0.999 <= info["int8_min_cosine"]["random-tiny"] < 1.0
    assert verify(out)[0] == []
    before = read_samples(out)

    info = add_teachers(out, "text:minilm", progress=False, teachers=teachers[1:])
    assert [t["name"] for t in info["teachers"]] == ["random-tiny", "minilm"]
    assert info["teacher_additions"][0]["teachers"] == ["minilm"]
    assert "minilm" in info["bytes_per_sample"] and "minilm" in info["int8_max_abs_error"]
    after = read_samples(out)
    reference = read_samples(fresh)
    for key, old in before.items():
        new = after[key]
        assert all(new[ext] == data for ext, data in old.items())  # nothing existing touched
        assert set(new) - set(old) == {"minilm.npy"}
        stored = npy_load(new["minilm.npy"])  # int8 rows with their scales in the same member: D + 4 bytes
        assert stored.shape == (3,) and stored.dtype.itemsize == 384 + 4
        for part in ("syn", "txt"):
            np.testing.assert_allclose(sample_embedding(new, "minilm", part),
                                       sample_embedding(reference[key], "minilm", part), atol=0.01)
    assert verify(out)[0] == []
    with pytest.raises(UserError, match="already has teacher"):
        add_teachers(out, "text:minilm", progress=False, teachers=teachers[1:])


def test_add_teacher_in_loader_workers_writes_the_same_bytes(teachers, tmp_path):
    """Shards read and prepared by loader workers (each takes whole shards) come out byte for byte as those
    rewritten in one process, stats and manifest alike; the record says how many workers read them."""
    import shutil

    from cxrdr.reinforce.add_teacher import add_teachers

    here, there = tmp_path / "here", tmp_path / "workers"
    build(options(here, teachers="text:minilm", limit=12), teachers=teachers[1:])  # shards of 4 records
    shutil.copytree(here, there)
    # the views replayed a batch at once, 2 samples a batch: each shard ends on a full batch (its last is empty)
    serial = add_teachers(here, "random:tiny", progress=False, teachers=teachers[:1], workers=0, replay="device",
                          batch_size=2)
    parallel = add_teachers(there, "random:tiny", progress=False, teachers=teachers[:1], workers=2, replay="device",
                            batch_size=2)
    assert [s["workers"] for s in (serial, parallel) for s in s["teacher_additions"]] == [0, 2]
    for addition in (serial["teacher_additions"][-1], parallel["teacher_additions"][-1]):  # where the time went
        split = addition["time_split_seconds"]  # this process's parts, and the writing thread's beside them
        assert set(split) == {"loader_wait", "embed", "write_wait", "write"} and min(split.values()) >= 0
        assert 0 < split["loader_wait"] + split["embed"] + split["write_wait"] <= addition["seconds"]
        assert 0 < split["write"] <= addition["seconds"]
    shards = sorted(p.name for p in here.glob("shard-*.tar*"))
    assert len(shards) >= 3 and shards == sorted(p.name for p in there.glob("shard-*.tar*"))
    for name in shards:
        assert (here / name).read_bytes() == (there / name).read_bytes(), name
    for stats in sorted((here / "stats").glob("shard-*.json")):
        assert stats.read_text() == (there / "stats" / stats.name).read_text()
    assert manifest_rows(here) == manifest_rows(there)
    assert verify(there)[0] == []


@pytest.mark.parametrize("where", ["teacher", "rows", "writer"])
def test_add_teacher_stopped_mid_shard_leaves_it_whole_and_a_rerun_finishes(teachers, tmp_path, monkeypatch, where):
    """An add-teacher that fails inside a shard's second batch (in the teacher's forwards, in waiting for their rows
    while the shard's closing batch is in hand, or in the thread that writes it) leaves that shard as it was, keeps
    the shards it finished, and a second run completes the rest: the same bytes as an add-teacher never stopped."""
    import shutil

    import cxrdr.reinforce.add_teacher as add_teacher

    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    build(options(stopped, teachers="text:minilm", limit=12), teachers=teachers[1:])
    shutil.copytree(stopped, whole)
    add_teacher.add_teachers(whole, "random:tiny", progress=False, teachers=teachers[:1], batch_size=2)
    before = {p.name: p.read_bytes() for p in stopped.glob("shard-*.tar*")}
    owner, attribute = (add_teacher.ShardRewrite, "add") if where == "writer" else (add_teacher, "queue_prepared")
    real, calls = getattr(owner, attribute), []

    class LostRows:  # a batch whose forwards were queued but whose rows never come back
        def result(self):
            raise RuntimeError("teacher lost")

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:  # the second shard's second batch (2 samples a batch, 4 a shard; an empty batch ends it)
            if where == "rows":
                return LostRows()
            raise RuntimeError("teacher lost" if where == "teacher" else "disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attribute, failing)
    with pytest.raises(RuntimeError, match="teacher lost|disk full"):
        add_teacher.add_teachers(stopped, "random:tiny", progress=False, teachers=teachers[:1], batch_size=2)
    names = sorted(before)
    assert (stopped / names[0]).read_bytes() == (whole / names[0]).read_bytes()  # finished: rewritten
    assert all((stopped / n).read_bytes() == before[n] for n in names[1:])  # the one stopped in, and later: as were
    monkeypatch.setattr(owner, attribute, real)
    add_teacher.add_teachers(stopped, "random:tiny", progress=False, teachers=teachers[:1], batch_size=2)
    assert all((stopped / n).read_bytes() == (whole / n).read_bytes() for n in names)
    assert not list(stopped.glob("*.tmp*")) and verify(stopped)[0] == []


@pytest.mark.parametrize("replay", ["cpu", "device"])
def test_add_teachers_batches_leave_a_worker_with_one_tensor_of_views_or_pixels(fresh, teachers, replay):
    """A loader worker hands each batch's views (CPU replay) or stored pixels (device replay) on packed, one tensor a
    batch (a teacher size), and its samples without a tensor of their own: each tensor crosses the worker's queue as a
    file descriptor (~0.7 ms apiece on the 2-core box), one a sample cost add-teacher ~28 % of its samples/s."""
    import json

    from cxrdr.reinforce.add_teacher import ShardBatches, teacher_sizes
    from cxrdr.reinforce.embed import worker_tokenizers

    info = json.loads((fresh / "dataset.json").read_text())
    sizes = teacher_sizes(teachers[:1], info)
    tokenizers = worker_tokenizers(teachers[:1])
    batches = ShardBatches(fresh, info["shards"][:1], info, sizes, replay, batch_size=3, tokenizers=tokenizers)
    batch = next(iter(batches))
    entries = [entry for *_, entry in batch["items"]]
    assert len(entries) == 3 and not any(isinstance(v, torch.Tensor) for e in entries for v in e.values())
    # the texts tokenized where they were read, as the build's workers do (numpy: pickled with the batch)
    (name, tokenize), = tokenizers
    assert all(np.array_equal(e["tokens"][name], np.asarray(tokenize(e["texts"]))) for e in entries)
    assert all(e.get("crops", {}) == {} for e in entries)
    views = sum(len(e["aug"]) for e in entries)
    if replay == "cpu":
        assert batch["pixels"] is None and list(batch["crops"]) == sizes
        assert batch["crops"][sizes[0]].shape == (views, 1, sizes[0], sizes[0])
    else:
        assert batch["crops"] == {} and batch["pixels"].dtype == torch.uint8
        assert batch["pixels"].shape[:2] == (3, 1)


@pytest.mark.parametrize("replay", ["cpu", "device"])
def test_add_teacher_with_an_image_teacher(fresh, teachers, tmp_path, replay):
    """Image embeddings added later equal those of a build that had the teacher from the start, whether
    the views are replayed image by image or a batch at once (``--replay device``, here on the CPU)."""
    from cxrdr.reinforce.add_teacher import add_teachers

    out = tmp_path / "text-first"
    build(options(out, teachers="text:minilm", limit=4), teachers=teachers[1:])
    info = add_teachers(out, "random:tiny", progress=False, teachers=teachers[:1], replay=replay)
    after, reference = read_samples(out), read_samples(fresh)
    for key, sample in after.items():
        np.testing.assert_allclose(sample_embedding(sample, "random-tiny", "img"),
                                   sample_embedding(reference[key], "random-tiny", "img"), atol=2e-3)
    assert verify(out)[0] == []
    assert info["teacher_additions"][-1]["replay"] == replay


def test_missing_and_unreadable_images_are_skipped_and_reported(tmp_path, teachers):
    from cxrdr.reinforce.phantom import write_phantom_dataset

    jsonl = write_phantom_dataset(6, tmp_path / "data", size=96, progress=False)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    missing, broken = rows[1], rows[2]
    (jsonl.parent / missing["image"]).unlink()
    (jsonl.parent / broken["image"]).write_bytes(b"\x89PNG not really")
    info = build(options(tmp_path / "out", source=f"jsonl:{jsonl}"), teachers=teachers)
    assert info["total_samples"] == 4
    skipped = {e["id"]: e["reason"] for part in ("source", "build") for e in info["skipped"][part]["records"]}
    assert set(skipped) == {missing["id"], broken["id"]}
    assert skipped[missing["id"]].startswith("missing image")
    assert skipped[broken["id"]].startswith("unreadable image")
    text = summary_text(info)
    assert missing["id"] in text and broken["id"] in text
    assert verify(tmp_path / "out")[0] == []


def test_bad_input_is_a_one_line_user_error(tmp_path, teachers):
    with pytest.raises(UserError, match="--source"):
        build(options(tmp_path / "a", source="nosuch:thing"))
    with pytest.raises(UserError, match="--teachers"):
        build(options(tmp_path / "b", teachers="bogus:model"))
    with pytest.raises(UserError, match="--emb-dtype"):
        build(options(tmp_path / "c", emb_dtype="bf8"))
    with pytest.raises(UserError, match="--replay must be one of auto, cpu, device"):
        build(options(tmp_path / "c", replay="gpu"))
    with pytest.raises(UserError, match="rank"):
        build(options(tmp_path / "d", rank=2, world_size=2))
    result = CliRunner().invoke(app(), ["build", "--crop-scale", "1.0", "--out", str(tmp_path / "e")])
    assert isinstance(result.exception, UserError) and "--crop-scale" in str(result.exception)
    (tmp_path / "g").mkdir()
    result = CliRunner().invoke(app(), ["add-teacher", str(tmp_path / "g"), "--teachers", "random:tiny",
                                        "--workers", "-1"])
    assert isinstance(result.exception, UserError) and "--workers must be >= 0 (got -1)" in str(result.exception)
    with pytest.raises(UserError, match="no dataset.json"):
        read_dataset_info(tmp_path / "nowhere")
    # A different build into a folder that holds one is refused, naming what differs.
    build(options(tmp_path / "f", limit=4), teachers=teachers)
    with pytest.raises(UserError, match="n_aug"):
        build(options(tmp_path / "f", limit=4, n_aug=3, resume=True), teachers=teachers)


def test_text_only_source_builds_shards_without_images(tmp_path, teachers, monkeypatch):
    """A source with requires_images False (e.g. iu-xray without images): txt/json/syn/txt only."""
    import dataclasses

    import cxrdr.reinforce.options as build_options
    from cxrdr.reinforce.phantom import PhantomSource

    class TextOnly:
        requires_images = False
        name = "text-only-phantom"

        def __init__(self):
            self.inner = PhantomSource(4, seed=SOURCE_SEED)
            self.skipped = self.inner.skipped

        def __iter__(self):
            return (dataclasses.replace(r, image=None) for r in self.inner)

        def describe(self):
            return {"name": self.name, "requires_images": False}

    monkeypatch.setattr(build_options, "open_source", lambda spec, **options: TextOnly())
    info = build(options(tmp_path / "text"), teachers=teachers)
    assert info["images"] is False and info["n_aug"] == 0 and info["total_samples"] == 4
    assert "image" not in info["bytes_per_sample"]
    for sample in read_samples(tmp_path / "text").values():
        assert set(sample) == {"txt", "json", "random-tiny.npy", "minilm.npy"}
        assert json.loads(sample["json"])["aug"] == []
    assert verify(tmp_path / "text")[0] == []
    drawn = CliRunner().invoke(app(), ["inspect", str(tmp_path / "text"), "--views", str(tmp_path / "views.png")])
    assert isinstance(drawn.exception, UserError) and "no stored image or augmentations to draw" in str(drawn.exception)
    assert not (tmp_path / "views.png").exists()


def test_rank_from_torchrun_env_and_merge_after_a_timeout(tmp_path, teachers, monkeypatch):
    from cxrdr.reinforce.options import resolve_rank
    from cxrdr.reinforce.manifest import merge

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_rank(None, None) == (1, 2)
    assert resolve_rank(0, 1) == (0, 1)  # flags win over the environment
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")

    out = tmp_path / "late"
    small = dict(teachers="random:tiny", limit=4, shard_size=2, workers=0, world_size=2, merge_timeout=0.5)
    with pytest.raises(UserError, match="reinforce merge"):
        build(options(out, rank=0, **small), teachers=teachers[:1])  # rank 1 has not run yet
    assert not (out / "dataset.json").exists()
    info = build(options(out, rank=1, **small), teachers=teachers[:1])
    assert info["rank"] == 1 and info["shards_built"] == 1
    dataset = merge(out)
    assert dataset["total_samples"] == 4 and len(dataset["build"]["ranks"]) == 2
    assert verify(out)[0] == []


def _downgrade_to_schema_1(out: Path, info: dict) -> None:
    """Rewrite a current folder in the schema-1 layout (one member per part, int8 scales apart; the
    json member with the meaning as it is, as schemas 1 and 2 stored it): the fixture standing in
    for shards built before schema 2."""
    import webdataset as wds

    from cxrdr.reinforce.manifest import plan_path
    from cxrdr.common.shards import emb_ext, encode_embedding, npy_bytes, scale_ext
    from cxrdr.reinforce.writer import read_shard_stats, stats_path

    for index, shard in enumerate(info["shards"]):
        tar = out / shard["name"]
        samples = list(iter_tar_samples(tar))
        with open(tar, "wb") as f:
            writer = wds.TarWriter(f, encoder=False, mtime=0)
            for key, sample in samples:
                old = {ext: data for ext, data in sample.items() if not ext.endswith(".npy")}
                old["json"] = json.dumps(load_meta(sample["json"])).encode()
                for t in info["teachers"]:
                    stored = npy_load(sample.pop(f"{t['name']}.npy"))
                    parts = sample_embeddings_of(stored, sample)
                    for part, rows in parts.items():
                        if stored.dtype.names:  # int8 record rows -> separate data and scale arrays
                            q, scale = encode_embedding(rows, "int8")
                            old[emb_ext(t["name"], part)] = npy_bytes(q)
                            old[scale_ext(t["name"], part)] = npy_bytes(scale)
                        else:
                            old[emb_ext(t["name"], part)] = npy_bytes(rows.astype(stored.dtype))
                writer.write({"__key__": key, **old})
            writer.close()
        stats = read_shard_stats(out, index)
        stats["tar_bytes"] = tar.stat().st_size
        stats.pop("checksums", None)  # schema-1 builds predate member checksums
        stats_path(out, index).write_text(json.dumps(stats))
    for path in (out / "dataset.json", plan_path(out)):
        data = json.loads(path.read_text())
        data["schema_version"] = 1
        path.write_text(json.dumps(data))


def sample_embeddings_of(stored: np.ndarray, sample: dict) -> dict:
    from cxrdr.common.shards import decode_embedding, split_rows

    meta = json.loads(sample["json"])
    return split_rows(decode_embedding(stored), len(meta["aug"]), len(meta["captions"]))


def test_schema_1_shards_are_read_verified_and_upgraded_by_add_teacher(teachers, tmp_path):
    """Old-layout shards still read (same values), verify, and add-teacher repacks them losslessly."""
    from cxrdr.reinforce.add_teacher import add_teachers

    out = tmp_path / "v1"
    info = build(options(out, teachers="random:tiny", emb_dtype="int8", limit=4), teachers=teachers[:1])
    v2 = read_samples(out)
    _downgrade_to_schema_1(out, info)
    v1 = read_samples(out)
    assert read_dataset_info(out)["schema_version"] == 1
    for key, sample in v1.items():
        assert {"random-tiny.img.npy", "random-tiny.img.scale.npy", "random-tiny.txt.scale.npy"} <= set(sample)
        for part in ("img", "syn", "txt"):
            np.testing.assert_allclose(sample_embedding(sample, "random-tiny", part),
                                       sample_embedding(v2[key], "random-tiny", part), atol=1e-6)
    assert verify(out)[0] == []

    info = add_teachers(out, "text:minilm", progress=False, teachers=teachers[1:])
    assert info["schema_version"] == SCHEMA_VERSION and info["upgraded_from_schema_version"] == 1
    for key, sample in read_samples(out).items():
        assert set(sample) == {"jpg", "txt", "json", "random-tiny.npy", "minilm.npy"}
        assert sample["random-tiny.npy"] == v2[key]["random-tiny.npy"]  # the very bytes a current build writes
        assert sample["json"] == v2[key]["json"]  # the json member upgraded to the very bytes a build writes
        check_stored_meta(json.loads(sample["json"]))
    assert verify(out)[0] == []


def test_dataset_card_beside_the_shards(fresh):
    import yaml

    from cxrdr.reinforce.card import source_license

    info = read_dataset_info(fresh)
    text = (fresh / "README.md").read_text()
    assert text.startswith("---\n")
    header = yaml.safe_load(text.split("---\n")[1])
    assert header["license"] == "apache-2.0"  # phantom data: generated by cxrdr
    assert "zero-shot-image-classification" in header["task_categories"]
    assert header["size_categories"] == ["n<1K"]
    body = text.split("---\n", 2)[2]
    for t in info["teachers"]:
        assert f"| {t['name']} | `{t['spec']}`" in body and f"{t['logit_scale']:.2f}" in body
    assert "K = 2 stored augmentations per image, S = 2 captions" in body
    assert "train 12, val 2, test 2" in body and "skipped by the build: 0" in body
    assert "python -m cxrdr.train.openclip_train --dataset-type webdataset" in body
    assert "--train-num-samples 12" in body
    assert source_license({"name": "mimic"})[0] == "other"
    assert source_license({"name": "jsonl", "license": "cc-by-4.0"})[0] == "cc-by-4.0"
    assert source_license({"name": "csv"})[0] == "unknown"


def test_build_flags_are_derived_from_build_options(monkeypatch):
    """Issue 25: `reinforce build`'s flags come from BuildOptions (name, type, default, help in one place);
    every flag keeps its name, and the parsed flags make the BuildOptions the old signature made."""
    import dataclasses

    from typer.testing import CliRunner

    from cxrdr.common.augment import AugConfig
    from cxrdr.reinforce import build_cli
    from cxrdr.reinforce.options import AUG_FLAGS, SOURCE_FLAGS, cli_flags

    seen = []
    monkeypatch.setattr(build_cli, "build", lambda opts: seen.append(opts) or {"rank": 0, "samples_built": 0,
                                                                                "shards_built": 0})
    for f in dataclasses.fields(BuildOptions):
        assert f.name in ("aug", "source_options") or f.metadata.get("help"), f.name
    names = [flag.name for flag in cli_flags()]
    assert len(names) == len(set(names)) == len(dataclasses.fields(BuildOptions)) - 2 + len(AUG_FLAGS) + len(SOURCE_FLAGS)
    runner = CliRunner()
    assert runner.invoke(app(), ["build"]).exit_code == 0
    defaults = seen.pop()
    assert defaults == BuildOptions(teachers="biomedclip", aug=AugConfig(), source_options={
        key: None for key, _, _ in SOURCE_FLAGS.values()})
    args = ["--source", "csv:x.csv", "--teachers", "random:tiny", "--out", "o", "--n-aug", "3", "--n-captions", "4",
            "--store-size", "96", "--image-format", "JPEG", "--jpeg-quality", "80", "--emb-dtype", "int8",
            "--shard-size", "7", "--compression", "none", "--seed", "5", "--workers", "0", "--batch-size", "6",
            "--device", "cpu", "--replay", "device", "--model-cache", "mc", "--resume", "--rank", "1", "--world-size", "2",
            "--limit", "9", "--merge-timeout", "12.5", "--crop-scale", "0.5,0.9", "--crop-ratio", "0.8,1.2",
            "--max-angle", "3", "--randaugment", "2", "--randaugment-magnitude", "4", "--image-root", "imgs",
            "--col-id", "a", "--col-image", "b", "--col-report", "c", "--col-findings", "d", "--col-impression", "e",
            "--col-labels", "f", "--col-split", "g", "--col-subject", "h", "--col-study", "i", "--col-view", "j",
            "--labels-format", "k", "--scene-graphs", "sg", "--all-views", "--min-report-chars", "11",
            "--phantom-size", "128", "--source-seed", "8", "--engine", "ray", "--ray-actors", "2",
            "--ray-retries", "1", "--quiet"]
    result = runner.invoke(app(), ["build", *args])
    assert result.exit_code == 0, result.output
    assert seen.pop() == BuildOptions(
        source="csv:x.csv", teachers="random:tiny", out=Path("o"), n_aug=3, n_captions=4, store_size=96,
        image_format="jpg", jpeg_quality=80, emb_dtype="int8", shard_size=7, compression="none", seed=5, workers=0,
        batch_size=6, device="cpu", replay="device", model_cache="mc", resume=True, rank=1, world_size=2, limit=9,
        aug=AugConfig(scale=(0.5, 0.9), ratio=(0.8, 1.2), max_angle=3.0, randaugment_n=2, randaugment_magnitude=4.0),
        source_options=dict(image_root="imgs", col_id="a", col_image="b", col_report="c", col_findings="d",
                            col_impression="e", col_labels="f", col_split="g", col_subject="h", col_study="i",
                            col_view="j", labels_format="k", scene_graphs="sg", frontal_only=False,
                            min_report_chars=11, size=128, seed=8),
        merge_timeout=12.5, progress=False, engine="ray", ray_actors=2, ray_retries=1)


def test_default_workers_follow_the_teachers_device(monkeypatch):
    """--workers unset: 2 beside a CPU teacher (it needs the cores), every core but two (at most 16)
    beside a CUDA one, which waits on preparation; a given count is kept."""
    from cxrdr.reinforce.options import resolve_workers

    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert resolve_workers(None, "cpu") == 2 and resolve_workers(None, "cuda:0") == 14
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert resolve_workers(None, "cuda") == 16
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert resolve_workers(None, "cuda") == 2
    assert resolve_workers(5, "cuda") == 5 and resolve_workers(0, "cpu") == 0


def test_teacher_texts_are_tokenized_where_records_are_prepared(fresh, teachers, tmp_path, monkeypatch):
    """open_clip teachers tokenize in the build's workers (``Teacher.text_tokenizer``): the build's process
    only runs the forwards. A build whose teachers cannot tokenize in their forward still builds, and its
    shards are the default build's."""
    from cxrdr.common.augment import AugConfig
    from cxrdr.reinforce.embed import embed_batch, worker_tokenizers
    from cxrdr.reinforce.phantom import PhantomSource
    from cxrdr.reinforce.prepare import PrepareSpec, prepare_record
    from cxrdr.teachers.openclip import OpenClipTeacher

    tokenizers = worker_tokenizers(teachers)
    assert [name for name, _ in tokenizers] == [t.name for t in teachers if isinstance(t, OpenClipTeacher)] != []
    spec = PrepareSpec(images=True, store_size=64, image_format="jpg", jpeg_quality=95, n_aug=2, n_captions=2,
                       aug=AugConfig(), seed=0, sizes=(teachers[0].image_size,), tokenizers=tokenizers)
    prepared = [prepare_record(0, f"{i:06d}", rec, spec) for i, rec in enumerate(PhantomSource(3, size=96))]
    for b in prepared:
        for name, tokenize in tokenizers:
            assert np.array_equal(b["tokens"][name], tokenize(b["texts"]).numpy())
        assert "tokenize" in b["stage_seconds"]
    with_tokens = embed_batch(teachers, prepared, images=False)
    without = embed_batch(teachers, [{k: v for k, v in b.items() if k != "tokens"} for b in prepared], images=False)
    for a, b in zip(with_tokens, without):
        for name in a:
            assert np.array_equal(a[name]["txt"], b[name]["txt"]) and np.array_equal(a[name]["syn"], b[name]["syn"])
    assert embed_batch(teachers, [], images=True) == []  # a batch whose records were all skipped

    def no_tokenizing(self, texts):
        raise AssertionError("the build's process tokenized texts")

    monkeypatch.setattr(OpenClipTeacher, "_encode_texts", no_tokenizing)
    build(options(tmp_path / "tokens", workers=0), teachers=teachers)
    assert manifest_rows(tmp_path / "tokens") == manifest_rows(fresh)
    assert_same_samples(read_samples(tmp_path / "tokens"), read_samples(fresh))
