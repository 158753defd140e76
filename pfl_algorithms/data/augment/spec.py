"""The spec language of ``--augment``: the names (:data:`AUGMENTATIONS`: every registered step
and the presets such as ``factorized-fl``) and :func:`parse_augmentation_spec`, which turns
``"crop(padding=2), flip"`` into steps with their options checked."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Union

from ._checks import check_option_names
from .registry import STEPS
from .step import Step


@dataclass(frozen=True)
class AugmentationSpec:
    """A name of :data:`AUGMENTATIONS`: one step (with its options and their defaults) or a
    preset (``steps``: the step names it stands for, with their defaults)."""

    name: str
    description: str
    defaults: Mapping[str, Any]
    steps: tuple[str, ...] = ()
    photometric: bool = False  # the step is defined on pixels (the pipeline un-normalizes before it)

    @property
    def is_preset(self) -> bool:
        return bool(self.steps)

    @classmethod
    def of_step(cls, step: type[Step]) -> AugmentationSpec:
        """The entry of a registered step class."""
        return cls(step.name, step.description, dict(step.defaults), photometric=step.photometric)


PRESETS: dict[str, AugmentationSpec] = {preset.name: preset for preset in (
    AugmentationSpec("factorized-fl", "the released Factorized-FL code's training transforms: "
                     "resized-crop, flip, jitter, grayscale", {},
                     steps=("resized-crop", "flip", "jitter", "grayscale")),
)}

AUGMENTATIONS: dict[str, AugmentationSpec] = {**{name: AugmentationSpec.of_step(step) for name, step in STEPS.items()},
                                              **PRESETS}

_NONE = ("", "none")


def _split_top_level(text: str, spec: str) -> list[str]:
    """Split ``text`` at the commas outside parentheses (options hold tuples such as scale=(0.2, 1))."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced parentheses in augmentation spec {spec!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced parentheses in augmentation spec {spec!r}")
    parts.append(text[start:])
    return [part.strip() for part in parts]


def _parse_step(text: str, spec: str) -> list[tuple[str, dict]]:
    """One ``name`` or ``name(key=value, ...)`` of a spec -> [(step name, options)] (a preset: its steps)."""
    name, _, rest = text.partition("(")
    name = name.strip()
    if name not in AUGMENTATIONS:
        raise ValueError(f"unknown augmentation {name!r} in spec {spec!r}; valid names: {', '.join(AUGMENTATIONS)} "
                         "(comma-separated, options as name(key=value, ...); 'none' for no augmentation)")
    entry = AUGMENTATIONS[name]
    overrides: dict[str, Any] = {}
    if rest:
        if not rest.rstrip().endswith(")"):
            raise ValueError(f"malformed step {text!r} in augmentation spec {spec!r}: expected name(key=value, ...)")
        body = rest.rstrip()[:-1]
        for item in (_split_top_level(body, spec) if body.strip() else []):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise ValueError(f"malformed option {item!r} of {name!r} in augmentation spec {spec!r}: "
                                 "expected key=value")
            check_option_names(name, [key], entry.defaults)
            try:
                overrides[key] = ast.literal_eval(value.strip())
            except (ValueError, SyntaxError):
                raise ValueError(f"option {key}={value.strip()!r} of {name!r} is not a number or tuple "
                                 f"(augmentation spec {spec!r})") from None
    if entry.is_preset:
        return [(step, dict(STEPS[step].defaults)) for step in entry.steps]
    return [(name, STEPS[name](**overrides).options)]


def parse_augmentation_spec(spec: Union[None, str, Sequence[str]]) -> list[tuple[str, dict]]:
    """The steps of a spec: [(step name, options with defaults filled in)], presets expanded.

    ``spec``: None, ``""`` or ``"none"`` (no steps); a comma-separated string such as
    ``"crop,flip"``, ``"crop(padding=2), flip(p=0.3)"`` or ``"factorized-fl"``; or a sequence
    of such strings.  Unknown names or options and bad values raise ValueError.
    """
    if spec is None:
        return []
    texts = [spec] if isinstance(spec, str) else list(spec)
    if not all(isinstance(t, str) for t in texts):
        raise TypeError(f"augmentation spec must be a string or a sequence of strings, got {spec!r}")
    steps: list[tuple[str, dict]] = []
    parts = [part for text in texts for part in _split_top_level(text.strip(), str(spec))]
    if all(part.lower() in _NONE for part in parts):
        return []
    for part in parts:
        if not part:
            raise ValueError(f"empty step in augmentation spec {spec!r} (two commas in a row, or a trailing comma)")
        if part.lower() in _NONE:
            raise ValueError(f"'none' cannot be combined with other augmentations (spec {spec!r})")
        steps.extend(_parse_step(part, str(spec)))
    return steps
