"""Evaluation metrics against hand-computed examples, and `train eval` end to end on tiny phantom shards."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from cxrdr.common.augment import full_image_params
from cxrdr.common.labels import CHEXPERT14
from cxrdr.train.evaluation import faithfulness as faith
from cxrdr.train.evaluation import localisation as loc
from cxrdr.train.evaluation.geometry import distance_ratio
from cxrdr.train.evaluation.probe import linear_probe
from cxrdr.train.evaluation.retrieval import retrieval_metrics
from cxrdr.train.evaluation.zeroshot import load_prompts, select_5x200, zeroshot_auc


# --------------------------------------------------------------------------- retrieval


def test_retrieval_known_permutation():
    img = torch.eye(4)
    txt = img[[1, 0, 2, 3]]  # texts 0 and 1 swapped: images 0, 1 find the other's text first
    r = retrieval_metrics(img, txt)
    assert r["i2t_R@1"] == 0.5 and r["t2i_R@1"] == 0.5
    # image 0's own text (e1) scores 0, as do the two other wrong texts: pessimistic ties -> rank 3
    assert r["i2t_R@1"] == 0.5 and r["i2t_R@5"] == 1.0
    assert r["n_candidates"] == 4


def test_retrieval_graded_ranks():
    # text i is the image rotated so that image i's own text ranks exactly i-th (0-based)
    n = 12
    img = torch.eye(n)
    sims = torch.full((n, n), 0.0)
    for i in range(n):
        order = [j for j in range(n) if j != i]
        for r, j in enumerate(order[:i]):
            sims[i, j] = 1.0 - 0.01 * r  # i wrong texts above the right one
        sims[i, i] = 0.5
    # feed the similarity matrix directly as embeddings: img = I, txt = sims.T (cos != dot after
    # normalisation, so compare with an unnormalised check via ranks instead)
    from cxrdr.train.evaluation.retrieval import correct_ranks

    ranks = correct_ranks(sims)
    assert ranks.tolist() == list(range(n))
    assert np.mean(ranks < 1) == pytest.approx(1 / 12) and np.mean(ranks < 5) == pytest.approx(5 / 12)
    assert np.mean(ranks < 10) == pytest.approx(10 / 12)


def test_retrieval_identical_text_variant():
    img = torch.eye(4)
    txt = img[[1, 0, 2, 3]]
    texts = ["No acute process.", "no  acute process.", "Effusion.", "Nodule."]  # 0, 1 identical
    r = retrieval_metrics(img, txt, texts=texts)
    assert r["i2t_R@1"] == 0.5 and r["i2t_R@1_sametext"] == 1.0 and r["t2i_R@1_sametext"] == 1.0
    assert r["n_unique_texts"] == 3
    # with distinct texts the variant equals the strict metric
    r2 = retrieval_metrics(img, txt, texts=["a", "b", "c", "d"])
    assert r2["i2t_R@1_sametext"] == r2["i2t_R@1"]


def test_retrieval_findings_variant_and_oracle_ceiling():
    img = torch.eye(4)
    txt = img[[1, 0, 2, 3]]  # rows 0 and 1 swapped: strictly wrong, but they share their findings
    findings = [(), (), (3,), (3, 5)]
    r = retrieval_metrics(img, txt, findings=findings)
    assert r["i2t_R@1"] == 0.5 and r["i2t_R@1_findings"] == 1.0 and r["t2i_R@1_findings"] == 1.0
    assert r["n_finding_sets"] == 3
    # the oracle ranks the two normal studies first in random order: R@1 1/2 for them, 1 for the others
    assert r["oracle_mean_recall"] == pytest.approx(np.mean([(0.5 + 0.5 + 1 + 1) / 4, 1.0, 1.0]))
    with pytest.raises(ValueError, match="findings has 3 entries for 4"):
        retrieval_metrics(img, txt, findings=findings[:3])


def test_train_box_prior_is_a_fixed_map_of_train_box_frequency():
    from cxrdr.train.evaluation.box_prior import (box_frequency_maps, fixed_map_pointing_game,
                                                  label_prior_pointing_game)

    grid = (4, 4)
    heart = {"label": "cardiomegaly", "box": [30, 40, 70, 90]}  # the centre-bottom of a 100 px image
    tube = {"label": "support_device", "box": [0, 0, 20, 20]}
    maps = box_frequency_maps([(100, 100, [heart]), (100, 100, [heart, tube]), (100, 100, [])], grid)
    assert maps["n_images"] == 2 and maps["n_images_per_label"] == {"cardiomegaly": 2, "support_device": 1}
    assert maps["any"][2, 1] == 1.0 and maps["any"][0, 0] == 0.5  # the tube is in one of two images
    assert maps["pathology"][0, 0] == 0.0  # devices are no pathology
    target_heart = np.zeros(grid, bool)
    target_heart[2:4, 1:3] = True
    target_corner = np.zeros(grid, bool)
    target_corner[0, 3] = True
    assert fixed_map_pointing_game(maps["any"], [target_heart, target_corner]) == 0.5
    pooled = label_prior_pointing_game(maps["labels"], maps["any"],
                                       {"cardiomegaly": [target_heart], "nodule": [target_corner]})
    assert pooled == 0.5  # nodule has no train box: it falls back to the class-agnostic map and misses


def test_retrieval_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="pair row by row"):
        retrieval_metrics(torch.eye(3), torch.eye(4))


# --------------------------------------------------------------------------- probe / zero-shot


def _labels(n, positives: dict[str, list[int]]):
    y = np.zeros((n, len(CHEXPERT14)))
    for name, rows in positives.items():
        y[rows, CHEXPERT14.index(name)] = 1
    return y


def test_probe_skips_labels_with_few_positives():
    rng = np.random.default_rng(0)
    n = 40
    y_train = _labels(n, {"Cardiomegaly": list(range(0, 20)), "Edema": [0, 1, 2]})
    y_test = _labels(n, {"Cardiomegaly": list(range(0, 20)), "Edema": [0, 1, 2, 3, 4, 5]})
    x_train = rng.normal(size=(n, 8)) + y_train[:, [2]] * 3  # Cardiomegaly separable on every dim
    x_test = rng.normal(size=(n, 8)) + y_test[:, [2]] * 3
    r = linear_probe(x_train, y_train, x_test, y_test, min_positives=5)
    assert list(r["per_label"]) == ["Cardiomegaly"]
    assert r["per_label"]["Cardiomegaly"]["auc"] > 0.95
    assert "Edema" in r["skipped"] and "3 train positives" in r["skipped"]["Edema"]
    assert "No Finding" in r["skipped"] and r["n_labels"] == 1
    assert r["mean_auc"] == r["per_label"]["Cardiomegaly"]["auc"]


def test_zeroshot_auc_and_5x200():
    prompts = load_prompts()
    assert "Cardiomegaly" in prompts["labels"] and len(prompts["multiclass_5x200"]) == 5
    d = 4
    pos, neg = np.eye(d)[0], np.eye(d)[1]
    y = _labels(10, {"Cardiomegaly": [0, 1, 2, 3, 4]})
    img = np.stack([pos if i < 5 else neg for i in range(10)]) + 0.01
    r = zeroshot_auc(img, y, {"Cardiomegaly": (pos, neg)}, min_positives=5)
    assert r["per_label"]["Cardiomegaly"]["auc"] == 1.0
    assert r["skipped"]["Edema"] == "no prompts"
    ids = [f"k{i}" for i in range(10)]
    y5 = _labels(10, {"Cardiomegaly": [0, 1, 2], "Edema": [2, 3, 4, 5]})  # row 2 has both: excluded
    subset = select_5x200(y5, ids, per_class=2, seed=0)
    assert len(subset["Cardiomegaly"]) == 2 and set(subset["Cardiomegaly"]) <= {0, 1}
    assert len(subset["Edema"]) == 2 and set(subset["Edema"]) <= {3, 4, 5}
    assert subset == select_5x200(y5, ids, per_class=2, seed=0)  # reproducible


# --------------------------------------------------------------------------- localisation


def test_pointing_iou_dice_on_synthetic_maps():
    heat = np.zeros((4, 4))
    heat[1, 1], heat[1, 2], heat[2, 1] = 3.0, 2.0, 1.0  # top 20% of 16 cells = 4 cells (ceil 3.2)
    gt = np.zeros((4, 4), bool)
    gt[1:3, 1:3] = True
    s = loc.localisation_scores(heat, gt, 0.2)
    assert s["hit"] is True
    # top-4: (1,1),(1,2),(2,1) then the first zero cell in row-major order (0,0) -> 3 of 4 in box
    assert s["iou"] == pytest.approx(3 / 5) and s["dice"] == pytest.approx(6 / 8)
    heat2 = np.zeros((4, 4))
    heat2[3, 3] = 1.0
    assert loc.pointing_hit(heat2, gt) is False
    agg = loc.aggregate([s, loc.localisation_scores(heat2, gt, 0.2)])
    assert agg["pointing_game"] == 0.5 and agg["n"] == 2


def test_prior_map_baseline_scores_a_constant_map_and_not_a_looking_one():
    """A fixed map pointing where most findings sit scores like the prior; a map that follows each
    image's own box beats the prior; the prior leaves image i out of its own guess."""
    grid = (4, 4)
    targets = []
    for i in range(6):  # five findings top-left, one bottom-right
        gt = np.zeros(grid, dtype=bool)
        gt[(0, 0) if i < 5 else (3, 3)] = True
        targets.append(gt)
    constant = np.zeros(grid)
    constant[0, 0] = 1.0
    constant_maps = [constant.copy() for _ in targets]
    looking_maps = [t.astype(float) + 0.01 for t in targets]
    assert loc.prior_pointing_game(constant_maps, targets) == pytest.approx(5 / 6)
    # the prior of the looking maps is their leave-one-out mean: top-left wins for every image
    assert loc.prior_pointing_game(looking_maps, targets) == pytest.approx(5 / 6)
    assert np.mean([loc.pointing_hit(m, g) for m, g in zip(looking_maps, targets)]) == 1.0
    # leave-one-out: with two images, each image's prior is the OTHER image's map
    assert loc.prior_pointing_game(looking_maps[4:], targets[4:]) == 0.0
    nan_map = np.full(grid, np.nan)
    assert loc.prior_pointing_game([nan_map, constant], [targets[0], targets[1]]) == 0.5
    assert np.isnan(loc.prior_pointing_game([constant], [targets[0]]))


