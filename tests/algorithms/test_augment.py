"""Batched augmentation (pfl_algorithms/data/augment/) against float64 per-sample references.

torchvision cannot be imported here (a CPU build of torch), so each reference below is
written straight from torchvision's definitions (RandomCrop, RandomHorizontalFlip,
RandomResizedCrop.get_params, the tensor ColorJitter / rgb_to_grayscale), one sample at a
time in float64, using the parameters the batched code draws: each test draws them again
from a generator with the same seed through the module's public ``draw_*`` functions.
The resize reference is torch's own ``F.interpolate(bilinear, antialias=True)`` of the box;
the HSV reference is Python's ``colorsys`` pixel by pixel.
"""
from __future__ import annotations

import colorsys
import math

import pytest
import torch
import torch.nn.functional as F

from pfl_algorithms.data import augment
from pfl_algorithms.data.augment import (AUGMENTATIONS, Augmentation, JitterParams, apply_color_jitter, color_jitter,
                                         draw_crop_offsets, draw_flips, draw_grayscale, draw_jitter_params,
                                         draw_resized_crop_boxes, horizontal_flip, make_augmentation,
                                         parse_augmentation_spec, random_crop, random_grayscale, random_resized_crop)
from tests.tolerances import assert_close

SEED = 1234
MEAN3, STD3 = (0.491, 0.482, 0.447), (0.247, 0.243, 0.262)  # CIFAR-10's, as the released code
MEAN1, STD1 = (0.1307,), (0.3081,)  # MNIST's
SHAPES = [(5, 1, 7, 9), (5, 3, 7, 9), (4, 3, 8, 8)]
DTYPES = [torch.float32, torch.float64]


