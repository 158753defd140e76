"""Per-client convolutions as each client's own dense convolution under ``vmap``
(``engine/conv_per_client.py``, ``batched_conv='per-client'``): vmap's grouped convolution's
values and gradients in float64 for every stride, padding and dilation form, with per-client,
shared or no bias and groups within a client; the output in vmap's own layout; what it does not
apply to runs as before; bfloat16 under autocast as conv2d's; a batched run with it equals the
grouped one."""
from __future__ import annotations

import pytest
import torch
from torch.func import vmap
from torch.nn import functional as F

from pfl_algorithms.engine import conv_per_client
from pfl_algorithms.engine.conv_per_client import PerClientConvolutions

from ..state_checks import assert_close_state
from .test_conv_gemm import CASES, _inputs, _run
from .test_conv_nhwc import (_assert_same, _Plain, _values_and_gradients, assert_groups_and_vmaps_layout,
                             assert_runs_as_before)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def applied(monkeypatch):
    """[whether each conv2d_per_client call applied]."""
    seen, real = [], conv_per_client.conv2d_per_client

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(conv_per_client, "conv2d_per_client", spy)
    return seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: ",".join(f"{a}={v}" for a, v in k.items()) or "plain")
@pytest.mark.parametrize("bias", ["clients", "shared", None])
def test_values_and_gradients_equal_the_grouped_convolution(applied, kwargs, bias, device):
    x, w, b = _inputs(device=device)
    b = {"clients": b, "shared": b[0], None: None}[bias]
    in_dims = (0, 0, 0 if bias == "clients" else None)

    def conv(x, w, b):
        return F.conv2d(x, w, b, **kwargs)

    _assert_same(_values_and_gradients(PerClientConvolutions(), conv, (x, w, b), in_dims),
                 _values_and_gradients(_Plain(), conv, (x, w, b), in_dims))
    assert applied == [True]


def test_groups_within_a_client_and_vmaps_own_output_layout(applied):
    """A client's own groups (a depthwise convolution) stay that client's; the output is vmap's
    own layout, which GroupNorm's rule takes."""
    assert_groups_and_vmaps_layout(PerClientConvolutions)
    assert applied == [True, True]


def test_what_it_does_not_apply_to_runs_as_before(applied):
    """A weight shared by the clients (vmap makes one dense convolution of it), unbatched images
    [C, H, W], and shapes that do not fit (F.conv2d's own error)."""
    assert_runs_as_before(PerClientConvolutions)
    assert applied == [False, False, False]


def test_autocast_gives_conv2ds_dtype(applied):
    """Under bfloat16 autocast each client's convolution is conv2d's: bfloat16, bf16 operands."""
    x, w, b = (t.float() for t in _inputs())
    with torch.autocast("cpu", dtype=torch.bfloat16), PerClientConvolutions():
        got = vmap(F.conv2d)(x, w, b)
        assert vmap(F.conv2d)(x.double(), w.double(), b.double()).dtype == torch.float64  # never cast
    assert got.dtype == torch.bfloat16
    reference = vmap(F.conv2d)(x.double(), w.double(), b.double())
    assert (got.double() - reference).abs().max() / reference.abs().max() < 2e-2
    assert applied == [True, True]


@pytest.mark.parametrize("factorized", [False, True], ids=["dense", "factorized"])
def test_a_batched_run_with_per_client_convolutions_equals_the_grouped_one(factorized):
    """SmallConvNet (a strided, padded second convolution, BatchNorm and pooling between) on the
    batched executor, training and chunked evaluation: the grouped run's numbers."""
    assert_close_state(_run("per-client", "batched", factorized), _run("grouped", "batched", factorized),
                       rtol=1e-9, atol=1e-10)


@cuda
def test_on_cuda_a_batched_run_with_per_client_convolutions_equals_the_grouped_one():
    assert_close_state(_run("per-client", "batched", False, device="cuda"),
                       _run("grouped", "batched", False, device="cuda"), rtol=1e-9, atol=1e-10)


def test_its_traffic_grows_with_the_clients_as_the_grouped_convolutions_does():
    """Bytes a vmapped 3x3 convolution moves, forward and backward (``TrafficCounter``), at 16
    clients: within 1.2x the grouped convolution's.  Indexing each client out of the stacked
    input made every index's backward write a zero gradient of the whole stack (5.4x here)."""
    from benchmarks.step_roofline import TrafficCounter

    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 8, 6, 9, 9, generator=g, requires_grad=True)
    w = torch.randn(16, 7, 6, 3, 3, generator=g, requires_grad=True)
    moved = {}
    for name, mode in (("grouped", _Plain), ("per-client", PerClientConvolutions)):
        counter = TrafficCounter()
        with counter, mode():
            vmap(lambda x, w: F.conv2d(x, w, padding=1))(x, w).sum().backward()
        moved[name] = counter.total
    assert moved["per-client"] <= 1.2 * moved["grouped"], moved
