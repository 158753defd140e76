"""A plain eager call skips the dispatcher, and nothing else does (``pfl_kernels/ops/_eager.py``).

The CPU kernels here stand for the CUDA launchers: a spy registered as the CPU launcher of an
op records each direct call and computes it with the op itself, so every case checks both
which path ran and the result (against float64).
"""
from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from pfl_kernels.ops import (_eager, branch_aggregate, factorized_weight, pairwise_cosine, project_simplex_,
                             similarity_weights, soft_threshold_, weighted_average)
from pfl_kernels.reference import aggregate as ref_aggregate, branch as ref_branch
from tests.tolerances import assert_close


@pytest.fixture
def spies(monkeypatch):
    """{op name: number of direct calls}; each op's CPU launcher is a spy that runs the op."""
    calls = {}
    monkeypatch.setattr(_eager, "ENABLED", True)

    def spy(name):
        op = getattr(torch.ops.pfl, name)

        def launcher(*args, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)
        return launcher

    for name in ("weighted_average", "branch_aggregate", "pairwise_cosine", "similarity_weights", "factorized_weight"):
        calls[name] = 0
        monkeypatch.setitem(_eager.KERNELS, (name, "cpu"), spy(name))
    return calls


def operands(requires_grad=False):
    g = torch.Generator().manual_seed(3)
    weights = torch.rand(3, 5, generator=g)
    params = torch.randn(5, 7, generator=g, requires_grad=requires_grad)
    return weights, params


def expected(weights, params):
    return ref_aggregate.weighted_average(weights.double(), params.detach().double())


def test_a_plain_eager_call_skips_the_dispatcher(spies):
    weights, params = operands()
    assert_close(weighted_average(weights, params), expected(weights, params), dtype=torch.float32)
    assert spies["weighted_average"] == 1
    counts = torch.tensor([3, 1, 2])
    branch_aggregate(torch.randn(3, 2, 4), torch.rand(3, 2), counts)
    sim = pairwise_cosine(torch.randn(4, 6))
    similarity_weights(sim, tau=0.1, scale=5.0)
    factorized_weight(torch.randn(6, 1), torch.randn(1, 4), shape=[4, 6], layout="linear")
    assert spies == {"weighted_average": 1, "branch_aggregate": 1, "pairwise_cosine": 1, "similarity_weights": 1,
                     "factorized_weight": 1}


def test_a_parameter_and_no_grad_still_skip_it(spies):
    weights, params = operands(requires_grad=True)
    with torch.no_grad():
        out = weighted_average(weights, torch.nn.Parameter(params.detach()))
    assert spies["weighted_average"] == 1 and not out.requires_grad


def test_a_call_that_records_a_gradient_goes_through_autograd(spies):
    weights, params = operands(requires_grad=True)
    out = weighted_average(weights, params)
    assert spies["weighted_average"] == 0
    out.sum().backward()
    assert_close(params.grad, weights.double().sum(0)[:, None].expand(5, 7), dtype=torch.float32)


def test_a_forward_mode_tangent_is_carried(spies):
    g = torch.Generator().manual_seed(5)
    u, v, tangent = torch.randn(6, 1, generator=g), torch.randn(1, 4, generator=g), torch.randn(6, 1, generator=g)
    with forward_ad.dual_level():
        out = factorized_weight(forward_ad.make_dual(u, tangent), v, shape=[4, 6], layout="linear")
        jvp = forward_ad.unpack_dual(out).tangent
        # inside a dual level even a call without a tangent keeps the dispatcher
        factorized_weight(u, v, shape=[4, 6], layout="linear")
    assert spies["factorized_weight"] == 0
    assert_close(jvp, (tangent.double() @ v.double()).t(), dtype=torch.float32)


def test_vmap_and_grad_transforms_go_through_the_dispatcher(spies):
    weights, params = operands()
    batched = torch.func.vmap(lambda p: weighted_average(weights, p))(params.expand(2, 5, 7))
    assert_close(batched[1], expected(weights, params), dtype=torch.float32)
    grad = torch.func.grad(lambda p: weighted_average(weights, p).sum())(params)
    assert_close(grad, weights.double().sum(0)[:, None].expand(5, 7), dtype=torch.float32)
    assert spies["weighted_average"] == 0