def gen(seed: int = SEED) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pixels(shape, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """Random pixels strictly inside (0, 1) (never zeros, no exact ties)."""
    return (0.02 + 0.96 * torch.rand(shape, generator=gen(seed), dtype=torch.float64)).to(dtype)


def normalized(shape, dtype=torch.float32, seed: int = 0):
    channels = shape[1]
    mean, std = (MEAN3, STD3) if channels == 3 else (MEAN1, STD1)
    m, s = torch.tensor(mean).reshape(-1, 1, 1), torch.tensor(std).reshape(-1, 1, 1)
    return ((pixels(shape, torch.float64, seed) - m) / s).to(dtype), mean, std


def stats(mean, std):
    return (torch.tensor(mean, dtype=torch.float64).reshape(-1, 1, 1),
            torch.tensor(std, dtype=torch.float64).reshape(-1, 1, 1))


# ---------------------------------------------------------------------------------------------
# Per-sample float64 references, from torchvision's definitions.


def ref_crop(img, top, left, padding, fill):
    """RandomCrop((H, W), padding): pad with fill (per channel), then slice at (top, left)."""
    c, h, w = img.shape
    canvas = torch.empty(c, h + 2 * padding, w + 2 * padding, dtype=torch.float64)
    canvas[:] = torch.as_tensor(fill, dtype=torch.float64).reshape(-1, 1, 1)
    canvas[:, padding:padding + h, padding:padding + w] = img
    return canvas[:, top:top + h, left:left + w]


def ref_resized_crop(img, top, left, box_h, box_w, size):
    box = img[None, :, top:top + box_h, left:left + box_w]
    return F.interpolate(box, size=size, mode="bilinear", align_corners=False, antialias=True)[0]


def ref_gray(img):
    return 0.2989 * img[0] + 0.587 * img[1] + 0.114 * img[2]


def ref_blend(img, other, factor):
    return (factor * img + (1 - factor) * other).clamp(0, 1)


def ref_hue(img, shift):
    out = torch.empty_like(img)
    for i in range(img.shape[1]):
        for j in range(img.shape[2]):
            h, s, v = colorsys.rgb_to_hsv(*(float(c) for c in img[:, i, j]))
            out[:, i, j] = torch.tensor(colorsys.hsv_to_rgb((h + shift) % 1.0, s, v), dtype=torch.float64)
    return out


def ref_jitter(img, order, factors, enabled):
    """ColorJitter's forward for one image: the enabled adjustments in ``order``."""
    grey = img.shape[0] == 1
    for k in order:
        if not enabled[k] or (grey and k in (2, 3)):
            continue
        f = float(factors[k])
        if k == 0:
            img = ref_blend(img, torch.zeros_like(img), f)
        elif k == 1:
            img = ref_blend(img, (img if grey else ref_gray(img)).mean(), f)
        elif k == 2:
            img = ref_blend(img, ref_gray(img), f)
        else:
            img = ref_hue(img, f)
    return img


def ref_get_params(height, width, scale, ratio, tries, place):
    """RandomResizedCrop.get_params, scalar Python, fed with the batched draw's uniforms."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for u_area, u_aspect in tries.tolist():
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u_area)
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u_aspect)
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return (math.floor(place[0] * (height - h + 1)), math.floor(place[1] * (width - w + 1)), h, w)
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


# ---------------------------------------------------------------------------------------------
# The steps, each against its reference with the same draws.


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("padding", [0, 1, 4])
def test_random_crop_matches_reference(shape, dtype, padding):
    x = pixels(shape, dtype)
    fill = 0.0 if shape[1] == 1 else (0.1, -0.5, 2.0)
    out = random_crop(x, gen(), padding=padding, fill=fill)
    top, left = draw_crop_offsets(shape[0], padding, gen())
    fill_in_dtype = torch.tensor(fill, dtype=dtype).double()  # the fill as x's dtype holds it
    expected = torch.stack([ref_crop(x[b].double(), int(top[b]), int(left[b]), padding, fill_in_dtype)
                            for b in range(shape[0])])
    assert out.dtype == dtype and out.shape == x.shape
    # A crop moves values: exact.
    assert torch.equal(out.double(), expected)


def test_crop_offsets_cover_exactly_0_to_2_padding():
    for padding in (1, 4):
        top, left = draw_crop_offsets(4000, padding, gen())
        assert top.dtype == torch.int64 and top.device.type == "cpu"
        assert set(top.tolist()) == set(range(2 * padding + 1)) == set(left.tolist())
    # Roughly uniform: each of the 9 offsets of padding 4 within 5 sigma of 4000 / 9.
    counts = torch.bincount(top, minlength=9).double()
    assert ((counts - 4000 / 9).abs() < 5 * math.sqrt(4000 / 9)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_horizontal_flip_matches_reference(shape, dtype):
    x = pixels(shape, dtype)
    out = horizontal_flip(x, gen(), p=0.5)
    flips = draw_flips(shape[0], 0.5, gen())
    expected = torch.stack([x[b].flip(-1) if flips[b] else x[b] for b in range(shape[0])])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("p", [0.5, 0.3])
def test_flip_probability(p):
    n = 20000
    flips = draw_flips(n, p, gen())
    assert abs(float(flips.double().mean()) - p) < 5 * math.sqrt(p * (1 - p) / n)
    x = pixels((n, 1, 1, 2))
    out = horizontal_flip(x, gen(), p=p)
    assert torch.equal(out[:, 0, 0, 0] == x[:, 0, 0, 1], flips)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("size", [None, (4, 5), (11, 6), 16])
def test_random_resized_crop_matches_interpolate(shape, dtype, size):
    """Upsampling (None, 16), downsampling (4x5: the antialiased filter) and mixed (11x6)."""
    x = pixels(shape, dtype)
    out = random_resized_crop(x, gen(), size=size)
    boxes = draw_resized_crop_boxes(shape[0], shape[2], shape[3], generator=gen())
    out_size = tuple(shape[2:]) if size is None else (size, size) if isinstance(size, int) else size
    expected = torch.stack([ref_resized_crop(x[b].double(), *(int(v[b]) for v in boxes), out_size)
                            for b in range(shape[0])])
    assert out.dtype == dtype and out.shape == (*shape[:2], *out_size)
    assert_close(out, expected, dtype, "resized crop")


@pytest.mark.parametrize("height, width", [(7, 9), (9, 7), (32, 32), (5, 40)])
@pytest.mark.parametrize("scale, ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.5, 0.9), (0.5, 2.0)),
                                          ((2.0, 3.0), (3 / 4, 4 / 3)),  # never fits: fallback
                                          ((2.0, 3.0), (2.0, 3.0)), ((2.0, 3.0), (0.2, 0.5))])
def test_resized_crop_boxes_match_get_params(height, width, scale, ratio):
    batch = 64
    top, left, box_h, box_w = draw_resized_crop_boxes(batch, height, width, scale=scale, ratio=ratio,
                                                      generator=gen())
    # The draws, as the docstring lists them.
    g = gen()
    tries = torch.rand(batch, 10, 2, generator=g, dtype=torch.float64)
    place = torch.rand(batch, 2, generator=g, dtype=torch.float64)
    for b in range(batch):
        expected = ref_get_params(height, width, scale, ratio, tries[b], place[b].tolist())
        assert (int(top[b]), int(left[b]), int(box_h[b]), int(box_w[b])) == expected, b
    assert ((box_h > 0) & (box_w > 0) & (top >= 0) & (left >= 0)).all()
    assert ((top + box_h <= height) & (left + box_w <= width)).all()


def test_resized_crop_boxes_distribution():
    top, left, box_h, box_w = draw_resized_crop_boxes(5000, 32, 32, generator=gen())
    area = (box_h * box_w).double() / 1024
    aspect = box_w.double() / box_h.double()
    # Rounding to whole pixels stretches the bounds a little.
    assert float(area.min()) > 0.05 and float(area.max()) <= 1.0
    assert float(aspect.min()) > 0.6 and float(aspect.max()) < 1.7
    assert float(area.mean()) > 0.4  # uniform area fraction in [0.08, 1]: mean 0.54
    # Offsets uniform on [0, 32 - h]: both ends reached, relative position centred.
    assert bool((top == 0).any()) and bool(((top == 32 - box_h) & (box_h < 32)).any())
    relative = (top.double() + 0.5) / (33 - box_h).double()
    assert abs(float(relative.mean()) - 0.5) < 0.02


def random_params(batch, *, channels_enabled=(True, True, True, True), seed=5, apply=None):
    """JitterParams with large factors (results get clamped) and random orders."""
    g = gen(seed)
    factors = torch.stack([torch.rand(batch, generator=g, dtype=torch.float64) * 2,
                           torch.rand(batch, generator=g, dtype=torch.float64) * 2,
                           torch.rand(batch, generator=g, dtype=torch.float64) * 2,
                           torch.rand(batch, generator=g, dtype=torch.float64) - 0.5], 1)
    order = torch.rand(batch, 4, generator=g).argsort(1)
    apply = torch.ones(batch, dtype=torch.bool) if apply is None else apply
    return JitterParams(apply=apply, order=order, factors=factors, enabled=channels_enabled)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_apply_color_jitter_matches_reference(shape, dtype):
    x = pixels(shape, dtype)
    apply = torch.tensor([True, False, True, True, True][:shape[0]])
    params = random_params(shape[0], apply=apply)
    out = apply_color_jitter(x, params)
    expected = torch.stack([ref_jitter(x[b].double(), params.order[b].tolist(), params.factors[b], params.enabled)
                            if apply[b] else x[b].double() for b in range(shape[0])])
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, expected, dtype, "color jitter")
    assert torch.equal(out[1], x[1])  # not applied: untouched


@pytest.mark.parametrize("enabled", [(True, False, False, False), (False, True, False, False),
                                     (False, False, True, False), (False, False, False, True)])
def test_each_jitter_adjustment_alone(enabled):
    x = pixels((4, 3, 7, 9), torch.float64)
    params = random_params(4, channels_enabled=enabled)
    out = apply_color_jitter(x, params)
    expected = torch.stack([ref_jitter(x[b], [0, 1, 2, 3], params.factors[b], enabled) for b in range(4)])
    assert_close(out, expected, torch.float64, f"adjustment {enabled}")
    assert not torch.allclose(out, x)


@pytest.mark.parametrize("shape", SHAPES)
def test_color_jitter_draws_then_applies(shape):
    x = pixels(shape)
    out = color_jitter(x, gen(), p=0.6)
    params = draw_jitter_params(shape[0], p=0.6, generator=gen())
    assert torch.equal(out, apply_color_jitter(x, params))


def test_jitter_draw_ranges_and_order():
    n = 20000
    params = draw_jitter_params(n, generator=gen())  # the released code's (0.4, 0.4, 0.2, 0.1), p 0.8
    low, high = params.factors.min(0).values, params.factors.max(0).values
    torch.testing.assert_close(low, torch.tensor([0.6, 0.6, 0.8, -0.1], dtype=torch.float64), atol=1e-3, rtol=0)
    torch.testing.assert_close(high, torch.tensor([1.4, 1.4, 1.2, 0.1], dtype=torch.float64), atol=1e-3, rtol=0)
    assert abs(float(params.apply.double().mean()) - 0.8) < 5 * math.sqrt(0.16 / n)
    assert torch.equal(params.order.sort(1).values, torch.arange(4).expand(n, 4))
    # Each adjustment comes first for about a quarter of the samples: orders are per sample.
    assert (torch.bincount(params.order[:, 0], minlength=4) > n / 4 - 5 * math.sqrt(n * 3 / 16)).all()
    assert params.enabled == (True, True, True, True)
    # A range of one value at the centre leaves the adjustment out, as torchvision does.
    params = draw_jitter_params(8, brightness=0, contrast=(1, 1), saturation=(0.5, 1.5), hue=0.0, generator=gen())
    assert params.enabled == (False, False, True, False)
    # brightness 1.5 -> [max(0, -0.5), 2.5]: never a negative factor.
    assert float(draw_jitter_params(5000, brightness=1.5, generator=gen()).factors[:, 0].min()) >= 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_jitter_identity(dtype):
    x = pixels((5, 3, 7, 9), dtype)
    ones = JitterParams(apply=torch.ones(5, dtype=torch.bool), order=torch.arange(4).repeat(5, 1),
                        factors=torch.tensor([[1.0, 1.0, 1.0, 0.0]] * 5, dtype=torch.float64),
                        enabled=(True, True, True, True))
    assert_close(apply_color_jitter(x, ones), x.double(), dtype, "factors 1, hue 0")
    # Every range collapsed to its centre: nothing is applied at all, bit for bit.
    assert torch.equal(color_jitter(x, gen(), brightness=0, contrast=0, saturation=0, hue=0, p=1.0), x)
    assert torch.equal(color_jitter(x, gen(), p=0.0), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_adjust_hue_matches_colorsys(dtype):
    """Every hue sector, grey pixels, ties between channels, the shift's extremes."""
    x = pixels((6, 3, 7, 9), torch.float64)
    x[:, :, 0, :3] = 0.4  # grey
    x[:, 0, 1, :] = x[:, 1, 1, :]  # red == green
    x[:, 1, 2, :] = x[:, 2, 2, :]  # green == blue
    x[:, 0, 3, :] = x[:, 2, 3, :]  # red == blue
    x = x.to(dtype)
    shifts = torch.tensor([-0.5, -0.1, 0.0, 0.05, 0.37, 0.5], dtype=torch.float64)
    out = augment.adjust_hue(x, shifts)
    expected = torch.stack([ref_hue(x[b].double(), float(shifts[b])) for b in range(6)])
    assert_close(out, expected, dtype, "hue")
    assert_close(augment.adjust_hue(x, 0.0), x.double(), dtype, "hue shift 0")
    grey = pixels((2, 1, 3, 3), dtype)
    assert torch.equal(augment.adjust_hue(grey, 0.3), grey) and torch.equal(augment.adjust_saturation(grey, 0.3), grey)


def test_adjustments_take_a_number_or_one_factor_per_sample():
    x = pixels((4, 3, 5, 5))
    assert torch.equal(augment.adjust_brightness(x, 0.5), augment.adjust_brightness(x, torch.full((4,), 0.5)))
    assert_close(augment.adjust_contrast(x, 1.0), x.double(), torch.float32, "contrast 1")
    assert torch.equal(augment.adjust_saturation(x, 0.0), augment.rgb_to_grayscale(x).expand_as(x).clamp(0, 1))
    with pytest.raises(ValueError, match=r"factor must be a number or one per sample \[4\]"):
        augment.adjust_brightness(x, torch.ones(3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_random_grayscale_matches_reference(shape, dtype):
    x = pixels(shape, dtype)
    out = random_grayscale(x, gen(), p=0.5)
    grey = draw_grayscale(shape[0], 0.5, gen())
    if shape[1] == 1:
        assert torch.equal(out, x)
        return
    expected = torch.stack([ref_gray(x[b].double()).expand(3, -1, -1) if grey[b] else x[b].double()
                            for b in range(shape[0])])
    assert_close(out, expected, dtype, "grayscale")


def test_probability_zero_and_identity_steps():
    x = pixels((6, 3, 7, 9))
    assert torch.equal(horizontal_flip(x, gen(), p=0.0), x)
    assert torch.equal(random_grayscale(x, gen(), p=0.0), x)
    assert torch.equal(random_crop(x, gen(), padding=0), x)
    assert torch.equal(horizontal_flip(x, gen(), p=1.0), x.flip(-1))
    # The whole image as the box, at the same size: the resize weights are the identity.
    square = pixels((6, 3, 8, 8))
    assert torch.equal(random_resized_crop(square, gen(), scale=(1.0, 1.0), ratio=(1.0, 1.0)), square)


# ---------------------------------------------------------------------------------------------
# The pipeline: scales, presets, specs, reproducibility, dtypes and devices.


def ref_pipeline(x, mean, std, steps, generator, size=None):
    """The per-sample float64 reference of a pipeline: pixels, each step per sample, normalized."""
    m, s = stats(mean, std)
    img = x.double() * s + m
    batch, channels = x.shape[:2]
    for name, opts in steps:
        if name == "crop":
            top, left = draw_crop_offsets(batch, opts["padding"], generator)
            img = torch.stack([ref_crop(img[b], int(top[b]), int(left[b]), opts["padding"], 0.0)
                               for b in range(batch)])
        elif name == "flip":
            flips = draw_flips(batch, opts["p"], generator)
            img = torch.stack([img[b].flip(-1) if flips[b] else img[b] for b in range(batch)])
        elif name == "resized-crop":
            boxes = draw_resized_crop_boxes(batch, img.shape[2], img.shape[3], generator=generator)
            out_size = size or tuple(img.shape[2:])
            img = torch.stack([ref_resized_crop(img[b], *(int(v[b]) for v in boxes), out_size)
                               for b in range(batch)])
        elif name == "jitter":
            p = draw_jitter_params(batch, generator=generator)
            img = torch.stack([ref_jitter(img[b], p.order[b].tolist(), p.factors[b], p.enabled)
                               if p.apply[b] else img[b] for b in range(batch)])
        elif name == "grayscale":
            grey = draw_grayscale(batch, opts["p"], generator)
            if channels == 3:
                img = torch.stack([ref_gray(img[b]).expand(3, -1, -1) if grey[b] else img[b] for b in range(batch)])
    return (img - m) / s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("spec", ["crop,flip", "factorized-fl", "jitter,crop(padding=2),grayscale,flip"])
def test_pipeline_matches_per_sample_reference(spec, shape, dtype):
    x, mean, std = normalized(shape, dtype)
    aug = make_augmentation(spec, mean=mean, std=std)
    out = aug(x, gen())
    expected = ref_pipeline(x, mean, std, parse_augmentation_spec(spec), gen())
    assert out.dtype == dtype and out.shape == x.shape
    # Normalization divides by std ~ 0.25: a few float32 ulps of the pixels become 4x larger.
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    else:
        assert_close(out, expected, dtype, spec)


def test_geometric_steps_stay_on_the_normalized_scale():
    """crop and flip move the normalized values themselves (no round trip through pixels):
    every output value is an input value of its sample, or the normalized black."""
    x, mean, std = normalized((5, 3, 7, 9))
    out = make_augmentation("crop,flip", mean=mean, std=std)(x, gen())
    black = -torch.tensor(mean) / torch.tensor(std)
    for b in range(5):
        for c in range(3):
            values = set(x[b, c].flatten().tolist()) | {float(black[c])}
            assert set(out[b, c].flatten().tolist()) <= values


def test_pipeline_image_size_and_factorized_fl_on_cifar_shapes():
    x, mean, std = normalized((16, 3, 32, 32))
    aug = make_augmentation("factorized-fl", mean=mean, std=std)
    assert aug(x, gen()).shape == (16, 3, 32, 32)
    assert make_augmentation("factorized-fl", mean=mean, std=std, image_size=24)(x, gen()).shape == (16, 3, 24, 24)
    # A size given in the spec wins over image_size.
    assert make_augmentation("resized-crop(size=(20, 12))", mean=mean, std=std,
                             image_size=24)(x, gen()).shape == (16, 3, 20, 12)
    explicit = make_augmentation("resized-crop,flip,jitter(p=0.8),grayscale", mean=mean, std=std)
    assert torch.equal(explicit(x, gen()), aug(x, gen()))
    grey, m1, s1 = normalized((16, 1, 28, 28))
    out = make_augmentation("factorized-fl", mean=m1, std=s1)(grey, gen())
    assert out.shape == grey.shape and torch.isfinite(out).all()


def test_pixel_scale_pipeline_without_stats():
    x = pixels((5, 3, 7, 9))
    out = make_augmentation("crop", mean=None, std=None)(x, gen())
    top, left = draw_crop_offsets(5, 4, gen())
    assert torch.equal(out[0], ref_crop(x[0].double(), int(top[0]), int(left[0]), 4, 0.0).float())


def test_reproducible_and_global_rng_untouched():
    x, mean, std = normalized((8, 3, 7, 9))
    aug = make_augmentation("factorized-fl", mean=mean, std=std)
    before = torch.get_rng_state()
    first = aug(x, gen(7))
    assert torch.equal(torch.get_rng_state(), before), "the global RNG must not be used"
    assert torch.equal(aug(x, gen(7)), first)
    assert not torch.equal(aug(x, gen(8)), first)
    # One generator through two batches draws fresh parameters for the second.
    g = gen(7)
    assert torch.equal(aug(x, g), first) and not torch.equal(aug(x, g), first)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtype_preserved(dtype):
    x, mean, std = normalized((4, 3, 8, 8))
    out = make_augmentation("factorized-fl", mean=mean, std=std)(x.to(dtype), gen())
    assert out.dtype == dtype and out.shape == x.shape and out.device == x.device
    reference = make_augmentation("factorized-fl", mean=mean, std=std)(x.to(dtype).float(), gen())
    torch.testing.assert_close(out.float(), reference.to(dtype).float())


def test_empty_batch():
    x, mean, std = normalized((0, 3, 8, 8))
    assert make_augmentation("factorized-fl", mean=mean, std=std)(x, gen()).shape == (0, 3, 8, 8)


def test_specs():
    for none in (None, "", "none", "None", " none ", [], ["none"]):
        assert make_augmentation(none, mean=MEAN3, std=STD3) is None
    aug = make_augmentation(["crop(padding=2)", "flip"], mean=MEAN3, std=STD3)
    assert isinstance(aug, Augmentation) and aug.spec == "crop(padding=2),flip"
    assert make_augmentation("factorized-fl", mean=MEAN3, std=STD3).spec == "resized-crop,flip,jitter,grayscale"
    spec = "resized-crop(scale=(0.2, 1.0), ratio=(0.5, 2.0)), jitter(hue=0.05, p=1), grayscale(p=0.5)"
    aug = make_augmentation(spec, mean=MEAN3, std=STD3)
    assert aug.spec == "resized-crop(scale=(0.2, 1.0), ratio=(0.5, 2.0)),jitter(hue=0.05, p=1),grayscale(p=0.5)"
    assert make_augmentation(aug.spec, mean=MEAN3, std=STD3).steps == aug.steps
    assert parse_augmentation_spec("crop()") == [("crop", {"padding": 4, "fill": 0.0})]
    assert "factorized-fl" in repr(AUGMENTATIONS["factorized-fl"])
    for name, entry in AUGMENTATIONS.items():
        assert entry.description and "\n" not in entry.description, name


@pytest.mark.parametrize("spec, message", [
    ("rotate", "unknown augmentation 'rotate'.*valid names: "
               "crop, flip, resized-crop, jitter, grayscale, factorized-fl"),
    ("crop,blur", "unknown augmentation 'blur'"),
    ("crop(pad=2)", "unknown option 'pad' of augmentation 'crop'; its options: padding, fill"),
    ("factorized-fl(p=1)", "a preset takes no options"),
    ("crop(padding=-1)", "padding must be an int >= 0"),
    ("crop(padding=1.5)", "padding must be an int >= 0"),
    ("flip(p=2)", "flip p must be a probability"),
    ("grayscale(p=-0.1)", "grayscale p must be a probability"),
    ("resized-crop(scale=(0, 1))", "scale must be a pair"),
    ("resized-crop(ratio=(2, 1))", "ratio must be a pair"),
    ("resized-crop(size=0)", "size"),
    ("jitter(hue=0.7)", "hue must be in"),
    ("jitter(brightness=-1)", "brightness must be a number >= 0"),
    ("jitter(saturation=(-1, 2))", "saturation range"),
    ("crop(padding=abc)", "not a number or tuple"),
    ("crop(padding=2", "unbalanced parentheses"),
    ("crop(padding)", "expected key=value"),
    ("none,crop", "'none' cannot be combined"),
    ("crop,,flip", "empty step"),
    ("crop,", "empty step"),
])
def test_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        make_augmentation(spec, mean=MEAN3, std=STD3)


def test_bad_arguments():
    x, mean, std = normalized((4, 3, 7, 9))
    with pytest.raises(TypeError, match="string or a sequence of strings"):
        make_augmentation(["crop", 3], mean=mean, std=std)
    with pytest.raises(ValueError, match="mean and std must be given together"):
        make_augmentation("crop", mean=mean, std=None)
    with pytest.raises(ValueError, match="one value per channel"):
        make_augmentation("crop", mean=mean, std=std[:2])
    with pytest.raises(ValueError, match="std finite and > 0"):
        make_augmentation("crop", mean=mean, std=(0.2, 0.0, 0.2))
    with pytest.raises(ValueError, match="image_size"):
        make_augmentation("crop", mean=mean, std=std, image_size=(3, 0))
    aug = make_augmentation("crop,flip", mean=MEAN1, std=STD1)
    with pytest.raises(ValueError, match="mean/std have 1 values but the batch has 3 channels"):
        aug(x, gen())
    aug = make_augmentation("crop,flip", mean=mean, std=std)
    with pytest.raises(TypeError, match="CPU torch.Generator"):
        aug(x, None)
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        aug(x[0], gen())
    with pytest.raises(TypeError, match="floating-point"):
        aug((x * 10).to(torch.int64), gen())
    with pytest.raises(ValueError, match="1-channel .* or 3-channel"):
        make_augmentation("jitter", mean=(0.5, 0.5), std=(0.2, 0.2))(x[:, :2], gen())
    with pytest.raises(ValueError, match="1-channel .* or 3-channel"):
        random_grayscale(torch.rand(2, 4, 3, 3), gen())
    with pytest.raises(ValueError, match="another batch size"):
        apply_color_jitter(x, draw_jitter_params(3, generator=gen()))
    with pytest.raises(ValueError, match="fill must be a number or one value per channel"):
        random_crop(x, gen(), fill=(0.0, 1.0))
    with pytest.raises(ValueError, match="attempts"):
        draw_resized_crop_boxes(3, 8, 8, generator=gen(), attempts=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("spec", ["crop,flip", "factorized-fl", "jitter(p=1),resized-crop(size=16),grayscale"])
def test_cuda_matches_cpu(spec):
    """The same generator seed gives the same draws, so CPU and CUDA give the same images."""
    x, mean, std = normalized((64, 3, 32, 32))
    aug = make_augmentation(spec, mean=mean, std=std)
    before = torch.cuda.get_rng_state()
    on_gpu = aug(x.cuda(), gen())
    assert on_gpu.device.type == "cuda" and on_gpu.dtype == x.dtype
    assert torch.equal(torch.cuda.get_rng_state(), before)
    torch.testing.assert_close(on_gpu.cpu(), aug(x, gen()), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_crop_flip_equals_the_two_steps(dtype):
    """The pipeline does crop then flip in one gather: the same draws, the same values, exactly."""
    x, mean, std = normalized((9, 3, 7, 9), dtype)
    out = make_augmentation("crop(padding=3),flip(p=0.5)", mean=mean, std=std)(x, gen())
    g = gen()
    black = -torch.tensor(mean, dtype=dtype) / torch.tensor(std, dtype=dtype)
    assert torch.equal(out, horizontal_flip(random_crop(x, g, padding=3, fill=black), g, p=0.5))
