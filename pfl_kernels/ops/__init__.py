"""Custom ops of pfl-kernels (namespace ``torch.ops.pfl``) and their Python wrappers."""
from .factorized import factorized_weight, soft_threshold_

__all__ = ["factorized_weight", "soft_threshold_"]
