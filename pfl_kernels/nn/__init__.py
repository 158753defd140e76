"""Drop-in layers built on the ``pfl`` ops, and converters for whole models."""
from .convert import factorize, factorized_layers, sparsity_loss
from .factorized import FactorizedConv2d, FactorizedLinear

__all__ = ["FactorizedConv2d", "FactorizedLinear", "factorize", "factorized_layers", "sparsity_loss"]