def test_chance_baseline_matches_random_heatmaps():
    gt = np.zeros((6, 6), bool)
    gt[1:3, 2:5] = True  # 6 of 36 cells
    exact = loc.chance_scores(gt, 0.2)
    assert exact["hit"] == pytest.approx(6 / 36)
    rng = np.random.default_rng(0)
    draws = [loc.localisation_scores(rng.random((6, 6)), gt, 0.2) for _ in range(4000)]
    for key in ("hit", "iou", "dice"):
        assert np.mean([d[key] for d in draws]) == pytest.approx(exact[key], abs=0.015), key
    s = loc.localisation_scores(np.where(gt, 1.0, 0.0), gt, 0.2)
    assert s["hit"] and s["chance_hit"] == exact["hit"] and s["chance_iou"] == exact["iou"]
    agg = loc.aggregate([{**s, "n_boxes": 2}, draws[0]])
    assert agg["chance_pointing_game"] == pytest.approx(6 / 36) and agg["n"] == 2 and agg["n_boxes"] == 3
    full = np.ones((6, 6), bool)
    assert loc.chance_scores(full, 0.2) == {"hit": 1.0, "iou": pytest.approx(8 / 36), "dice": pytest.approx(16 / 44)}


def test_heatmap_plots_show_different_findings_first():
    from cxrdr.train.evaluation.student_maps import varied_plots

    def item(*labels):
        return {"attn": [(lab, None) for lab in labels], "boxes": [(lab, None) for lab in labels]}

    items = [item("atelectasis"), item("atelectasis"), item("edema"), item(), item("atelectasis", "mass")]
    chosen = varied_plots(items, 4)
    assert chosen[:3] == [items[0], items[2], items[4]] and len(chosen) == 4
    assert varied_plots(items, 2) == [items[0], items[2]]


