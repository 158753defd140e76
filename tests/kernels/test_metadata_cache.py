"""The per-signature cache of the ops' metadata checks and launch plans (issue 30, item 1):
a check runs once per (sizes, strides, dtype, device, scalars), every failing call runs it
again, and nothing is cached while tracing."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pfl_kernels.ops import _memo
from pfl_kernels.ops._memo import cdiv, metadata_cached, next_power_of_2


def counting(check):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(args)
        return check(*args, **kwargs)

    return metadata_cached(wrapped), calls


def rows_of(x, scale):
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got {list(x.shape)}")
    return [x.shape[0], scale]


def test_one_run_per_signature_whatever_the_values():
    check, calls = counting(rows_of)
    x = torch.randn(3, 5)
    assert check(x, 2) == [3, 2]
    assert check(torch.randn(3, 5), 2) == [3, 2]  # other values, same metadata
    assert check(x.clone().fill_(float("nan")), 2) == [3, 2]
    assert len(calls) == 1


@pytest.mark.parametrize("other", [
    lambda x: x.t().contiguous().t(),  # same sizes, other strides
    lambda x: x.double(),
    lambda x: x[:2],
    lambda x: torch.randn(3, 5, device="meta"),
], ids=["strides", "dtype", "sizes", "device"])
def test_a_change_of_metadata_runs_the_check_again(other):
    check, calls = counting(rows_of)
    x = torch.randn(3, 5)
    check(x, 2)
    check(other(x), 2)
    assert len(calls) == 2


def test_scalars_are_keyed_by_type_and_value():
    check, calls = counting(rows_of)
    x = torch.randn(3, 5)
    check(x, 1)
    check(x, 1.0)
    check(x, True)
    check(x, 2)
    assert len(calls) == 4
    assert check(x, True) == [3, True]


def test_a_failing_signature_fails_on_every_call():
    check, calls = counting(rows_of)
    bad = torch.randn(3)
    for _ in range(3):
        with pytest.raises(ValueError, match="x must be 2-D"):
            check(bad, 1)
    assert len(calls) == 3
    assert check.cache == {}


def test_keywords_tracing_and_unhashable_arguments_are_not_cached():
    check, calls = counting(lambda x, scale=1: rows_of(x, scale))
    x = torch.randn(3, 5)
    check(x, scale=2)
    check(x, scale=2)
    assert len(calls) == 2
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        check(fake, 2)
        check(fake, 2)
    assert len(calls) == 4
    check(x, [[1], [2]])  # a list of lists: its tuple holds lists, which cannot be hashed
    check(x, [[1], [2]])
    assert len(calls) == 6


def test_a_full_cache_starts_over(monkeypatch):
    monkeypatch.setattr(_memo, "_MAX_ENTRIES", 3)
    check, calls = counting(rows_of)
    for n in range(1, 6):
        check(torch.randn(n, 2), 0)
    assert len(check.cache) <= 3
    check(torch.randn(5, 2), 0)
    assert len(calls) == 5  # the last signature is still cached


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 9, 1000, 1024, 1025, 2**20 + 1])
def test_host_integer_helpers_match_triton(n):
    triton = pytest.importorskip("triton")
    assert next_power_of_2(n) == triton.next_power_of_2(n) or n == 0 and next_power_of_2(0) == 1
    for d in (1, 3, 64, 4096):
        assert cdiv(n, d) == triton.cdiv(n, d)


def test_a_plan_cached_for_good_input_does_not_pass_bad_input():
    """After a call with valid factors is cached, factors that do not fit still fail (the
    launch plan's key holds every size the checks read)."""
    pytest.importorskip("triton")
    from pfl_kernels.triton import factorized as tf

    u, v, mu = torch.randn(4, 25, 1), torch.randn(4, 1, 18), torch.randn(4, 25, 18)
    shape = [6, 3, 5, 5]
    plan = tf._forward_plan(u, v, mu, None, shape, "spatial", tf._MAX_TILE, tf._MAX_BLOCK_R)
    assert plan[0] == (4, 6, 3, 5, 5)
    with pytest.raises(ValueError, match="mu must have shape"):
        tf._forward_plan(u, v, mu[:, :, :17], None, shape, "spatial", tf._MAX_TILE, tf._MAX_BLOCK_R)
    with pytest.raises(ValueError, match="R=20 rows"):
        tf._forward_plan(u, v, mu, None, [6, 3, 5, 4], "spatial", tf._MAX_TILE, tf._MAX_BLOCK_R)
    # smaller tiles (as tests set them) get a plan of their own
    small = tf._forward_plan(u, v, mu, None, shape, "spatial", 16, 4)
    assert small[1] != plan[1] and small[3]["BLOCK_R"] == 4


def test_sequences_are_keyed_by_their_items_types():
    """A shape [6.0, 3] or (True, 3) is not the shape [6, 3]: equal as Python values, but a
    check may reject the first two, so a cached [6, 3] must not let them through."""
    check, calls = counting(lambda shape: list(shape))
    for shape in ([6, 3], [6.0, 3], (6, 3), [True, 3], torch.Size([6, 3])):
        check(shape)
    assert len(calls) == 5
    check([6, 3])
    assert len(calls) == 5


OP_CHECKS = {
    "factorized": ["_check_op_args", "_check_soft_threshold_args"],
    "branch": ["_check_op_args", "_check_project_args"],
    "aggregate": ["_check_op_args"],
    "branch_aggregate": ["_check_op_args"],
    "class_means": ["_check_op_args", "check_output_size"],
    "similarity": ["_check_pair", "_check_weights_args"],
}


@pytest.mark.parametrize("family", sorted(OP_CHECKS))
def test_each_check_is_cached_where_it_is_defined_and_shared(family):
    """One cache per check: the op module decorates it, and the Triton launchers use that very
    function (not a second wrapper with a cache of its own)."""
    import importlib

    ops = importlib.import_module(f"pfl_kernels.ops.{family}")
    for name in OP_CHECKS[family]:
        assert hasattr(getattr(ops, name), "cache"), f"{family}.{name} is not metadata_cached"
    try:
        triton_mod = importlib.import_module(f"pfl_kernels.triton.{family}")
    except ImportError:  # no triton
        return
    for name in OP_CHECKS[family]:
        if hasattr(triton_mod, name):
            assert getattr(triton_mod, name) is getattr(ops, name)


def test_layout_geometry_is_cached_and_still_rejects_bad_shapes():
    from pfl_kernels._layout import layout_geometry

    assert layout_geometry([6, 3, 5, 5], "spatial") == layout_geometry((6, 3, 5, 5), "spatial")
    assert hasattr(layout_geometry, "cache")
    for _ in range(2):
        with pytest.raises(ValueError, match="sizes >= 1"):
            layout_geometry([6, 0, 5, 5], "spatial")
