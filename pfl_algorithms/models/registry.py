"""The model registry: names the CLI and configs use, and ``build_model``."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Sequence

from torch import nn

from .digits_cnn import DigitsCNN
from .fedgen_cnn import FedGenCNN
from .lenet5 import LeNet5
from .mlp import MLP
from .pfedhn_cnn import PFedHNCNN
from .resnet9 import ResNet9, ResNet9DAWNBench


@dataclass(frozen=True)
class ModelSpec:
    """A registered model.

    Attributes:
        name: registry key.  description: one line for ``pfl list``.
        builder: ``builder(input_shape, num_classes, **options) -> BodyHeadModel``.
        example_input_shape: the input it was designed for (tests, smoke runs).
        defaults: the options it accepts and their default values.
    """

    name: str
    description: str
    builder: Callable[..., nn.Module]
    example_input_shape: tuple = ()
    defaults: dict = field(default_factory=dict)


def _spec(name: str, description: str, builder, example_input_shape) -> ModelSpec:
    # The keyword-only arguments of the class are its options; read them so the
    # registry cannot drift from the constructors.
    params = inspect.signature(builder).parameters.values()
    defaults = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return ModelSpec(name, description, builder, tuple(example_input_shape), defaults)


MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    _spec("resnet9", "ResNet-9 of the Factorized-FL code (conv-BN-ReLU, two residual blocks, 256-d embedding; option width narrows it)",
          ResNet9, (3, 32, 32)),
    _spec("resnet9-dawnbench", "ResNet-9 of widths 64-128-256-512 (the DAWNBench layout; FedDAF's CIFAR-10 "
          "network; 512-d embedding; option width narrows it)", ResNet9DAWNBench, (3, 32, 32)),
    _spec("lenet5", "pFedMB's LeNet-5 CNN (two 5x5 convs, fc 120 and 84; 84-d embedding)", LeNet5, (3, 32, 32)),
    _spec("fedgen-cnn", "FedGen's MNIST network used by Fed-CMA (two stride-2 convs with BN, 32-d embedding)",
          FedGenCNN, (1, 28, 28)),
    _spec("pfedhn-cnn", "pFedHN's CIFAR target CNN (5x5 convs of 16 and 32 kernels, fc 120 and 84; 84-d embedding)",
          PFedHNCNN, (3, 32, 32)),
    _spec("digits-cnn", "a small CNN for 8x8 digits (two 3x3 convs, maxpool, 64-d embedding)", DigitsCNN, (1, 8, 8)),
    _spec("mlp", "a multilayer perceptron over flattened inputs (option hidden, activation)", MLP, (2,)),
)}


def build_model(name: str, *, input_shape: Sequence[int], num_classes: int, **options) -> nn.Module:
    """Build the registered model ``name`` for inputs of ``input_shape`` (without the batch
    dimension: (C, H, W) for images, (F,) for feature vectors) and ``num_classes`` outputs.

    The result is a plain ``nn.Module`` with children ``body`` and ``head``, attribute
    ``embedding_dim``, ``forward(x) = head(body(x))`` and ``embed(x) = body(x)``.

    Raises:
        ValueError: an unknown model name or option (the message lists the valid ones), or an
            input shape the model cannot take.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid models: {sorted(MODELS)}")
    spec = MODELS[name]
    unknown = sorted(set(options) - set(spec.defaults))
    if unknown:
        raise ValueError(f"model {name!r} got unknown options {unknown}; valid options: {sorted(spec.defaults)}")
    return spec.builder(tuple(input_shape), num_classes, **options)
