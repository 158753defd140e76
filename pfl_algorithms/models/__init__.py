"""Models of the papers as plain ``nn.Module``s split into ``body`` and ``head``.

``pfl_kernels.nn.factorize`` / ``multibranch`` convert any of them in place; pass
``exclude=["head"]`` to keep the classifier dense.
"""
from .base import BodyHeadModel, body_parameter_names, head_parameter_names
from .digits_cnn import DigitsCNN
from .fedgen_cnn import FedGenCNN
from .heterogeneous import build_client_models, parse_architecture
from .lenet5 import LeNet5
from .mlp import MLP
from .registry import MODELS, ModelSpec, build_model
from .resnet9 import ResNet9, ResNet9DAWNBench

__all__ = [
    "MODELS", "ModelSpec", "build_model", "build_client_models", "parse_architecture", "head_parameter_names", "body_parameter_names",
    "BodyHeadModel", "ResNet9", "ResNet9DAWNBench", "LeNet5", "FedGenCNN", "DigitsCNN", "MLP",
]