def test_collapse_diagnostics():
    same = [np.arange(16.0).reshape(4, 4)] * 3
    assert loc.map_similarity(same) == pytest.approx(1.0)
    one_hot = [np.eye(16)[i].reshape(4, 4) for i in range(3)]
    assert loc.map_similarity(one_hot) == pytest.approx(-1 / 15)  # centred one-hots: slightly anti-correlated
    offset_peaks = [0.5 + 0.01 * m for m in one_hot]  # sigmoid-like maps, different peaks
    assert loc.map_similarity(offset_peaks) == pytest.approx(-1 / 15)  # a plain cosine gives ~1.0
    assert np.isnan(loc.map_similarity(same[:1]))
    assert loc.normalised_entropy(np.ones((4, 4))) == pytest.approx(1.0)
    assert loc.normalised_entropy(one_hot[0]) == pytest.approx(0.0)


def test_box_mask_through_view_params():
    params = full_image_params(64, 32)  # non-square stored image, squeezed into a square view
    mask = loc.box_patch_mask([0, 0, 32, 16], params, (4, 4))  # top-left quarter of the image
    expected = np.zeros((4, 4), bool)
    expected[:2, :2] = True
    assert (mask == expected).all()
    crop = {"crop": [32.0, 0.0, 32.0, 32.0], "angle": 0.0}  # right half only
    assert not loc.box_patch_mask([0, 0, 16, 16], crop, (4, 4)).any()  # box out of view
    assert loc.box_patch_mask([40, 8, 41, 9], crop, (4, 4)).sum() == 1  # tiny box -> one patch
    # a thin line (no patch centre inside: centres at y 4, 12, 20, 28) -> every patch it crosses
    line = loc.box_patch_mask([34, 14, 62, 15], crop, (4, 4))
    assert line[1].all() and line.sum() == 4
    wide = loc.box_patch_mask([34, 10, 62, 15], crop, (4, 4))  # holds centres (y 12): those patches only
    assert wide[1].all() and wide.sum() == 4
    grid = loc.scatter_to_grid([5.0, 7.0], [3, 0], (2, 2))
    assert grid[0, 0] == 7.0 and grid[1, 1] == 5.0 and math.isnan(grid[0, 1])


def test_phrase_positions():
    assert loc.label_phrases("pleural_effusion")[:2] == ["pleural effusion", "effusion"]
    report = [101, 7, 8, 9, 10, 102]
    assert loc.phrase_positions(report, [[8, 9], [9]]) == [2, 3]
    assert loc.phrase_positions(report, [[5, 6], [10]]) == [4]
    assert loc.phrase_positions(report, [[5]]) == []


# --------------------------------------------------------------------------- intervals over images


def _width(interval):
    return interval[1] - interval[0]


def test_image_bootstrap_contains_the_estimate_narrows_with_more_images_and_is_seeded():
    from cxrdr.train.evaluation.bootstrap import bootstrap_rate, image_resamples

    pattern = [1, 1, 0, 1, 0]  # a 0.6 hit rate
    few = bootstrap_rate([f"i{i}" for i in range(40)], pattern * 8)
    many = bootstrap_rate([f"i{i}" for i in range(200)], pattern * 40)
    for r in (few, many):
        assert r["value"] == pytest.approx(0.6) and r["interval"][0] < 0.6 < r["interval"][1]
    assert _width(few["interval"]) > _width(many["interval"])
    assert few["n_images"] == 40 and few["n_targets"] == 40
    assert bootstrap_rate([f"i{i}" for i in range(40)], pattern * 8) == few
    draws = image_resamples(40)  # each resample draws 40 images with replacement; another seed, other draws
    assert draws.shape == (2000, 40) and draws.min() == 0 and draws.max() == 39
    assert (draws == image_resamples(40)).all() and not (draws == image_resamples(40, seed=1)).all()
    # a random map's hit probability (floats) and missing values (None: not counted)
    chance = bootstrap_rate(["a", "a", "b", "c"], [0.1, 0.3, None, 0.2])
    assert chance["value"] == pytest.approx(0.2) and chance["n_targets"] == 3 and chance["n_images"] == 2


