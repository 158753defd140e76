"""Direct launches (``pfl_kernels/triton/_direct.py``, issue 30 item 1) on a CPU: a real
``triton.jit`` kernel whose Triton path (``JITFunction.run``: bind, compile, launch) and
compiled launcher are stand-ins that record what they get, so the cache's keys and the
arguments it launches with are checked without a GPU.  On a GPU the Triton tests run the
ops with direct launches on (``scripts/gpu_check.sh``).

Not in the interpreter: there ``triton.jit`` makes no compiled kernels (``direct`` returns
the kernel itself, tested below too).
"""
from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="the interpreter compiles nothing to launch directly")

import triton.language as tl  # noqa: E402

from pfl_kernels.triton import _direct  # noqa: E402


@triton.jit(do_not_specialize=["bits"])
def _kernel(x_ptr, n, scale, bits, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 3):
    pass


class Compiled:
    """Stands in for a ``CompiledKernel``: ``[grid](*args, stream=)`` records the launch."""

    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.launches.append(("direct", grid, args, stream))
        return runner


@pytest.fixture
def launches(monkeypatch):
    """The recorded launches: ('triton', grid, args, kwargs) for Triton's path,
    ('direct', grid, all args in signature order, stream) for a direct one."""
    log = []
    monkeypatch.setattr(_direct, "ENABLED", True)
    monkeypatch.setattr(_direct, "REASON", None)
    monkeypatch.setattr(_direct, "_LAUNCHERS", {})
    monkeypatch.setattr(_direct, "_COUNTS", [0, 0])
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda idx: 1000 + idx, raising=False)

    def run(*args, grid, warmup, **kwargs):
        log.append(("triton", grid, args, kwargs))
        return Compiled(log)

    monkeypatch.setattr(_kernel, "run", run)
    return log


def call(x, n=64, scale=0.5, bits=7, flag=True, grid=(4,), **meta):
    meta = {"BLOCK": 128, "num_warps": 4, **meta}
    _direct.direct(_kernel)[grid](x, n, scale, bits, flag, **meta)


def kinds(log):
    return [entry[0] for entry in log]


def test_a_signature_is_bound_by_triton_once_then_launched_directly(launches):
    x = torch.randn(64)
    call(x)
    call(x, scale=0.25)  # floats are not specialized: same signature, the new value passed
    assert kinds(launches) == ["triton", "direct"]
    _, grid, args, stream = launches[1]
    # every parameter in signature order, the constexprs from the keywords or their defaults,
    # the launch options (num_warps) left out; the grid as three sizes; the current stream
    assert args == (x, 64, 0.25, 7, True, 128, 3)
    assert grid == (4, 1, 1) and stream == 1000


@pytest.mark.parametrize("change", [
    dict(x=lambda x: x.double()),                     # dtype
    dict(x=lambda x: x[1:]),                          # a pointer 4 bytes off 16-byte alignment
    dict(n=65), dict(n=16), dict(n=1),                # ints are keyed by value
    dict(flag=False), dict(flag=1),                   # a bool is not the int 1
    dict(scale=2),                                    # an int where a float was
    dict(bits=2**40),                                 # an unspecialized int of another type (i64)
    dict(BLOCK=256), dict(MODE=2), dict(num_warps=8),  # constexprs and options
], ids=lambda c: next(iter(c)) + "=" + str(next(iter(c.values())))[:12])
def test_anything_triton_specializes_on_makes_a_new_signature(launches, change):
    x = torch.randn(64)
    call(x)
    call(x)
    kwargs = {k: (v(x) if callable(v) else v) for k, v in change.items()}
    call(**{"x": x, **kwargs})
    assert kinds(launches) == ["triton", "direct", "triton"]


def test_an_unspecialized_int_keeps_its_signature_within_its_type(launches):
    x = torch.randn(64)
    call(x, bits=7)
    call(x, bits=123456)
    assert kinds(launches) == ["triton", "direct"] and launches[1][2][3] == 123456


def test_arguments_of_other_kinds_always_take_tritons_path(launches):
    x = torch.randn(64)
    for _ in range(2):
        _direct.direct(_kernel)[(1,)](x, (1, 2), 0.5, 7, True, BLOCK=128)
    assert kinds(launches) == ["triton", "triton"]


