"""One intra-op thread for a block: how a client's work runs in every executor, so that its
results are bitwise the same whichever executor, rank or Flower node runs it."""
from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def one_intra_op_thread():
    """Run the body with ``torch.set_num_threads(1)``, restoring the previous count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
