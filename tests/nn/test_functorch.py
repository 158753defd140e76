"""torch.func through the drop-in layers: grad, jacrev, per-sample gradients (vmap of grad)
and forward mode (jvp, hessian), against eager autograd and the same function written in
plain PyTorch (float64).

These failed on both the factorized and the multi-branch layers ("cannot use C++
torch::autograd::Function with functorch transforms"; without the extension, "must
override the setup_context staticmethod", pytorch/pytorch#168393).  Runs on the C++
kernels, on the reference without the extension, and on the Triton launchers in the
interpreter.
"""
from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, hessian, jacrev, jvp, vmap

from tests.kernels.triton_support import interpreter_only
from tests.nn.layer_cases import F64, LAYERS, make_layer, reference_forward, scalar_loss
from tests.tolerances import assert_close


def parameters(layer) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in layer.named_parameters()}


def losses(layer):
    """(loss through the layer, the plain-PyTorch reference loss), as functions of (params, x)."""
    return (lambda p, x: scalar_loss(functional_call(layer, p, (x,))),
            lambda p, x: scalar_loss(reference_forward(layer, p, x)))


def assert_trees_close(got, want, what):
    assert got.keys() == want.keys(), what
    for name in want:
        assert_close(got[name], want[name], F64, f"{what}: {name}")


def check_grad(name):
    layer, x = make_layer(name)
    loss, reference = losses(layer)
    got = grad(loss)(parameters(layer), x)
    eager = dict(zip([n for n, _ in layer.named_parameters()],
                     torch.autograd.grad(scalar_loss(layer(x)), list(layer.parameters()))))
    assert_trees_close(got, eager, "torch.func.grad vs eager autograd")
    assert_trees_close(got, grad(reference)(parameters(layer), x), "torch.func.grad vs reference")


def check_per_sample_grads(name):
    """vmap(grad) over the batch: one gradient per sample (DP-SGD, per-client statistics)."""
    layer, x = make_layer(name)
    loss, reference = losses(layer)

    def one(loss_fn):
        return lambda p, xi: loss_fn(p, xi.unsqueeze(0))

    got = vmap(grad(one(loss)), in_dims=(None, 0))(parameters(layer), x)
    for i in range(x.shape[0]):
        eager = torch.autograd.grad(scalar_loss(layer(x[i:i + 1])), list(layer.parameters()))
        for (pname, _), e in zip(layer.named_parameters(), eager):
            assert_close(got[pname][i], e, F64, f"per-sample grad {i} of {pname} vs eager autograd")
    assert_trees_close(got, vmap(grad(one(reference)), in_dims=(None, 0))(parameters(layer), x),
                       "vmap(grad) vs reference")


def check_per_client_grads(name):
    """vmap(grad) over stacked parameters too: every client its own copy of the layer (a
    batched executor); the ops see the vmapped dim as their client dim."""
    layer, x = make_layer(name)
    loss, reference = losses(layer)
    clients = 2
    stacked = {k: torch.stack([v + 0.1 * c for c in range(clients)]) for k, v in parameters(layer).items()}
    xs = torch.stack([x, x.flip(0)])
    got = vmap(grad(loss))(stacked, xs)
    assert_trees_close(got, vmap(grad(reference))(stacked, xs), "per-client vmap(grad) vs reference")
    for c in range(clients):
        assert_trees_close({k: g[c] for k, g in got.items()},
                           grad(loss)({k: v[c] for k, v in stacked.items()}, xs[c]), f"client {c} vs its own grad")


def check_hessian_and_jvp(name):
    """Forward mode: jvp of the layer's output, and hessian = jacfwd(jacrev) of the loss."""
    layer, x = make_layer(name)
    loss, reference = losses(layer)
    params = parameters(layer)
    tangent = {k: torch.randn_like(v) for k, v in params.items()}
    out, out_t = jvp(lambda p: functional_call(layer, p, (x,)), (params,), (tangent,))
    want, want_t = jvp(lambda p: reference_forward(layer, p, x), (params,), (tangent,))
    assert_close(out, want, F64, "jvp primal")
    assert_close(out_t, want_t, F64, "jvp tangent")
    got, expected = hessian(loss)(params, x), hessian(reference)(params, x)
    for a in expected:
        assert_trees_close(got[a], expected[a], f"hessian row {a}")


def check_nested(name):
    """Transforms of transforms: grad of a gradient penalty (grad of grad) and the Hessian as
    jacrev of jacrev.  Each inner level must record what the outer one differentiates."""
    layer, x = make_layer(name)
    loss, reference = losses(layer)

    def penalty(loss_fn):
        return lambda p: sum(g.pow(2).sum() for g in grad(loss_fn)(p, x).values())

    assert_trees_close(grad(penalty(loss))(parameters(layer)), grad(penalty(reference))(parameters(layer)),
                       "grad of a gradient penalty")
    got, expected = jacrev(jacrev(loss))(parameters(layer), x), jacrev(jacrev(reference))(parameters(layer), x)
    for a in expected:
        assert_trees_close(got[a], expected[a], f"jacrev(jacrev) row {a}")


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_grad(name):
    check_grad(name)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_jacrev_of_the_output(name):
    layer, x = make_layer(name)
    got = jacrev(lambda p: functional_call(layer, p, (x,)))(parameters(layer))
    want = jacrev(lambda p: reference_forward(layer, p, x))(parameters(layer))
    assert_trees_close(got, want, "jacrev vs reference")


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_per_sample_grads(name):
    check_per_sample_grads(name)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_per_client_grads(name):
    check_per_client_grads(name)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_hessian_and_jvp(name):
    check_hessian_and_jvp(name)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_nested_transforms(name):
    check_nested(name)


@pytest.mark.triton_interpret
@interpreter_only
@pytest.mark.parametrize("check", [check_grad, check_per_sample_grads, check_per_client_grads, check_hessian_and_jvp,
                                   check_nested],
                         ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("name", ["FactorizedConv2d-spatial", "FactorizedLinear", "MultiBranchConv2d-project",
                                  "MultiBranchLinear"])
def test_on_the_triton_launchers(name, check):
    pytest.importorskip("triton")
    from pfl_kernels.triton import launchers_on_cpu

    with launchers_on_cpu():
        check(name)