def test_image_bootstrap_resamples_images_not_targets():
    """Two targets of one image both hit or both missed: resampling images (the pair moves together) gives a
    wider interval than treating the same hits as independent targets."""
    from cxrdr.train.evaluation.bootstrap import bootstrap_rate

    per_image = [1, 0, 1, 1, 0, 1, 0, 1, 1, 0] * 3  # 30 images
    hits = [h for h in per_image for _ in range(2)]  # two boxes each, same outcome
    grouped = bootstrap_rate([f"img{i // 2}" for i in range(60)], hits)
    independent = bootstrap_rate([f"target{i}" for i in range(60)], hits)
    assert grouped["value"] == independent["value"] == pytest.approx(0.6)
    assert grouped["n_images"] == 30 and independent["n_images"] == 60
    assert _width(grouped["interval"]) > 1.2 * _width(independent["interval"])


def test_paired_margin_of_identical_hits_is_exactly_zero_and_pairing_cancels_shared_images():
    from cxrdr.train.evaluation.bootstrap import bootstrap_rate, paired_margin

    keys = [f"i{i}" for i in range(50)]
    hits = [1, 0, 1, 1, 0] * 10
    same = paired_margin(keys, hits, list(hits))
    assert same["margin"] == 0.0 and same["interval"] == [0.0, 0.0]
    # the prior misses exactly one image the model hits: a margin of 1/50, never below 0 in any resample,
    # whereas the two unpaired intervals overlap almost entirely
    prior = list(hits)
    prior[0] = 0
    m = paired_margin(keys, hits, prior)
    assert m["margin"] == pytest.approx(0.02) and 0.0 <= m["interval"][0] <= 0.02 <= m["interval"][1]
    assert _width(m["interval"]) < _width(bootstrap_rate(keys, hits)["interval"]) / 3
    with pytest.raises(ValueError, match="one key, model and baseline value per target"):
        paired_margin(keys, hits, prior[:-1])


def test_pooled_paired_margin_over_seeds():
    from cxrdr.train.evaluation.bootstrap import paired_margin, pooled_paired_margin

    keys = [f"i{i // 2}" for i in range(60)]  # 30 images, two targets each
    rng = np.random.default_rng(3)
    prior = (rng.random(60) < 0.5).astype(int).tolist()
    run = {"keys": keys, "model": (rng.random(60) < 0.7).astype(int).tolist(), "train_prior": prior}
    single = paired_margin(keys, run["model"], prior)
    # one seed, or the same seed three times: the pooled margin and both intervals are that seed's own
    for runs in ([run], [run] * 3):
        pooled = pooled_paired_margin(runs)
        assert pooled["margin"] == pytest.approx(single["margin"])
        assert pooled["interval_images"] == pytest.approx(single["interval"])
        assert pooled["interval"] == pytest.approx(single["interval"])
    identical = pooled_paired_margin([{**run, "train_prior": run["model"]}] * 2)
    assert identical["margin"] == 0.0 and identical["interval"] == [0.0, 0.0] == identical["interval_images"]
    # seeds that disagree: the margin is the mean of per-seed margins; resampling seeds too widens the interval
    other = {"keys": keys, "model": (rng.random(60) < 0.35).astype(int).tolist(), "train_prior": prior}
    pooled = pooled_paired_margin([run, other])
    per_seed = [s["margin"] for s in pooled["per_seed"]]
    assert pooled["margin"] == pytest.approx(np.mean(per_seed)) and per_seed[0] == pytest.approx(single["margin"])
    assert _width(pooled["interval"]) > _width(pooled["interval_images"])
    assert pooled["interval"][0] <= pooled["margin"] <= pooled["interval"][1]
    assert pooled == pooled_paired_margin([run, other])  # seeded
    # a seed that scored other images: resampled over the union of keys
    shifted = {"keys": [f"j{i // 2}" for i in range(60)], "model": run["model"], "train_prior": prior}
    assert pooled_paired_margin([run, shifted])["n_images"] == 60
    with pytest.raises(ValueError, match="no train_prior"):
        pooled_paired_margin([{"keys": keys, "model": prior}])


# --------------------------------------------------------------------------- faithfulness


def test_deletion_insertion_auc_on_toy():
    image = torch.zeros(1, 4, 4)
    image[0, :2, :2] = 1.0  # all signal in patch 0 of a 2x2 grid
    def score(images):  # similarity = mean brightness of the top-left patch
        return images[:, 0, :2, :2].mean(dim=(1, 2))
    good = faith.deletion_insertion(score, image, [0, 1, 2, 3], (2, 2), steps=4, baseline="zero")
    assert good["deletion"] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert good["insertion"] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert good["deletion_auc"] == pytest.approx(0.125) and good["insertion_auc"] == pytest.approx(0.875)
    bad = faith.deletion_insertion(score, image, [3, 2, 1, 0], (2, 2), steps=4, baseline="zero")
    assert bad["deletion_auc"] == pytest.approx(0.875) and bad["insertion_auc"] == pytest.approx(0.125)
    assert faith.curve_auc([1, 1], [0, 1]) == 1.0


