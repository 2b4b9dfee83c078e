"""Replayable augmentations (cxrdr/common/augment.py): determinism, geometry, size independence."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from cxrdr.common.augment import (AugConfig, full_image_params, image_to_view, replay, resize_short_side,
                               sample_param_sets, view_to_image)


def structured_image(w: int = 240, h: int = 200, seed: int = 0) -> Image.Image:
    """A smooth random texture with edges: enough structure to compare regions across sizes."""
    rng = np.random.default_rng(seed)
    noise = torch.from_numpy(rng.random((1, 1, h // 8, w // 8)).astype(np.float32))
    smooth = F.interpolate(noise, size=(h, w), mode="bicubic", align_corners=False)[0, 0].numpy()
    yy, xx = np.mgrid[0:h, 0:w]
    smooth += 0.5 * ((xx // 40 + yy // 40) % 2)  # a checkerboard for sharp edges
    smooth = (smooth - smooth.min()) / (smooth.max() - smooth.min())
    return Image.fromarray((smooth * 255).astype(np.uint8), mode="L")


RICH = AugConfig(max_angle=10, randaugment_n=3)


def test_params_are_deterministic_json_and_key_dependent():
    a = sample_param_sets("rec-1", 240, 200, 5, RICH, seed=3)
    b = sample_param_sets("rec-1", 240, 200, 5, RICH, seed=3)
    assert a == b
    assert json.loads(json.dumps(a)) == a
    assert sample_param_sets("rec-2", 240, 200, 5, RICH, seed=3) != a
    assert sample_param_sets("rec-1", 240, 200, 5, RICH, seed=4) != a


def test_replay_twice_is_identical():
    image = structured_image()
    for params in sample_param_sets("twice", *image.size, 6, RICH, seed=0):
        first, second = replay(image, params, 64), replay(image, params, 64)
        assert first.shape == (1, 64, 64) and first.dtype == torch.float32
        assert torch.equal(first, second)
        assert 0.0 <= float(first.min()) and float(first.max()) <= 1.0


def test_replay_accepts_pil_array_and_tensor_alike():
    image = structured_image()
    params = sample_param_sets("inputs", *image.size, 1, RICH)[0]
    from_pil = replay(image, params, 48)
    assert torch.equal(from_pil, replay(np.asarray(image), params, 48))
    assert torch.equal(from_pil, replay(torch.from_numpy(np.array(image)), params, 48))


@pytest.mark.parametrize("size", [(256, 256), (300, 200), (200, 300), (1000, 100), (64, 900)])
def test_crop_boxes_stay_inside_the_image(size):
    w, h = size
    cfg = AugConfig(scale=(0.08, 1.0))
    for i in range(20):
        for p in sample_param_sets(f"box-{i}", w, h, 10, cfg, seed=i):
            x0, y0, bw, bh = p["crop"]
            assert bw > 0 and bh > 0
            # params are rounded to 3 decimals; allow that much slack
            assert x0 >= -1e-3 and y0 >= -1e-3
            assert x0 + bw <= w + 2e-3 and y0 + bh <= h + 2e-3
            assert -cfg.max_angle <= p["angle"] <= cfg.max_angle
            assert p["hflip"] is False  # laterality: no flip by default


def test_replay_at_224_and_112_shows_the_same_region():
    image = structured_image(320, 280)
    cfg = AugConfig(max_angle=10, randaugment_n=0)
    for params in sample_param_sets("sizes", *image.size, 5, cfg, seed=1):
        big = replay(image, params, 224)
        small = replay(image, params, 112)
        down = F.avg_pool2d(big.unsqueeze(0), 2).squeeze(0)
        corr = np.corrcoef(down.flatten().numpy(), small.flatten().numpy())[0, 1]
        assert corr > 0.98, (params, corr)


def test_image_to_view_inverts_view_to_image():
    rng = np.random.default_rng(0)
    for hflip in (False, True):
        params = {"crop": [13.5, 20.25, 150.0, 110.0], "angle": 6.5, "hflip": hflip}
        uv = rng.uniform(-1, 1, size=(50, 2))
        xy = view_to_image(params, uv)
        np.testing.assert_allclose(image_to_view(params, xy), uv, atol=1e-9)
        np.testing.assert_allclose(view_to_image(params, image_to_view(params, xy)), xy, atol=1e-9)
    # The crop's corners map to the view's corners when there is no rotation.
    flat = {"crop": [10.0, 20.0, 100.0, 50.0], "angle": 0.0}
    np.testing.assert_allclose(view_to_image(flat, [[-1, -1], [1, 1]]), [[10, 20], [110, 70]])


def test_replay_puts_a_point_where_image_to_view_says():
    """The stored geometry (params) and the pixels of replay agree (boxes can be mapped into views)."""
    w, h, size = 200, 160, 100
    arr = np.zeros((h, w), dtype=np.uint8)
    arr[38:43, 148:153] = 255  # a 5x5 bright square centred at pixel (150.5, 40.5) in continuous coords
    params = {"crop": [60.0, 10.0, 120.0, 120.0], "angle": 8.0, "hflip": False, "brightness": 1.0,
              "contrast": 1.0, "gamma": 1.0, "ops": [], "noise_seed": 0}
    out = replay(Image.fromarray(arr), params, size)[0].numpy()
    rows, cols = np.mgrid[0:size, 0:size]
    row, col = (out * rows).sum() / out.sum(), (out * cols).sum() / out.sum()  # blob centroid
    u, v = image_to_view(params, [[150.5, 40.5]])[0]
    expected_col, expected_row = (u + 1) / 2 * size - 0.5, (v + 1) / 2 * size - 0.5
    assert abs(col - expected_col) < 0.5 and abs(row - expected_row) < 0.5, (row, col, expected_row, expected_col)


def test_full_image_params_reproduce_the_image():
    image = structured_image(96, 96)
    out = replay(image, full_image_params(96, 96), 96)[0].numpy()
    np.testing.assert_allclose(out, np.asarray(image, dtype=np.float32) / 255.0, atol=1e-5)


def test_resize_short_side_keeps_aspect():
    image = structured_image(300, 200)
    resized = resize_short_side(image, 100)
    assert resized.size == (150, 100)
    assert resize_short_side(image, 200) is image


@pytest.mark.parametrize("size", [64, 37, 224])
def test_replay_many_equals_stacked_replay_calls(size):
    """The build's batched replay gives the very bits of one replay() call per parameter set (what
    stage 2 replays): a view does not depend on the other views replayed with it."""
    from cxrdr.common.augment import replay_many

    image = structured_image(300, 256)
    params = sample_param_sets("many", *image.size, 8, RICH, seed=2)  # crops pooled by different factors
    params += sample_param_sets("many-flip", *image.size, 4, AugConfig(hflip=True, scale=(0.08, 1.0),
                                                                       randaugment_n=2), seed=5)
    params.append(full_image_params(*image.size))
    params[1] = {**params[1], "hflip": True}
    expected = torch.stack([replay(image, p, size) for p in params])
    for pixels in (image, np.asarray(image), torch.from_numpy(np.array(image))):
        got = replay_many(pixels, params, size)
        assert got.shape == (len(params), 1, size, size) and got.dtype == torch.float32
        assert torch.equal(got, expected)
    assert torch.equal(replay_many(image, params[:1], size), expected[:1])
    assert replay_many(image, [], size).shape == (0, 1, size, size)


# posterize and solarize are step functions: a pixel within float rounding of a step lands on either
# side of it, whatever the tolerance, so those views bound the share of such pixels instead.
STEP_OPS = {"posterize", "solarize"}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _mixed_batch():
    """Four stored images of different sizes in one zero-padded canvas, and views of each exercising
    every photometric op (noise with its seed), flips, rotations, small and whole-image crops."""
    from cxrdr.common.augment import RANDAUGMENT_OPS, to_float_image

    dims = [(300, 256), (256, 256), (200, 310), (97, 64)]
    images = [structured_image(w, h, seed=i) for i, (w, h) in enumerate(dims)]
    cfg = AugConfig(max_angle=15, scale=(0.05, 1.0), ratio=(0.5, 2.0), randaugment_n=2, randaugment_magnitude=7,
                    hflip=True)
    per_image = []
    for i, (w, h) in enumerate(dims):
        params = sample_param_sets(f"batch-{i}", w, h, 7, cfg, seed=i)
        for j, name in enumerate(RANDAUGMENT_OPS):
            params[j]["ops"] = [[name, 6.0]] + params[j]["ops"][:1]
        per_image.append(params + [full_image_params(w, h)])
    height, width = max(h for _, h in dims), max(w for w, _ in dims)
    canvas = torch.stack([F.pad(to_float_image(im), (0, width - im.size[0], 0, height - im.size[1]))
                          for im in images])
    return images, dims, canvas, per_image


@pytest.mark.parametrize("device", DEVICES)
def test_batched_replay_equals_the_per_sample_cpu_replay_within_1_255(device):
    """The build's batched replay (--replay device: views of many images at once, on the teachers'
    device) gives each pixel of stage 2's per-sample CPU replay within 1/255. Measured on CPU: at
    most 3e-5 apart (another canvas size rounds the sampling grid differently)."""
    from cxrdr.common.augment import replay_batch, replay_many

    images, dims, canvas, per_image = _mixed_batch()
    params = [p for ps in per_image for p in ps]
    owners = [i for i, ps in enumerate(per_image) for _ in ps]
    steps = torch.tensor([any(name in STEP_OPS for name, _ in p["ops"]) for p in params])
    for size in (224, 37):
        got = replay_batch(canvas.to(device), dims, params, owners, size).cpu()
        expected = torch.cat([replay_many(im, ps, size) for im, ps in zip(images, per_image)])
        assert got.shape == expected.shape == (len(params), 1, size, size)
        diff = (got - expected).abs()
        assert diff[~steps].max() <= 1 / 255, (size, float(diff[~steps].max()))
        assert (diff[steps] > 1 / 255).float().mean() < 1e-4, size
    # Images of one size need no padding: a batch of them is the per-sample replay bit for bit.
    from cxrdr.common.augment import to_float_image

    two = torch.stack([to_float_image(images[1]), to_float_image(images[1].transpose(Image.Transpose.FLIP_LEFT_RIGHT))])
    params = per_image[1] + per_image[0][:3]
    same = replay_batch(two, None, params, [0] * len(per_image[1]) + [1] * 3, 64)
    expected = torch.cat([replay_many(images[1], per_image[1], 64),
                          replay_many(images[1].transpose(Image.Transpose.FLIP_LEFT_RIGHT), per_image[0][:3], 64)])
    assert torch.equal(same, expected)


def test_one_view_of_each_image_replayed_together_is_the_per_sample_replay_bit_for_bit():
    """The training loaders' collate (augment.replay_each): a batch's views, one per image, every
    photometric op among them; the images of one size replay in one call, another size apart."""
    from cxrdr.common.augment import replay_each

    images, dims, _, per_image = _mixed_batch()
    # two images of each of the 4 sizes: 4 groups of 2, each view another image's
    batch = [im for im in images for _ in range(2)]
    params = [per_image[i // 2][i % len(per_image[i // 2])] for i in range(len(batch))]
    got = replay_each(batch, params, 40)
    expected = torch.stack([replay(im, p, 40) for im, p in zip(batch, params)])
    assert got.shape == (8, 1, 40, 40) and torch.equal(got, expected)


@pytest.mark.parametrize("change, needle", [
    (lambda p: p.pop("crop"), "crop must be 4 numbers"),
    (lambda p: p.update(crop=[0, 0, "64", 64]), "crop must be 4 numbers"),
    (lambda p: p.update(angle=None), "angle must be a number"),
    (lambda p: p.update(ops=[["zoom", 3.0]]), "an op must be [name, magnitude]"),
    (lambda p: p.update(noise_seed=1.5), "noise_seed must be an integer"),
])
def test_check_params_names_what_replay_could_not_read(change, needle):
    from cxrdr.common.augment import check_params

    params = sample_param_sets("rec-1", 240, 200, 1, RICH, seed=3)[0]
    assert check_params(params) is params
    change(params)
    with pytest.raises(ValueError, match=re.escape(needle)):
        check_params(params)