def test_a_grid_function_takes_tritons_path(launches):
    x = torch.randn(64)
    for _ in range(2):
        call(x, grid=lambda meta: (4,))
    assert kinds(launches) == ["triton", "triton"]


def test_pre_run_hooks_take_tritons_path(launches, monkeypatch):
    monkeypatch.setattr(_kernel, "pre_run_hooks", [lambda *a, **k: None])
    x = torch.randn(64)
    call(x)
    call(x)
    assert kinds(launches) == ["triton", "triton"]


def test_the_cache_is_bounded(launches, monkeypatch):
    monkeypatch.setattr(_direct, "_MAX_SIGNATURES", 3)
    x = torch.randn(64)
    for n in range(10):
        call(x, n=100 + n)
    assert len(_direct.direct(_kernel).signatures) <= 3


def test_switched_off_or_interpreted_kernels_are_launched_as_they_are(monkeypatch):
    monkeypatch.setattr(_direct, "_LAUNCHERS", {})
    monkeypatch.setattr(_direct, "REASON", None)
    monkeypatch.setattr(_direct, "ENABLED", False)
    assert _direct.direct(_kernel) is _kernel
    monkeypatch.setattr(_direct, "ENABLED", True)
    assert isinstance(_direct.direct(_kernel), _direct.DirectLaunch)
    assert _direct.direct(_kernel) is _direct.direct(_kernel)  # one per kernel: shared signatures

    class Interpreted:  # no device_caches: nothing compiled
        fn = _kernel.fn
    interpreted = Interpreted()
    assert _direct.direct(interpreted) is interpreted
    monkeypatch.setattr(_direct, "REASON", "an unknown Triton")
    assert _direct.direct(_kernel) is _kernel


def test_eager_op_launches_go_through_direct_and_traced_ones_do_not(monkeypatch):
    from pfl_kernels.triton import factorized as tf

    monkeypatch.setattr(_direct, "_LAUNCHERS", {})
    monkeypatch.setattr(_direct, "REASON", None)
    monkeypatch.setattr(_direct, "ENABLED", True)
    assert isinstance(tf._launch(tf._factorized_weight_kernel), _direct.DirectLaunch)
    monkeypatch.setattr(tf, "tracing", lambda: True)
    assert not isinstance(tf._launch(tf._factorized_weight_kernel), _direct.DirectLaunch)


def test_int_types_match_tritons():
    from triton.runtime.jit import mangle_type

    for v in (0, 1, -1, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 - 1, 2**63, 2**64 - 1, -2**63):
        assert _direct._int_type(v) == mangle_type(v), v


def test_this_triton_has_the_launch_api_read():
    assert _direct.REASON is None, _direct.REASON


@pytest.mark.parametrize("version,ok", [("3.6.0", True), ("3.9.1", True), ("3.5.0", False), ("3.10.0", False),
                                        ("4.0.0", False), ("3.7.0+git1234", True), ("nightly", False)])
def test_only_the_triton_versions_read_launch_directly(version, ok):
    reason = _direct._supported(version)
    assert (reason is None) == ok, reason


def planned(x, token, scalars=(64, 0.5, 7, True), grid=(4,), meta=None):
    meta = meta if meta is not None else {"BLOCK": 128, "num_warps": 4}
    _direct.direct(_kernel).planned(grid, token, (x,), scalars, meta)


def test_a_planned_launch_keys_its_tensors_and_the_plans_identity(launches):
    x = torch.randn(64)
    scalars, meta = (64, 0.5, 7, True), {"BLOCK": 128, "num_warps": 4}
    plan = (scalars, meta)
    planned(x, plan, scalars, meta=meta)
    planned(torch.randn(64), plan, scalars, meta=meta)  # other tensor, same dtype and alignment
    assert kinds(launches) == ["triton", "direct"]
    assert launches[1][2][1:] == (64, 0.5, 7, True, 128, 3)  # the scalars, then the constexprs and defaults
    planned(x[1:], plan, scalars, meta=meta)  # 4 bytes off alignment: Triton's path
    planned(x.double(), plan, scalars, meta=meta)  # another dtype
    planned(x, (scalars, meta), scalars, meta=meta)  # an equal plan, but another object
    assert kinds(launches) == ["triton", "direct", "triton", "triton", "triton"]
    entry = next(iter(_direct.direct(_kernel).planned_signatures.values()))
    assert entry[2] is plan  # held: no other object can take its id while the entry lives