def test_sparsity_and_entropy():
    assert faith.sparsity([0.9, 0.1, 0.6, 0.2]) == 0.5
    assert faith.spatial_entropy(np.ones(16)) == pytest.approx(1.0)
    one_hot = np.zeros(16)
    one_hot[3] = 1
    assert faith.spatial_entropy(one_hot) == pytest.approx(0.0)


def test_cross_view_jaccard_maps_through_crop_params():
    full = full_image_params(64, 64)
    quad = {"crop": [0.0, 0.0, 32.0, 32.0], "angle": 0.0}  # top-left quadrant, 8 px patches
    a = np.zeros((4, 4))
    a[0, 0], a[0, 1] = 2.0, 1.0  # full view: cells (0,0) and (0,1) of the 16 px image grid
    b = np.zeros((4, 4))
    b[0, 0], b[0, 1] = 2.0, 1.0  # quadrant view: both centres (4,4),(12,4) fall in cell (0,0)
    assert faith.visible_cells(quad, (64, 64), (4, 4)) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert faith.cross_view_jaccard(a, full, b, quad, (64, 64), k=1) == 1.0
    assert faith.cross_view_jaccard(a, full, b, quad, (64, 64), k=2) == pytest.approx(0.5)
    c = np.zeros((4, 4))
    c[3, 3] = 1.0  # quadrant patch centre (28, 28) -> cell (1, 1)
    assert faith.cross_view_jaccard(a, full, c, quad, (64, 64), k=1) == 0.0
    # a selection outside the quadrant (cell (3,3)) is ignored: the quadrant cannot see it
    d = np.zeros((4, 4))
    d[3, 3], d[0, 0] = 2.0, 1.0
    assert faith.cross_view_jaccard(d, full, b, quad, (64, 64), k=2) == 1.0  # {(0,0)} vs {(0,0)}


# --------------------------------------------------------------------------- geometry


def test_distance_ratio_hand_computed():
    e = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    r = distance_ratio(e, ["s1", "s1", "s2", "s2"])
    assert r["intra"] == pytest.approx(0.0) and r["inter"] == pytest.approx(math.sqrt(2))
    assert r["ratio"] == pytest.approx(0.0) and r["n_intra_pairs"] == 2
    e2 = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    r2 = distance_ratio(e2, ["s1", "s1", "s2", "s2"])
    # intra pairs: (0,1),(2,3) at sqrt2; inter: (0,2)=0,(0,3)=sqrt2,(1,2)=sqrt2,(1,3)=0 -> mean sqrt2/2
    assert r2["ratio"] == pytest.approx(2.0)


