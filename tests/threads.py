"""Running a kernel under different thread counts (the CPU kernels promise results that do
not depend on it)."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def on_one_and_many_threads(fn: Callable[[], T]) -> tuple[T, T]:
    """``fn()`` on one thread, then on max(2, the current count) threads; the count is restored."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn()
        torch.set_num_threads(max(2, threads))
        many = fn()
    finally:
        torch.set_num_threads(threads)
    return one, many
