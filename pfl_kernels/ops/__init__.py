"""Custom ops of pfl-kernels (namespace ``torch.ops.pfl``) and their Python wrappers."""
from .branch import branch_combine, project_simplex_
from .factorized import factorized_weight, soft_threshold_

__all__ = ["branch_combine", "factorized_weight", "project_simplex_", "soft_threshold_"]