# --------------------------------------------------------------------------- end to end: train run -> train eval


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """Tiny phantom shards and a 2-step `train run` of tiny-D on them (trained through the CLI)."""
    from typer.testing import CliRunner

    from cxrdr.reinforce.build import BuildOptions, build
    from cxrdr.train.cli import app

    root = tmp_path_factory.mktemp("eval-e2e")
    shards = root / "shards"
    build(BuildOptions(source="phantom:48", teachers="random:tiny", out=shards, n_aug=2, n_captions=2,
                       store_size=64, image_format="png", shard_size=100, workers=0, batch_size=16,
                       device="cpu", progress=False, source_options={"size": 64}))
    run = root / "run"
    result = CliRunner().invoke(app, ["run", "--shards", str(shards), "--model", "tiny-D", "--steps", "2",
                                      "--batch-size", "8", "--workers", "0", "--device", "cpu",
                                      "--out", str(run), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert (run / "best.pt").is_file()
    return shards, run


def test_an_evaluation_of_a_split_the_folder_lacks_names_the_splits_it_has(tiny_run):
    from cxrdr.train.evaluation.runner import evaluate

    shards, run = tiny_run
    counts = json.loads((shards / "dataset.json").read_text())["counts"]
    held = ", ".join(f"{name} {n}" for name, n in counts.items() if n)
    with pytest.raises(ValueError, match=rf"split 'tset' has no samples \(its splits: {held}\)"):
        evaluate(str(run / "best.pt"), shards, "tset")


def test_train_eval_cli_writes_outputs(tiny_run):
    from typer.testing import CliRunner

    from cxrdr.train.cli import app

    shards, run = tiny_run
    result = CliRunner().invoke(app, ["eval", "--ckpt", str(run / "best.pt"), "--shards", str(shards),
                                      "--min-positives", "2", "--n-faithfulness", "2", "--faith-steps", "4",
                                      "--probe-max-train", "24", "--quiet"])
    assert result.exit_code == 0, result.output
    out = run / "eval-test"  # default: beside the checkpoint
    for name in ("eval.json", "eval.md", "eval_ids.json", "heatmaps.png", "deletion_insertion.png"):
        assert (out / name).is_file(), name
    assert "i2t R@1" in result.output
    data = json.loads((out / "eval.json").read_text())
    assert data["retrieval"]["n_candidates"] >= 2 and "i2t_R@1_sametext" in data["retrieval"]
    assert data["meta"]["text_section"] == "both"
    # where the time went, phase by phase (a GPU host's evaluation that outlasted its chunk said nothing), and the
    # CPU's threads: on the CPU the process's own
    phases = data["meta"]["phase_s"]
    assert list(phases) == ["load", "embed", "retrieval", "embed_train", "probe", "zeroshot_geometry",
                            "localisation", "efficiency"]
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= data["meta"]["eval_seconds"] + 0.05
    assert data["meta"]["threads"] == torch.get_num_threads()
    lo = data["localisation"]
    assert lo["mask"]["n"] > 0  # phantom always has boxes
    for heat in ("mask", "attention"):  # every pointing game has its random-heatmap chance level beside it
        assert 0.0 < lo[heat]["chance_pointing_game"] < 1.0 and lo[heat]["n_boxes"] >= lo[heat]["n"]
        assert "image_similarity" in lo[heat] and "entropy" in lo[heat]
    assert all("chance_pointing_game" in d["mask"] for d in lo["per_label"].values())
    for heat in ("mask", "attention"):  # the image-blind baseline from the train split's boxes
        assert 0.0 <= lo[heat]["train_prior_pointing_game"] <= 1.0
    assert lo["train_prior"]["n_images"] > 0 and "pathology" in lo["mask"]
    assert "train prior" in (out / "eval.md").read_text()
    assert 0 < data["retrieval"]["oracle_mean_recall"] <= 1.0
    assert data["retrieval"]["mean_recall_findings"] >= data["retrieval"]["mean_recall"]
    assert 0.0 <= data["faithfulness"]["sparsity"] <= 1.0
    assert data["efficiency"]["gflops_per_img"] > 0 and data["efficiency"]["patch_usage_pct"] == 100.0
    ids = json.loads((out / "eval_ids.json").read_text())
    assert ids["retrieval"] and set(ids["retrieval"]) <= set(ids["all"]) and "zeroshot_5x200" in ids
    md = (out / "eval.md").read_text()
    assert "## Retrieval" in md and "## Linear probe" in md and "## Localisation" in md
    assert "| chance | x chance |" in md and "Collapse checks" in md
    _check_intervals_over_images(data, md, result.output, out)
    assert data["retrieval"]["chance_mean_recall"] == pytest.approx(
        np.mean([min(k, data["retrieval"]["n_candidates"]) / data["retrieval"]["n_candidates"] for k in (1, 5, 10)]))


def test_eval_rejects_bad_input(tiny_run, tmp_path):
    from typer.testing import CliRunner

    from cxrdr.train.cli import app

    shards, run = tiny_run
    result = CliRunner().invoke(app, ["eval", "--ckpt", str(tmp_path / "missing.pt"), "--shards", str(shards)])
    assert result.exit_code != 0 and "checkpoint not found" in str(result.exception or result.output)


def test_one_per_study_is_independent_of_row_order():
    """Frontal first, then key order; unknown views count as frontal; lateral only as a last resort."""
    from cxrdr.common.views import is_frontal, one_per_study

    rows = [("s1-b", "s1", "AP_SUPINE"), ("s1-a", "s1", "LATERAL"), ("s1-c", "s1", "PA"),
            ("s2-a", "s2", "LL"), ("s3-b", "s3", None), ("s3-a", "s3", "PA LLD"), ("x", "", "LATERAL")]
    picked = set()
    for order in (rows, rows[::-1], sorted(rows)):
        keys, studies, views = zip(*order)
        picked.add(frozenset(keys[i] for i in one_per_study(list(keys), list(studies), list(views))))
    assert picked == {frozenset({"s1-b", "s2-a", "s3-a", "x"})}
    assert is_frontal(" ap  Supine") and is_frontal("PA LLD") and not is_frontal(None) and not is_frontal("LL")


def test_quick_eval_and_eval_pick_the_same_retrieval_rows(tiny_run):
    """The in-training validation (loader batches) and `train eval` (load_split) choose the same
    one-image-per-study rows from the same split, whatever order the loader yields."""
    from cxrdr.common.views import one_per_study
    from cxrdr.train.data import make_eval_loader
    from cxrdr.train.evaluation.samples import load_split

    shards, _ = tiny_run
    samples = load_split(shards, "test")
    rows = one_per_study([s.key for s in samples], [s.meta.get("study_id") for s in samples],
                         [s.meta.get("view") for s in samples])
    eval_keys = {samples[i].key for i in rows}
    keys, studies, views = [], [], []
    for batch in make_eval_loader(shards, "test", None, batch_size=5, image_size=32, workers=2):
        keys += batch["key"]
        studies += batch["study_id"]
        views += batch["view"]
    assert sorted(keys) == sorted(s.key for s in samples)
    quick_keys = {keys[i] for i in one_per_study(keys, studies, views)}
    assert quick_keys == eval_keys and len(eval_keys) >= 2


# --------------------------------------------------------------------------- efficiency figures


def test_training_flops_count_the_backward_and_mfu_needs_a_known_peak():
    from cxrdr.train.evaluation.efficiency import (count_host_syncs, gflops, gpu_busy_ms, mfu_pct,
                                                   peak_bf16_flops, peak_bf16_flops_of)

    layer, x = torch.nn.Linear(8, 4, bias=False), torch.randn(2, 8)
    forward = 2 * 2 * 8 * 4  # one (2x8)@(8x4) matmul
    assert gflops(lambda: layer(x)) * 1e9 == forward
    # with grad: the forward and the weight gradient's matmul (x needs no gradient)
    assert gflops(lambda: layer(x).sum().backward(), grad=True) * 1e9 == 2 * forward
    assert peak_bf16_flops_of("NVIDIA H100 80GB HBM3") == 989e12 and peak_bf16_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops_of("NVIDIA H200") == 989e12 and peak_bf16_flops_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops_of("NVIDIA H100 NVL") is None and peak_bf16_flops_of("Tesla T4") is None  # not guessed
    # CPU: no peak, so no MFU; GPU busy and host syncs are CUDA-only and the step is not even run
    assert peak_bf16_flops("cpu") is None and mfu_pct(1e9, 100.0, "cpu") is None
    assert gpu_busy_ms(lambda: 1 / 0, 3, "cpu") is None and count_host_syncs(lambda: 1 / 0, 1, "cpu") is None


def test_flop_counts_include_attention_on_cpu():
    """torch's counter alone counts 0 for CPU attention; ours counts its two products, and the backward's five."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from cxrdr.train.evaluation.efficiency import gflops

    q = torch.randn(3, 2, 10, 8, requires_grad=True)
    k, v = torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    mask = torch.zeros(3, 1, 1, 6).masked_fill(torch.arange(6) >= 4, float("-inf"))
    product = 2 * (3 * 2) * 10 * 6 * 8  # one (10x8)@(8x6) per batch and head
    with FlopCounterMode(display=False) as plain:
        F.scaled_dot_product_attention(q, k, v)
    assert plain.get_total_flops() == 0  # what the count missed (if torch starts counting it, this flags it)
    assert gflops(lambda: F.scaled_dot_product_attention(q, k, v)) * 1e9 == 2 * product
    assert gflops(lambda: F.scaled_dot_product_attention(q.detach()[:1].expand(3, -1, -1, -1), k, v,
                                                         attn_mask=mask)) * 1e9 == 2 * product
    step = gflops(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward(), grad=True) * 1e9
    assert step == (2 + 5) * product  # the backward recomputes the scores and has four more products


def _check_intervals_over_images(data: dict, md: str, printed: str, out) -> None:
    """Issue 37: every pointing game and prior of eval.json keeps its per-target hits with image keys and an
    interval over images; the paired margin over the train-box prior is beside them, in eval.md too."""
    lo = data["localisation"]
    assert lo["bootstrap"]["unit"] == "image" and lo["bootstrap"]["n_boot"] == 2000
    hits = lo["hits"]
    all_keys = set(json.loads((out / "eval_ids.json").read_text())["localisation"])
    for name, block, figures in (("mask", lo["mask"], ("model", "chance", "loo_prior", "train_prior")),
                                 ("mask_pathology", lo["mask"]["pathology"], ("model", "chance", "train_prior")),
                                 ("attention", lo["attention"], ("model", "chance", "loo_prior", "train_prior"))):
        h = hits[name]
        assert len(h["keys"]) == block["n"] and set(h["keys"]) <= all_keys, name
        for hit_name in figures:
            figure = {"model": "pointing_game", "chance": "chance_pointing_game", "loo_prior": "prior_pointing_game",
                      "train_prior": "train_prior_pointing_game"}[hit_name]
            assert len(h[hit_name]) == len(h["keys"]), (name, hit_name)
            values = [v for v in h[hit_name] if v is not None]
            if not values:
                continue
            # the per-target hits are what the figure averages, and its interval holds it
            assert np.mean(values) == pytest.approx(block[figure]), (name, figure)
            lo_, hi_ = block[f"{figure}_interval"]
            assert lo_ <= block[figure] <= hi_, (name, figure)
        assert set(h["model"]) <= {0, 1} and set(h["train_prior"]) <= {0, 1}
        assert block["margin_over_train_prior"] == pytest.approx(
            block["pointing_game"] - block["train_prior_pointing_game"])
        m_lo, m_hi = block["margin_over_train_prior_interval"]
        assert m_lo <= block["margin_over_train_prior"] <= m_hi
    assert len(hits["attention"]["labels"]) == len(hits["attention"]["keys"])
    for label, d in lo["per_label"].items():
        if d["attention"].get("n"):
            assert "margin_over_train_prior_interval" in d["attention"] and "pointing_game_interval" in d["attention"]
        assert "pointing_game_interval" in d["mask"], label
    s = data["summary"]
    assert s["pointing_z_interval"] == lo["mask"]["pointing_game_interval"]
    assert s["train_prior_pointing_attn_interval"] == lo["attention"]["train_prior_pointing_game_interval"]
    assert s["margin_attn_train_prior"] == lo["attention"]["margin_over_train_prior"]
    assert s["margin_z_train_prior_interval"] == lo["mask"]["margin_over_train_prior_interval"]
    # eval.md and the printed table: 'value [lo, hi]' and the margin; a prior never gets a bare '± 0.000'
    assert "| − train prior |" in md and "±" not in md
    train_prior = lo["mask"]["train_prior_pointing_game"]
    t_lo, t_hi = lo["mask"]["train_prior_pointing_game_interval"]
    assert f"{train_prior:.3f} [{t_lo:.3f}, {t_hi:.3f}]" in md
    assert "PG z − train prior" in printed and "PG attn train prior" in printed
    assert f"{s['margin_attn_train_prior']:+.3f} [" in printed


def test_the_train_split_is_read_once_per_folder_state(phantom_shards, tmp_path, monkeypatch):
    """An evaluation's probe rows and train boxes come from one pass over the train split, kept while the folder's
    dataset.json is unchanged (a recipe evaluates a dozen runs against one split) and read again once it changes."""
    import math
    import os
    import shutil

    from cxrdr.common.shards import read_dataset_info
    from cxrdr.train.evaluation import samples as samples_module

    folder = tmp_path / "shards"
    shutil.copytree(phantom_shards, folder)
    passes = []
    real = samples_module.iter_samples
    monkeypatch.setattr(samples_module, "iter_samples", lambda *a: passes.append(a) or real(*a))
    rows = samples_module.train_split_rows(folder, "train", 5)
    every = list(real(folder, "train"))
    stride = math.ceil(read_dataset_info(folder)["counts"]["train"] / 5)
    assert [s.key for s in rows.probe] == [s.key for s in every[::stride]][:5] and len(rows.probe) <= 5
    assert len(rows.boxes) == sum(bool(s.meta.get("boxes")) for s in every) > 0
    assert samples_module.train_split_rows(folder, "train", 5) is rows and len(passes) == 1
    info = folder / "dataset.json"
    info.write_text(info.read_text())  # rewritten (add-teacher rewrites it): read again
    stat = info.stat()
    os.utime(info, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # however coarse the clock
    assert samples_module.train_split_rows(folder, "train", 5) == rows and len(passes) == 2
    assert samples_module.train_split_rows(folder, "no-such-split", 5) == samples_module.TrainSplitRows((), ())


def test_full_views_are_decoded_once_per_process_and_embed_as_before(tiny_run, monkeypatch):
    """Evaluations of several runs on the same images decode and replay them once (``cached_full_views``); the
    embeddings are those of views decoded batch by batch, bit for bit; other bytes under the same key are decoded
    anew, and a set over the memory budget is not kept."""
    from dataclasses import replace

    from cxrdr.train.evaluation import embedding
    from cxrdr.train.evaluation.samples import iter_samples

    shards, run = tiny_run
    samples = list(iter_samples(shards, "train"))[:10]
    model = embedding.as_eval_model(str(run / "best.pt"))
    decoded = []
    real_full_view = embedding.full_view
    monkeypatch.setattr(embedding, "full_view", lambda s, size: decoded.append(s.key) or real_full_view(s, size))
    monkeypatch.setattr(embedding, "_VIEWS", type(embedding._VIEWS)())
    first = embedding.embed_images(model, samples, 4, False, "")
    again = embedding.embed_images(model, samples, 4, False, "")
    assert len(decoded) == 10 and np.array_equal(first, again)
    monkeypatch.setattr(embedding, "VIEW_CACHE_MB", 0)  # over the budget: decoded batch by batch, as before
    assert np.array_equal(embedding.embed_images(model, samples, 4, False, ""), first) and len(decoded) == 20
    monkeypatch.setattr(embedding, "VIEW_CACHE_MB", 1024)
    flipped = [replace(s, image_bytes=samples[0].image_bytes) for s in samples[1:2]] + samples[2:]  # new bytes
    embedding.embed_images(model, [samples[0]] + flipped, 4, False, "")
    assert len(decoded) == 30  # the same keys with other bytes are another set of images


def test_localisation_scores_are_the_same_whatever_the_forwards_batch(tiny_run):
    """The maps' forwards run ``batch_size`` images a call: every row's heatmaps, pointing hits and faithfulness
    curves are those of one forward an image (float rounding aside), and the rows come back in order."""
    from cxrdr.train.evaluation import embedding
    from cxrdr.train.evaluation.samples import iter_samples, retrieval_text
    from cxrdr.train.evaluation.student_maps import localisation_and_faithfulness

    shards, run = tiny_run
    samples = list(iter_samples(shards, "train"))[:14]
    assert sum(bool(s.meta.get("boxes")) for s in samples) >= 3
    texts = [retrieval_text(s, "both")[0] for s in samples]
    model = embedding.as_eval_model(str(run / "best.pt"))

    def run_maps(batch_size):
        return localisation_and_faithfulness(model, samples, texts, 10, 3, 4, 0.2, 4, 0, False, batch_size=batch_size)

    (loc1, faith1, plots1), (loc5, faith5, plots5) = run_maps(1), run_maps(5)
    assert loc1["hits"] == loc5["hits"] and plots1["ids"] == plots5["ids"]
    assert loc1["mask"]["pointing_game"] == loc5["mask"]["pointing_game"]
    assert loc1["mask"]["image_similarity"] == pytest.approx(loc5["mask"]["image_similarity"], abs=1e-5)
    assert [p["key"] for p in plots1["heatmaps"]] == [p["key"] for p in plots5["heatmaps"]]
    for one, five in zip(plots1["heatmaps"], plots5["heatmaps"]):
        np.testing.assert_allclose(one["z"], five["z"], atol=1e-5)
        for (label1, heat1), (label5, heat5) in zip(one["attn"], five["attn"]):
            assert label1 == label5
            np.testing.assert_allclose(heat1, heat5, atol=1e-5)
    assert sum(len(p["attn"]) for p in plots1["heatmaps"]) >= 2  # the words' maps are compared too
    assert faith1["n_images"] == faith5["n_images"] == 3
    np.testing.assert_allclose(faith1["curves"]["deletion"], faith5["curves"]["deletion"], atol=1e-5)
    assert faith1["cross_view_jaccard"] == pytest.approx(faith5["cross_view_jaccard"], abs=1e-9)