def test_modes_and_tracing_see_the_op(spies):
    weights, params = operands()

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        weighted_average(weights, params)
    assert torch.ops.pfl.weighted_average.default in mode.ops

    class Counted(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counted.calls += func in (torch.ops.pfl.weighted_average, torch.ops.pfl.weighted_average.default)
            return func(*args, **(kwargs or {}))

    with Counted():
        weighted_average(weights, params)
    assert Counted.calls == 1

    from torch.fx.experimental.proxy_tensor import make_fx
    graph = make_fx(lambda w, p: weighted_average(w, p))(weights, params)
    assert "pfl.weighted_average" in graph.code

    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as fake_mode:
        out = weighted_average(fake_mode.from_tensor(weights), fake_mode.from_tensor(params))
    assert list(out.shape) == [3, 7]
    assert spies["weighted_average"] == 0


def test_torch_compile_traces_the_op(spies):
    weights, params = operands()
    compiled = torch.compile(lambda w, p: weighted_average(w, p), backend="eager", fullgraph=True)
    assert_close(compiled(weights, params), expected(weights, params), dtype=torch.float32)
    assert spies["weighted_average"] == 0


class _Marked(torch.Tensor):
    """A subclass that only overrides ``__torch_function__`` (its dispatch keys are a plain tensor's)."""

    seen = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen += func in (torch.ops.pfl.weighted_average, torch.ops.pfl.weighted_average.default)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_tensors_that_are_not_plain_go_through_the_dispatcher(spies):
    weights, params = operands()
    out = weighted_average(weights, params.as_subclass(_Marked))
    assert _Marked.seen == 1
    assert_close(torch.Tensor(out), expected(weights, params), dtype=torch.float32)
    # a negative view: the dispatcher materializes it before any kernel reads its memory
    out = weighted_average(weights, torch._neg_view(params))
    assert_close(out, -expected(weights, params), dtype=torch.float32)
    assert spies["weighted_average"] == 0


def test_the_profiler_still_shows_the_op(spies):
    weights, params = operands()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as prof:
        weighted_average(weights, params)
    assert spies["weighted_average"] == 1
    assert "pfl::weighted_average" in {e.name for e in prof.events()}


@pytest.fixture
def writing_spies(monkeypatch):
    """{op name: direct calls} for the ops that write an argument, registered as
    ``launchers_on_cpu`` registers a launcher (``_eager.register``: with the version bump)."""
    calls = {}
    monkeypatch.setattr(_eager, "ENABLED", True)
    for name in ("soft_threshold_", "project_simplex_"):
        calls[name] = 0
        op = getattr(torch.ops.pfl, name)

        def launcher(*args, name=name, op=op):
            calls[name] += 1
            with torch._C._AutoDispatchBelowAutograd():  # the kernel alone, as a launcher
                return op(*args)
        monkeypatch.delitem(_eager.KERNELS, (name, "cpu"), raising=False)
        _eager.register(name, "cpu", launcher)
        monkeypatch.setitem(_eager.KERNELS, (name, "cpu"), _eager.KERNELS[(name, "cpu")])
    return calls


def _projected(x: torch.Tensor) -> torch.Tensor:
    ref_branch.project_simplex_(x)
    return x


# op name -> (the public wrapper's call, in place; the float64 reference on a copy)
WRITERS = {"soft_threshold_": (lambda x: soft_threshold_(x, 0.25),
                               lambda x: x.sign() * (x.abs() - 0.25).clamp_min(0)),
           "project_simplex_": (project_simplex_, lambda x: _projected(x.clone()))}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_an_op_that_writes_an_argument_skips_the_dispatcher_and_bumps_its_version(writing_spies, name):
    """Past the dispatcher the write still moves the version counter (its Autograd kernel's
    bump, ``_library._guard_mutation``): a backward that saved the tensor refuses to run."""
    call, reference = WRITERS[name]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    want = reference(x)
    a = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    loss = (a * x).sum()  # saves x
    version = x._version
    with torch.no_grad():
        call(x)
    assert writing_spies[name] == 1 and x._version > version
    assert_close(x, want, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_write_into_a_tensor_that_requires_grad_keeps_the_dispatcher(writing_spies, name):
    """Under grad mode the dispatcher's Autograd kernel refuses it (the op has no derivative)."""
    leaf = torch.rand(4, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="has no derivative.*torch.no_grad"):
        WRITERS[name][0](leaf)
    assert writing_spies[name] == 0


def test_an_inference_tensor_keeps_the_dispatcher(writing_spies):
    """It has no version counter to bump: the dispatcher's path, which knows to skip it."""
    with torch.inference_mode():
        x = torch.randn(4, 3)
        soft_threshold_(x, 0.25)
    assert writing_spies["soft_threshold_"] == 0


def test_switched_off_every_call_goes_through_the_dispatcher(spies, monkeypatch):
    monkeypatch.setattr(_eager, "ENABLED", False)
    weights, params = operands()
    assert_close(weighted_average(weights, params), expected(weights, params), dtype=torch.float32)
    assert spies["weighted_average"] == 0
