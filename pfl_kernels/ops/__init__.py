"""Custom ops of pfl-kernels (namespace ``torch.ops.pfl``) and their Python wrappers.

Argument mistakes raise one exception type whichever layer catches them (wrapper, op, C++,
reference, fake or Triton kernel): TypeError for a wrong kind of argument (a non-floating
dtype, dtypes that differ), ValueError for a wrong shape, value, device or layout.
"""
from . import aggregate as _aggregate
from . import similarity as _similarity
from .aggregate import *  # noqa: F401,F403
from .branch import branch_combine, project_simplex_
from .branch_aggregate import branch_aggregate
from .class_means import class_means
from .factorized import factorized_weight, soft_threshold_
from .pool import relu_max_pool2d
from .similarity import *  # noqa: F401,F403

__all__ = ["branch_aggregate", "branch_combine", "class_means", "factorized_weight", "project_simplex_",
           "relu_max_pool2d", "soft_threshold_", *_aggregate.__all__, *_similarity.__all__]
