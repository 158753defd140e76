"""Drop-in layers built on the ``pfl`` ops, and converters for whole models."""
from .convert import (alpha_parameters, branch_parameters, factorize, factorized_layers, multibranch,
                      multibranch_layers, project_alpha_, sparsity_loss)
from ._read_only import ReadOnlyWeightError
from .factorized import FactorizedConv2d, FactorizedLinear
from .fedpara import FEDPARA_LAYERS, FedParaConv2d, FedParaLinear, fedpara, fedpara_rank
from .multibranch import MultiBranchConv2d, MultiBranchLinear
from .pool import ReLUMaxPool2d, fuse_relu_max_pool, unfuse_relu_max_pool

__all__ = [
    "FactorizedConv2d", "FactorizedLinear", "MultiBranchConv2d", "MultiBranchLinear",
    "factorize", "factorized_layers", "sparsity_loss",
    "multibranch", "multibranch_layers", "branch_parameters", "alpha_parameters", "project_alpha_",
    "ReLUMaxPool2d", "fuse_relu_max_pool", "unfuse_relu_max_pool",
    "FedParaLinear", "FedParaConv2d", "FEDPARA_LAYERS", "fedpara", "fedpara_rank",
    "ReadOnlyWeightError",
]