def test_counts_tell_the_direct_launches_from_tritons(launches, monkeypatch):
    """What a benchmark records beside its figures: every launch made while switched on,
    counted as direct or through Triton exactly as it was made; none while switched off."""
    x = torch.randn(64)
    call(x)
    call(x)
    call(x[1:])  # another alignment: a new signature
    _direct.direct(_kernel)[(1,)](x, (1, 2), 0.5, 7, True, BLOCK=128)  # unkeyed
    plan = object()
    planned(x, plan)
    planned(x, plan)
    planned(x, object())  # another plan: bound again
    direct = kinds(launches).count("direct")
    assert direct == 2 and _direct.counts() == {"direct": direct, "through_triton": len(launches) - direct}
    monkeypatch.setattr(_direct, "ENABLED", False)
    call(x)
    _direct.DirectLaunch(_kernel).planned((4,), plan, (x,), (64, 0.5, 7, True), {"BLOCK": 128})
    assert kinds(launches)[-2:] == ["triton", "triton"]
    assert _direct.counts() == {"direct": 2, "through_triton": 5}


def test_a_planned_launch_switched_off_is_tritons(launches, monkeypatch):
    monkeypatch.setattr(_direct, "ENABLED", False)
    x = torch.randn(64)
    plan = object()
    launcher = _direct.DirectLaunch(_kernel)
    for _ in range(2):
        launcher.planned((4,), plan, (x,), (64, 0.5, 7, True), {"BLOCK": 128})
    assert kinds(launches) == ["triton", "triton"]


def _record_planned_launches(monkeypatch, recorder) -> None:
    """Every module's ``_launch`` gives ``recorder(kernel)``, which ``_launch_planned`` takes for
    a direct launcher (its ``planned`` is called)."""
    import importlib

    from pfl_kernels.triton import factorized as tf
    for name in ("aggregate", "branch", "branch_aggregate", "class_means", "factorized", "similarity"):
        monkeypatch.setattr(importlib.import_module(f"pfl_kernels.triton.{name}"), "_launch", recorder)
    monkeypatch.setattr(tf, "DirectLaunch", recorder)


def _planned_calls(monkeypatch, call):
    """(kernel, token, scalars, meta) of each planned launch of two calls of ``call``."""
    from pfl_kernels.triton import factorized as tf

    seen = []

    class Recorder:
        def __init__(self, kernel=None):
            self.kernel = kernel

        def planned(self, grid, token, tensors, scalars, meta):
            assert all(isinstance(t, torch.Tensor) for t in tensors)
            seen.append((self.kernel, token, scalars, meta))

    _record_planned_launches(monkeypatch, Recorder)
    for _ in range(2):
        call()
    half = len(seen) // 2
    assert half and len(seen) == 2 * half
    return seen[:half], seen[half:]


def _assert_same_plan_objects(first, second):
    """Each launch of the second call got the very objects of the first's: the token, its
    scalars and meta come from the cached plan (``metadata_cached``), and tokens are not
    shared by two launches of one kernel with other arguments."""
    for (k1, t1, s1, m1), (k2, t2, s2, m2) in zip(first, second):
        assert k1 is k2 and t1 is t2 and s1 is s2 and m1 is m2
    tokens = [(id(k), id(t)) for k, t, _, _ in first]
    assert len(set(tokens)) == len(tokens)


