"""gradcheck + gradgradcheck cases of the server-side ops (issue 13, item 3): float64, random
inputs, odd sizes; shared by the CPU tests and the Triton interpreter tests."""
from __future__ import annotations

from typing import Callable

import torch

from pfl_kernels.ops import (
    branch_aggregate, class_means, pairwise_cosine, pairwise_sqdist, similarity_weights, weighted_average)

F64 = torch.float64


def cases(device: str = "cpu") -> dict[str, Callable[[], tuple]]:
    """name -> a function returning (fn, inputs) for gradcheck / gradgradcheck."""
    def rand(*shape, seed):
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(device)

    def leaf(t):
        return t.requires_grad_()

    def cosine_self():
        x = rand(5, 7, seed=1)
        x[2] = 0  # a zero row: the flat region of max(‖x‖, eps)
        return (lambda a: pairwise_cosine(a, eps=0.1)), (leaf(x),)

    def cosine_xy():
        return (lambda a, b: pairwise_cosine(a, b)), (leaf(rand(5, 7, seed=2)), leaf(rand(3, 7, seed=3)))

    def cosine_y_only():
        x = rand(4, 3, seed=4)
        return (lambda b: pairwise_cosine(x, b)), (leaf(rand(5, 3, seed=5)),)

    def sqdist_self():
        return (lambda a: pairwise_sqdist(a)), (leaf(rand(5, 7, seed=6)),)

    def sqdist_xy():
        return (lambda a, b: pairwise_sqdist(a, b)), (leaf(rand(3, 5, seed=7)), leaf(rand(7, 5, seed=8)))

    def weights_square():
        sim = torch.rand(5, 5, generator=torch.Generator().manual_seed(9), dtype=F64).to(device) * 2 - 1
        return (lambda s: similarity_weights(s, tau=0.1, scale=3.0, min_keep=3)), (leaf(sim),)

    def weights_self_index():
        sim = torch.rand(5, 7, generator=torch.Generator().manual_seed(10), dtype=F64).to(device) * 2 - 1
        own = torch.tensor([1, -1, 0, 6, 2], device=device)
        return (lambda s: similarity_weights(s, tau=0.3, scale=2.0, min_keep=2, self_index=own)), (leaf(sim),)

    def average_dense():
        return (lambda w, p: weighted_average(w, p)), (leaf(rand(3, 5, seed=11)), leaf(rand(5, 7, seed=12)))

    def average_sparse():
        w = rand(5, 3, seed=13)
        w[w.abs() < 0.8] = 0
        return (lambda w_, p: weighted_average(w_, p)), (leaf(w), leaf(rand(3, 9, seed=14)))

    def branch():
        alpha = torch.rand(5, 3, generator=torch.Generator().manual_seed(15), dtype=F64).to(device) + 0.1
        counts = torch.tensor([3, 0, 2, 7, 1], device=device)
        return (lambda p, a: branch_aggregate(p, a, counts)), (leaf(rand(5, 3, 2, 3, seed=16)), leaf(alpha))

    def means():
        labels = torch.tensor([0, 2, 2, 1, 0, 2, 4], device=device)  # class 3 has no sample
        return (lambda f: class_means(f, labels, 5)[0]), (leaf(rand(7, 3, seed=17)),)

    def means_clients():
        labels = torch.tensor([[0, 1, 1, 2, 0], [2, 2, 0, 0, 0]], device=device)
        return (lambda f: class_means(f, labels, 3)[0]), (leaf(rand(2, 5, 3, seed=18)),)

    found = [cosine_self, cosine_xy, cosine_y_only, sqdist_self, sqdist_xy, weights_square, weights_self_index,
             average_dense, average_sparse, branch, means, means_clients]
    return {f.__name__: f for f in found}


def check_second_order(case: Callable[[], tuple], *, fast: bool = False) -> None:
    """gradcheck and gradgradcheck of ``case``; ``fast``: of a random projection of each Jacobian
    (for the slow Triton interpreter, as ``autograd_checks.assert_all_orders``)."""
    fn, inputs = case()
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=fast)
    assert torch.autograd.gradgradcheck(fn, inputs, fast_mode=fast)
