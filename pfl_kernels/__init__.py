"""pfl-kernels: fused kernels and layers for personalized federated learning.

``pfl_kernels.ops`` holds the custom ops (``torch.ops.pfl.*``), ``pfl_kernels.nn`` the
drop-in layers and converters, and ``backend_info()`` says which implementation of each
op runs on which device.
"""
from . import _extension  # noqa: F401  (loads the C++ kernels when built)
from . import ops
from . import triton as _triton
from ._backends import backend_info, format_backend_info

_triton.register_all()

from . import nn  # noqa: E402

__all__ = ["ops", "nn", "backend_info", "format_backend_info"]
__version__ = "0.1.0"