def test_the_factorized_launches_hand_their_cached_plan(monkeypatch):
    from pfl_kernels.triton import factorized as tf

    u, v, mu = torch.randn(3, 25, 1), torch.randn(3, 1, 18), torch.randn(3, 25, 18)
    g = torch.randn(3, 6, 3, 5, 5)
    first, second = _planned_calls(monkeypatch, lambda: (
        tf.factorized_weight_triton(u, v, mu, None, shape=[6, 3, 5, 5], layout="spatial"),
        tf.factorized_weight_backward_triton(g, u, v, mu, None, shape=[6, 3, 5, 5], layout="spatial",
                                             output_mask=[True] * 4)))
    _assert_same_plan_objects(first, second)


def test_the_branch_and_pairwise_launches_hand_their_cached_plan(monkeypatch):
    from pfl_kernels.triton import branch as tb, similarity as ts

    weights, alpha = torch.randn(4, 3, 16, 6), torch.softmax(torch.randn(4, 3), 1)
    g = torch.randn(4, 16, 6)
    x = torch.randn(5, 70)
    first, second = _planned_calls(monkeypatch, lambda: (
        tb.branch_combine_triton(weights, alpha),
        tb.branch_combine_backward_triton(g, weights, alpha, [True, True]),
        ts.pairwise_cosine_triton(x, None, 1e-8)))
    assert len(first) == 5  # combine, its backward, the product's two passes, the epilogue
    _assert_same_plan_objects(first, second)


def test_plans_strides_are_the_launched_views(monkeypatch):
    """The strides a plan holds (read from meta twins) are those of the views launched:
    channels_last weights and a transposed gradient, which the launcher copies or views."""
    from pfl_kernels.triton import branch as tb

    weights = torch.randn(4, 3, 16, 3, 3, 6).permute(0, 1, 2, 5, 3, 4)  # each weight channels_last: copied
    alpha = torch.softmax(torch.randn(4, 3), 1)
    g = torch.randn(4, 16, 6, 3, 3).transpose(1, 2).contiguous().transpose(1, 2)
    seen = []

    class Recorder:
        def __init__(self, kernel=None):
            pass

        def planned(self, grid, token, tensors, scalars, meta):
            seen.append((tensors, scalars))

    from pfl_kernels.triton import factorized as tf
    _record_planned_launches(monkeypatch, Recorder)
    tb.branch_combine_triton(weights, alpha)
    tb.branch_combine_backward_triton(g, weights, alpha, [True, True])
    (w3, _, _), scalars = seen[0]
    assert tuple(scalars[3:6]) == w3.stride()
    (g2, w3b, *_), scalars = seen[1]
    assert tuple(scalars[4:6]) == g2.stride() and tuple(scalars[6:9]) == w3b.stride()
    # the factorized backward: a permuted gradient that cannot be viewed as [K, A, R, B] (copied)
    u, v, mu = torch.randn(3, 25, 1), torch.randn(3, 1, 18), torch.randn(3, 25, 18)
    for grad_w in (torch.randn(5, 5, 3, 6, 3).permute(4, 3, 2, 1, 0), torch.randn(6, 6, 3, 5, 5)[::2]):
        seen.clear()
        tf.factorized_weight_backward_triton(grad_w, u, v, mu, None, shape=[6, 3, 5, 5], layout="spatial",
                                             output_mask=[True] * 4)
        (g, *_), scalars = seen[0]
        assert tuple(scalars[5:9]) == g.stride()


@pytest.mark.parametrize("value, enabled", [(None, True), ("1", True), ("", True), ("0", False), (" 0 ", False)])
def test_direct_launches_are_the_default_and_zero_turns_them_off(value, enabled):
    """Direct launches are on unless PFL_KERNELS_DIRECT_LAUNCH is 0."""
    assert _direct.enabled_by(value) is enabled


@pytest.mark.parametrize("value, enabled", [(None, True), (" 0 ", False)])
def test_the_variable_is_read_at_import(value, enabled):
    """``ENABLED`` is the variable's value when the package is first imported (a fresh process
    for each: the start of one is seconds on 2 cores, so the values are checked above)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PFL_KERNELS_DIRECT_LAUNCH"}
    if value is not None:
        env["PFL_KERNELS_DIRECT_LAUNCH"] = value
    out = subprocess.run([sys.executable, "-c", "from pfl_kernels.triton import _direct; print(_direct.ENABLED)"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(enabled)
