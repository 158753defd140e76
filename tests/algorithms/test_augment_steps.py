"""The ``Step`` interface of pfl_algorithms/data/augment/: the registry is built from the Step
classes, a step is its functional form with its options, options are checked when a step is
built (in the spec parser and in ``Augmentation`` alike), and the pipeline's per-step hooks
(scale-dependent fill, pipeline image size, crop+flip fusion) give the steps' own values."""
from __future__ import annotations

import pytest
import torch

from pfl_algorithms.data.augment import (AUGMENTATIONS, PRESETS, STEPS, Augmentation, AugmentationSpec, Crop, CropFlip,
                                         Flip, PipelineContext, ResizedCrop, Step, color_jitter, horizontal_flip,
                                         make_augmentation, random_crop, random_grayscale, random_resized_crop)

MEAN3, STD3 = (0.491, 0.482, 0.447), (0.247, 0.243, 0.262)
FUNCTIONAL = {"crop": random_crop, "flip": horizontal_flip, "resized-crop": random_resized_crop,
              "jitter": color_jitter, "grayscale": random_grayscale}


def gen(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def pixels(shape=(6, 3, 7, 9), dtype=torch.float32) -> torch.Tensor:
    return (0.02 + 0.96 * torch.rand(shape, generator=gen(0), dtype=torch.float64)).to(dtype)


def test_registry_is_built_from_the_step_classes():
    assert list(STEPS) == ["crop", "flip", "resized-crop", "jitter", "grayscale"]
    assert list(AUGMENTATIONS) == [*STEPS, *PRESETS]
    for name, step in STEPS.items():
        assert issubclass(step, Step) and step.name == name
        assert step.description and "\n" not in step.description
        assert AUGMENTATIONS[name] == AugmentationSpec.of_step(step)
        assert AUGMENTATIONS[name].photometric == step.photometric == (name in ("jitter", "grayscale"))
    for preset in PRESETS.values():
        assert preset.is_preset and all(step in STEPS for step in preset.steps)


@pytest.mark.parametrize("name", list(FUNCTIONAL))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_step_is_its_functional_form(name, dtype):
    """A step draws exactly what its functional form draws and returns the same values, bitwise."""
    x = pixels(dtype=dtype)
    step = STEPS[name]()
    assert step.options == dict(STEPS[name].defaults)
    assert torch.equal(step(x, gen()), FUNCTIONAL[name](x, gen(), **step.options))
    on_pixels = PipelineContext(mean=None, std=None, image_size=None)
    assert torch.equal(step.run(x, gen(), on_pixels), step(x, gen()))


def test_defaults_are_read_only():
    with pytest.raises(TypeError):
        Crop.defaults["padding"] = 2
    crop = Crop(padding=2)
    crop.options["padding"] = 3  # an instance's options are its own copy
    assert Crop.defaults["padding"] == 4 and Crop().options["padding"] == 4


@pytest.mark.parametrize("build", [
    lambda: Crop(pad=2),
    lambda: Augmentation([("crop", {"pad": 2})], mean=None, std=None),
    lambda: make_augmentation("crop(pad=2)", mean=None, std=None),
])
def test_unknown_option_fails_when_built(build):
    """The same one-line error from the spec parser, a Step and an Augmentation built from
    (name, options) pairs (which used to accept the option and fail at the first batch)."""
    with pytest.raises(ValueError, match="unknown option 'pad' of augmentation 'crop'; its options: padding, fill"):
        build()


@pytest.mark.parametrize("step, message", [
    (lambda: Flip(p=1.5), "flip p must be a probability"),
    (lambda: ResizedCrop(scale=(0.5, 0.1)), "scale must be a pair"),
    (lambda: STEPS["jitter"](hue=0.9), "hue must be in"),
    (lambda: STEPS["grayscale"](p=-1), "grayscale p must be a probability"),
    (lambda: Crop(fill="black"), "crop fill must be a number"),
])
def test_bad_option_values_fail_when_built(step, message):
    with pytest.raises(ValueError, match=message):
        step()


def test_spec_of_a_step_writes_only_what_differs():
    assert Crop().spec == "crop"
    assert Crop(padding=2, fill=[0.1, 0.2, 0.3]).spec == "crop(padding=2, fill=(0.1, 0.2, 0.3))"
    assert make_augmentation("crop(padding=2),flip", mean=MEAN3, std=STD3).spec == "crop(padding=2),flip"


def test_crop_in_a_pipeline_pads_with_black_on_the_normalized_scale():
    x = pixels(dtype=torch.float64)
    mean = torch.tensor(MEAN3, dtype=x.dtype).reshape(-1, 1, 1)
    std = torch.tensor(STD3, dtype=x.dtype).reshape(-1, 1, 1)
    normalized = PipelineContext(mean=mean, std=std, image_size=None)
    out = Crop(padding=3).run((x - mean) / std, gen(), normalized)
    assert torch.equal(out, random_crop((x - mean) / std, gen(), padding=3, fill=(-mean / std).reshape(-1)))


def test_resized_crop_takes_the_pipeline_size_unless_it_has_its_own():
    x = pixels()
    context = PipelineContext(mean=None, std=None, image_size=(5, 4))
    assert ResizedCrop().run(x, gen(), context).shape == (6, 3, 5, 4)
    assert ResizedCrop(size=3).run(x, gen(), context).shape == (6, 3, 3, 3)


def test_crop_fuses_with_a_following_flip_only():
    fused = Crop(padding=2).fuse(Flip(p=0.3))
    assert isinstance(fused, CropFlip) and fused.options == {"padding": 2, "fill": 0.0, "p": 0.3}
    assert Crop().fuse(Crop()) is None and Flip().fuse(Flip()) is None and fused.fuse(Flip()) is None
    x, g = pixels(), gen()
    assert torch.equal(fused(x, gen()), horizontal_flip(random_crop(x, g, padding=2), g, p=0.3))
