"""Custom ops of pfl-kernels (namespace ``torch.ops.pfl``) and their Python wrappers."""
from . import aggregate, branch_aggregate, class_means, similarity
from .aggregate import *  # noqa: F401,F403
from .branch import branch_combine, project_simplex_
from .branch_aggregate import *  # noqa: F401,F403
from .class_means import *  # noqa: F401,F403
from .factorized import factorized_weight, soft_threshold_
from .similarity import *  # noqa: F401,F403

__all__ = ["branch_combine", "factorized_weight", "project_simplex_", "soft_threshold_",
           *aggregate.__all__, *branch_aggregate.__all__, *class_means.__all__, *similarity.__all__]
