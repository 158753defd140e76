"""Per-client convolutions as batched GEMMs (``engine.conv_gemm``, ``batched_conv='gemm'``): the
lowering equals vmap's grouped ``F.conv2d`` in value and gradient (float64 against float64, odd
sizes, every padding form, NaN and Inf), leaves what it cannot lower to ``F.conv2d``, follows
autocast's dtype, and a batched run with it equals the grouped run up to float reassociation."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import vmap
from torch.nn import functional as F

import pfl_algorithms.engine.conv_gemm as conv_gemm
from pfl_algorithms.algorithms import make_algorithm
from pfl_algorithms.data.partition import ClientSplit
from pfl_algorithms.engine.federation import EngineSettings
from pfl_algorithms.engine.local import LocalSchedule
from pfl_algorithms.engine.optim import OptimizerSettings
from pfl_algorithms.engine.rounds import federation_for, run_round
from pfl_kernels.nn import factorize

from ..state_checks import assert_close_state

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CASES = [dict(), dict(stride=2), dict(padding=1), dict(padding=(2, 1), dilation=(1, 2)), dict(padding="same"),
         dict(padding="valid"), dict(stride=(2, 1), padding=(0, 2)), dict(padding="same", dilation=2)]


@pytest.fixture
def lowered(monkeypatch):
    """How many convolutions ``conv2d_gemm`` lowered (returned a tensor for) so far."""
    count = [0]
    original = conv_gemm.conv2d_gemm

    def counting(*args, **kwargs):
        out = original(*args, **kwargs)
        count[0] += out is not None
        return out

    monkeypatch.setattr(conv_gemm, "conv2d_gemm", counting)
    return count


def _inputs(bias=True, dtype=torch.float64, clients=3, images=4, size=(11, 9), kernel=(3, 3), device="cpu"):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(clients, images, 5, *size, generator=g, dtype=dtype)
    w = torch.randn(clients, 6, 5, *kernel, generator=g, dtype=dtype)
    b = torch.randn(clients, 6, generator=g, dtype=dtype) if bias else None
    return tuple(None if t is None else t.to(device) for t in (x, w, b))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: ",".join(f"{a}={v}" for a, v in k.items()) or "plain")
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_equal_the_grouped_convolution(lowered, kwargs, bias, device):
    x, w, b = _inputs(bias, device=device)

    def conv(x, w, b):
        return F.conv2d(x, w, b, **kwargs)

    def run(mode):
        leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
        with mode:
            out = vmap(conv, in_dims=(0, 0, 0 if bias else None))(*leaves, *([] if bias else [None]))
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out))
        return out.detach(), [t.grad for t in leaves]

    want, want_grads = run(torch.enable_grad())
    got, got_grads = run(conv_gemm.GemmConvolutions())
    assert lowered[0] == 1
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w_ in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w_, rtol=1e-12, atol=1e-12)


def test_gradcheck_and_gradgradcheck():
    x, w, b = _inputs(clients=2, images=2, size=(6, 5), kernel=(3, 2))

    def conv(x, w, b):
        with conv_gemm.GemmConvolutions():
            return vmap(lambda x, w, b: F.conv2d(x, w, b, padding=1, stride=(2, 1)))(x, w, b)

    inputs = tuple(t.clone().requires_grad_() for t in (x, w, b))
    assert torch.autograd.gradcheck(conv, inputs)
    assert torch.autograd.gradgradcheck(conv, inputs)


def test_unbatched_images_and_non_finite_values(lowered):
    x, w, b = _inputs()
    x[1, 2, 3, 4, 5] = float("nan")
    x[2, 0, 1, 0, 0] = float("inf")
    x[0, 1, 0, 2, 2] = -float("inf")
    for inputs in (x, x[:, 0]):  # [K, N, C, H, W] and unbatched images [K, C, H, W]
        want = vmap(F.conv2d)(inputs, w, b)
        with conv_gemm.GemmConvolutions():
            got = vmap(F.conv2d)(inputs, w, b)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
        assert not want.isfinite().all() and want.isfinite().any()
        finite = want.isfinite()
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-12, atol=1e-12)
    assert lowered[0] == 2


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
def test_what_it_cannot_lower_runs_as_f_conv2d(lowered):
    x, w, b = _inputs()
    cases = [
        # a weight shared by the clients: vmap makes one dense convolution of it
        (lambda x, w, b: vmap(F.conv2d, in_dims=(0, None, None))(x, w[0], b[0]), (x, w, b)),
        # an input shared by the clients (their weights as one convolution's output channels)
        (lambda x, w, b: vmap(F.conv2d, in_dims=(None, 0, 0))(x[0], w, b), (x, w, b)),
        # grouped (here depthwise-like: 5 input channels in 5 groups, 10 outputs)
        (lambda x, w, b: vmap(lambda x, w: F.conv2d(x, w, groups=5))(x, w), (x, torch.randn(3, 10, 1, 3, 3,
                                                                                             dtype=x.dtype), b)),
        # 'same' with an even kernel: F.conv2d pads one more on the bottom and right
        (lambda x, w, b: vmap(lambda x, w: F.conv2d(x, w, padding="same"))(x, w), (x, w[..., :2, :2], b)),
    ]
    for fn, args in cases:
        want = fn(*args)
        with conv_gemm.GemmConvolutions():
            got = fn(*args)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert lowered[0] == 0


def test_errors_stay_f_conv2d_errors():
    x, w, b = _inputs()
    with conv_gemm.GemmConvolutions(), pytest.raises(RuntimeError) as lowered_error:
        vmap(lambda x, w: F.conv2d(x, w, padding="same", stride=2))(x, w)
    with pytest.raises(RuntimeError) as plain_error:
        vmap(lambda x, w: F.conv2d(x, w, padding="same", stride=2))(x, w)
    assert str(lowered_error.value) == str(plain_error.value)


def test_autocast_gives_conv2ds_dtype():
    """bfloat16 as conv2d's autocast gives (CUDA casts vmap's convolutions too; a CPU's autocast
    lists conv2d, not the aten::convolution vmap's batching rule calls, so there the grouped
    form stays float32)."""
    x, w, b = (t.float() for t in _inputs())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.conv2d(x[0], w[0], b[0]).dtype == torch.bfloat16
        want = vmap(F.conv2d)(x, w, b)
        with conv_gemm.GemmConvolutions():
            got = vmap(F.conv2d)(x, w, b)
    assert got.dtype == torch.bfloat16
    reference = vmap(F.conv2d)(x.double(), w.double(), b.double())
    scale = reference.abs().max()
    assert (got.double() - reference).abs().max() / scale < 2e-2  # bf16 operands, as conv2d's own
    assert (want.double() - reference).abs().max() / scale < 2e-2
    with torch.autocast("cpu", dtype=torch.bfloat16), conv_gemm.GemmConvolutions():  # float64 is never cast
        assert vmap(F.conv2d)(x.double(), w.double(), b.double()).dtype == torch.float64


def test_the_choice_is_checked():
    with pytest.raises(ValueError, match="batched_conv must be one of grouped, gemm, grouped-nhwc, per-client, got 'cudnn'"):
        EngineSettings(batched_conv="cudnn")
    with pytest.raises(ValueError, match="batched_conv must be one of grouped, gemm, grouped-nhwc, per-client, got 'x'"):
        conv_gemm.batched_convolutions("x")


class SmallConvNet(nn.Module):
    """Two convolutions (one strided and padded) with BatchNorm, pooling and a head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                                  nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(6 * 2 * 2, 3)

    def forward(self, x):
        return self.head(self.body(x))


