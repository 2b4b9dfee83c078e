"""`reinforce inspect --views`: the drawn boxes follow the replayed pixels (cxrdr/reinforce/views_sheet.py).
The command itself, on a built shard folder, is tested beside `inspect` in tests/test_build.py."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.path import Path as Outline
from PIL import Image

from cxrdr.common.augment import full_image_params, replay
from cxrdr.reinforce.views_sheet import box_outline, view_caption


def test_an_unaugmented_view_draws_the_box_where_it_is_scaled_to_the_view():
    outline = box_outline(full_image_params(64, 64), [8.0, 16.0, 40.0, 24.0], 32)
    corners = np.array([[4, 8], [20, 8], [20, 12], [4, 12], [4, 8]]) - 0.5  # imshow: pixel j's centre at j
    np.testing.assert_allclose(outline, corners, atol=1e-9)


def _distance_to_edges(points: np.ndarray, outline: np.ndarray) -> np.ndarray:
    """Each point's distance to the nearest edge of a closed outline (its segments)."""
    a, b = outline[:-1][None], outline[1:][None]  # (1, E, 2)
    p = points[:, None]  # (N, 1, 2)
    t = np.clip(((p - a) * (b - a)).sum(-1) / ((b - a) ** 2).sum(-1), 0, 1)
    return np.linalg.norm(p - (a + t[..., None] * (b - a)), axis=-1).min(axis=1)


@pytest.mark.parametrize("angle,hflip", [(0.0, True), (17.0, False), (-25.0, True)])
def test_the_outline_drawn_on_a_view_holds_the_replayed_pixels_of_the_box(angle, hflip):
    """A bright box in the stored image, replayed through a crop, a rotation and a flip: the view's pixels
    whose centres lie more than 1.5 pixels inside the drawn outline are bright, those as far outside it dark."""
    stored = np.zeros((96, 96), dtype=np.uint8)
    box = [30.0, 20.0, 62.0, 44.0]
    stored[20:44, 30:62] = 255
    params = {**full_image_params(96, 96), "crop": [12.0, 6.0, 72.0, 66.0], "angle": angle, "hflip": hflip}
    size = 48
    view = replay(Image.fromarray(stored), params, size)[0].numpy()
    outline = box_outline(params, box, size)
    rows, cols = np.mgrid[0:size, 0:size]
    centres = np.stack([cols.ravel(), rows.ravel()], axis=1).astype(np.float64)
    within = Outline(outline).contains_points(centres).reshape(size, size)
    far = (_distance_to_edges(centres, outline) > 1.5).reshape(size, size)
    inside, outside = within & far, ~within & far
    assert inside.sum() > 50 and outside.sum() > 500
    assert view[inside].min() > 0.95 and view[outside].max() < 0.05


def test_a_views_caption_names_its_crop_rotation_flip_and_photometry():
    params = {"crop": [0.0, 0.0, 50.0, 40.0], "angle": -3.25, "hflip": True, "brightness": 1.1, "contrast": 0.9,
              "gamma": 1.2, "ops": [["sharpness", 4.0]], "noise_seed": 1}
    assert view_caption(params, [100, 80]) == "25 % crop, -3.2°, flip, b 1.10 c 0.90 g 1.20, sharpness"


def test_own_ranks_count_the_candidates_scoring_strictly_higher():
    from cxrdr.reinforce.teacher_check import own_ranks, rank_summary

    candidates = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.6, 0.8]])
    queries = np.array([[2.0, 0.0],    # its own candidate 0 exactly: first
                        [0.0, 1.0],    # own candidate 1; candidate 2 is the same text: a tie, still first
                        [1.0, 0.0],    # own candidate 1, orthogonal: candidates 0 and 3 score higher
                        [0.0, 3.0]])   # own candidate 3 (cos 0.8) behind candidates 1 and 2 (cos 1)
    ranks = own_ranks(queries, candidates, np.array([0, 1, 1, 3]))
    assert ranks.tolist() == [1, 1, 3, 3]
    summary = rank_summary(ranks, n=4)
    assert summary["R@1"] == 0.5 and summary["R@5"] == 1.0 and summary["median_rank"] == 2.0
    assert summary["chance_R@1"] == 0.25 and summary["chance_R@10"] == 1.0 and summary["chance_median_rank"] == 2.5
