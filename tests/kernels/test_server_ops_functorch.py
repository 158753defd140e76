"""torch.func through the server-side ops: ``grad`` and ``vmap(grad)`` against eager autograd
(float64), for every case of ``second_order_cases`` (pairwise_cosine, pairwise_sqdist,
similarity_weights, weighted_average, branch_aggregate, class_means).

Their autograd was registered with ``torch.library.register_autograd``, which functorch
refuses ("must override the setup_context staticmethod", pytorch/pytorch#168393); it now goes
through ``pfl_kernels.ops._library.register_autograd`` as the factorized and branch ops do.
Runs on the C++ kernels, on the reference without the extension, and (the ``_triton`` twin)
on the Triton launchers in the interpreter.
"""
from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
from torch.func import grad, vmap

from tests.kernels.second_order_cases import F64, cases
from tests.tolerances import assert_close

COPIES = 3  # vmap over this many different inputs


def _scalar_loss(fn: Callable, out_shape: torch.Size, device) -> Callable:
    """A scalar of fn's output with a fixed random cotangent (never all-ones: a sum of rows
    that are each normalized, as similarity_weights', has gradient 0)."""
    cotangent = torch.randn(out_shape, generator=torch.Generator().manual_seed(99), dtype=F64).to(device)
    return lambda *args: (fn(*args) * cotangent).sum()


def _eager_grads(loss: Callable, inputs) -> tuple[torch.Tensor, ...]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    return torch.autograd.grad(loss(*leaves), leaves)


def check_functorch(case: Callable[[], tuple]) -> None:
    """torch.func.grad, and vmap of it over differently scaled copies of the inputs (scaling
    keeps alpha >= 0 and zero rows zero), equal eager autograd on each input."""
    fn, inputs = case()
    inputs = tuple(t.detach() for t in inputs)
    loss = _scalar_loss(fn, fn(*inputs).shape, inputs[0].device)
    argnums = tuple(range(len(inputs)))

    got = grad(loss, argnums=argnums)(*inputs)
    for i, (g, e) in enumerate(zip(got, _eager_grads(loss, inputs))):
        assert_close(g, e, F64, f"torch.func.grad of input {i} vs eager autograd")

    copies = [tuple(t * (1 + 0.25 * c) for t in inputs) for c in range(COPIES)]
    stacked = tuple(torch.stack([copy[i] for copy in copies]) for i in argnums)
    with warnings.catch_warnings():
        # No vmap rule for these ops: functorch loops over the copies (slower, same values).
        warnings.filterwarnings("ignore", "There is a performance drop", UserWarning)
        batched = vmap(grad(loss, argnums=argnums))(*stacked)
    for c, copy in enumerate(copies):
        for i, e in enumerate(_eager_grads(loss, copy)):
            assert_close(batched[i][c], e, F64, f"vmap(grad) copy {c}, input {i} vs eager autograd")


@pytest.mark.parametrize("case", list(cases()))
def test_grad_and_vmap_grad_match_eager_autograd(case):
    check_functorch(cases()[case])