def _run(conv: str, executor: str, factorized: bool, device: str = "cpu", *, dtype=torch.float64,
         autocast=None):
    """Two FedAvg rounds of SmallConvNet on 3 clients: (round records, federation state, algorithm state)."""
    g = torch.Generator().manual_seed(3)
    sizes = (21, 30, 26)
    labels = torch.randint(0, 3, (sum(sizes),), generator=g)
    inputs = torch.randn(sum(sizes), 1, 9, 9, generator=g, dtype=dtype) + labels.view(-1, 1, 1, 1)
    torch.manual_seed(0)
    model = SmallConvNet().to(dtype)
    if factorized:
        model = factorize(model)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    empty = torch.empty(0, dtype=torch.int64)
    splits = [ClientSplit(train=torch.arange(s, s + n), val=empty, test=torch.arange(s, s + n))
              for s, n in zip(starts, sizes)]
    settings = EngineSettings(rounds=2, optimizer=OptimizerSettings(lr=0.05, momentum=0.9),
                              schedule=LocalSchedule(batch_size=8, epochs=2), executor=executor, batched_conv=conv,
                              autocast=autocast)
    algorithm = make_algorithm("fedavg")
    fed = federation_for(algorithm, model, inputs, labels, splits, settings, device=device)
    fed.executor.batched_eval = True if executor == "batched" else None  # scored in chunks too, as on CUDA
    records = [run_round(fed, algorithm, r).as_dict() for r in range(2)]
    for record in records:
        record.pop("wall_s")
    return records, fed.state_dict(), algorithm.state_dict()


@pytest.mark.parametrize("factorized", [False, True], ids=["dense", "factorized"])
def test_a_batched_run_with_gemm_convolutions_equals_the_grouped_one(lowered, factorized):
    grouped = _run("grouped", "batched", factorized)
    assert lowered[0] == 0
    gemm = _run("gemm", "batched", factorized)
    assert lowered[0] > 0  # training steps (short last batches too) and the chunked evaluation
    assert_close_state(gemm, grouped, rtol=1e-9, atol=1e-10)
    # the sequential executor has no vmapped convolution: the setting changes nothing there
    assert_close_state(_run("gemm", "sequential", factorized), _run("grouped", "sequential", factorized),
                       rtol=0, atol=0)


@cuda
def test_on_cuda_captured_gemm_steps_equal_the_grouped_ones(lowered):
    """On CUDA the batched steps replay as CUDA graphs: captured with the lowering, they give the
    grouped run's numbers (float64) and scoring in chunks (the default there) uses it too."""
    grouped = _run("grouped", "batched", False, device="cuda")
    gemm = _run("gemm", "batched", False, device="cuda")
    assert lowered[0] > 0
    assert_close_state(gemm, grouped, rtol=1e-9, atol=1e-10)
