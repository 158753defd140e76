"""Host time per call of each public op against a bare Triton launch of the same kernel
(issue 30, item 1; needs CUDA, torch >= 2.11, triton >= 3.6).

    python benchmarks/gpu_launch.py [--quick]
    TRITON_INTERPRET=1 python benchmarks/gpu_launch.py --dry-run   # check the script on a CPU
    python benchmarks/gpu_launch.py --host      # on a CPU: the host path with launches skipped

For every case (an op with a Triton kernel, at a shape small enough that the host, not the
GPU, sets the pace) it

1. calls the public op once while recording every Triton launch it makes (kernel, grid,
   arguments; the tensors' contents before and after each launch), checks the result against
   the float64 reference, and replays each recorded launch bare (``kernel[grid](*args,
   **kwargs)``) from the recorded state: it must write exactly what the op's launch wrote
   (so the bare launch is the same work with the same arguments);
2. times ``calls`` calls back to back, ``repeats`` times: the host time per call
   (``time.perf_counter`` around the calls, no sync inside) and the device time per call
   (CUDA events around the same calls, one sync after), medians over the repeats; for the
   public op with its kernels launched through Triton's launcher (``PFL_KERNELS_DIRECT_LAUNCH=0``),
   and for the bare launches (all of a call's launches, in order);
3. reports the difference of host times, public − bare, against the target: within
   ``TARGET_US`` = 25 µs (issue 30);
4. times the public op again with direct launches (``pfl_kernels/triton/_direct.py``: the
   compiled kernel launched without Triton's per-call binding; the default), after checking
   its result again.  Its difference from the bare launch is the one the target is read on.

The backward ops appear twice: called as ops (``torch.ops.pfl.factorized_weight_backward``,
``via`` "op"), and through ``torch.autograd.grad`` (``via`` "autograd"), whose time includes
the autograd engine's (on CUDA it hands the backward to its device thread and waits), which
no op can shed.  The summary counts the two apart.

An op served by a library call rather than a Triton kernel at a shape (dense
``weighted_average``, long float32 pairwise rows and ``class_means`` with C <= D take cuBLAS,
see ``python -m pfl_kernels``) compares the public op with that bare library call
(``torch.mm``) and the Triton launches it records besides (dense ``weighted_average``'s
counting of values for its checks, the pairwise GEMM form's epilogue), and says so in its
``path``.  An op that syncs (it reads values: the weights' NaN check, a label range) pays the
device time in its host time; the row's device time shows it.

Prints a table and writes JSON to ``benchmarks/results/launch_gpu_<device>.json``.  With
``--dry-run`` (Triton interpreter, CPU tensors, tiny shapes) it checks the cases and the
replays and times a few calls with the wall clock only: its times mean nothing.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import _gpu_common as common  # noqa: E402

TARGET_US = 25.0  # public op host time − bare launch host time, per call
TRITON_MODULES = ("aggregate", "branch", "branch_aggregate", "class_means", "factorized", "similarity")
CALLS, REPEATS = 200, 15  # per timing: calls back to back, repeated (medians over repeats)
QUICK_CALLS, QUICK_REPEATS = 100, 7
DRY_CALLS, DRY_REPEATS = 2, 1


# ---------------------------------------------------------------- recording launches

@dataclass
class Launch:
    kernel: object
    grid: object
    args: tuple
    kwargs: dict
    before: dict = field(default_factory=dict)  # argument position/name -> clone before the launch
    after: dict = field(default_factory=dict)

    def tensors(self) -> dict:
        named = {i: a for i, a in enumerate(self.args)} | dict(self.kwargs)
        return {key: t for key, t in named.items() if isinstance(t, torch.Tensor)}

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


class _Recording:
    """Stands in for what ``_launch(kernel)`` returns: ``[grid](...)`` records, then launches."""

    def __init__(self, kernel, launches: list, snapshot: bool, make: bool = True):
        self.kernel, self.launches, self.snapshot, self.make = kernel, launches, snapshot, make

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            rec = Launch(self.kernel, grid, args, kwargs)
            if self.snapshot:
                rec.before = {k: t.detach().clone() for k, t in rec.tensors().items()}
            if self.make:
                self.kernel[grid](*args, **kwargs)
            if self.snapshot:
                rec.after = {k: t.detach().clone() for k, t in rec.tensors().items()}
            self.launches.append(rec)
        return launch


@contextlib.contextmanager
def recording(snapshot: bool = False, make: bool = True) -> Iterator[list]:
    """Within the block, every Triton launch of the ops is recorded (and still made, unless
    ``make`` is False); yields the list of ``Launch``es.  Patches each kernel module's
    ``_launch``, undone at exit."""
    import importlib

    launches: list = []
    modules = [importlib.import_module(f"pfl_kernels.triton.{name}") for name in TRITON_MODULES]
    saved = [(m, m._launch) for m in modules]
    try:
        for m in modules:
            m._launch = lambda kernel: _Recording(kernel, launches, snapshot, make)
        yield launches
    finally:
        for m, launch in saved:
            m._launch = launch


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN equal to NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        both_nan = torch.isnan(a) & torch.isnan(b)
        return bool(((a == b) | both_nan).all())
    return torch.equal(a, b)


def check_replay(name: str, launches: Sequence[Launch]) -> None:
    """Each bare launch, from the state before the op's launch, writes what the op's did."""
    for i, rec in enumerate(launches):
        tensors = rec.tensors()
        with torch.no_grad():
            for key, t in tensors.items():
                # only what the launch wrote: an input saved for backward keeps its version
                if not _same(rec.before[key], rec.after[key]):
                    t.copy_(rec.before[key])
        rec()
        for key, t in tensors.items():
            if not _same(t.detach(), rec.after[key]):
                kernel = getattr(rec.kernel, "__name__", rec.kernel)
                raise AssertionError(f"{name}: the bare launch {i} ({kernel}) wrote argument {key} "
                                     "differently from the op's launch")


# ---------------------------------------------------------------- cases

@dataclass
class Case:
    op: str
    shape: str
    public: Callable[[], object]  # the public op call
    expected: Callable[[], object]  # float64 result(s) of the reference, for the check
    got: Callable[[object], object] = lambda r: r  # the public call's result(s) to check
    library: Optional[Callable[[], object]] = None  # the bare library call where no Triton kernel serves
    tol: float = 1e-4
    via: str = "op"  # "op": the op called; "autograd": torch.autograd.grad (the engine's time included)
    rerun_gives_expected: bool = True  # False for an in-place op whose later calls change its result


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _factorized_inputs(dev, shape, k, grad=False):
    from pfl_kernels.ops import factorized_weight
    g = torch.Generator(device=dev).manual_seed(0)
    o, i, kh, kw = shape
    rows, cols = kh * kw, o * i
    u = torch.randn(k, rows, 1, device=dev, generator=g, requires_grad=grad)
    v = torch.randn(k, 1, cols, device=dev, generator=g, requires_grad=grad)
    mu = torch.randn(k, rows, cols, device=dev, generator=g, requires_grad=grad)
    return factorized_weight, u, v, mu


def factorized_cases(dev, shape, k) -> list[Case]:
    from pfl_kernels.reference import factorized as ref
    op, u, v, mu = _factorized_inputs(dev, shape, k)
    fwd = Case("factorized_weight", f"{'x'.join(map(str, shape))} K={k}",
               lambda: op(u, v, mu, shape=shape),
               lambda: ref.factorized_weight(u.double(), v.double(), mu.double(), shape=shape))
    op, gu, gv, gmu = _factorized_inputs(dev, shape, k, grad=True)
    w = op(gu, gv, gmu, shape=shape)
    grad = torch.randn_like(w)
    leaves = [t.detach().double().requires_grad_() for t in (gu, gv, gmu)]

    def expected_bwd():
        out = ref.factorized_weight(*leaves, shape=shape)
        return torch.autograd.grad(out, leaves, grad.double())

    bwd = Case("factorized_weight backward", fwd.shape,
               lambda: torch.autograd.grad(w, (gu, gv, gmu), grad, retain_graph=True), expected_bwd, via="autograd")
    du, dv, dmu = (t.detach() for t in (gu, gv, gmu))
    bwd_op = Case("factorized_weight_backward", fwd.shape,
                  lambda: torch.ops.pfl.factorized_weight_backward(grad, du, dv, dmu, None, shape=shape, layout="spatial",
                                                                   output_mask=[True, True, True, False]),
                  expected_bwd, got=lambda r: r[:3])
    # in place on one buffer (the first call is the checked one; later ones shrink it further)
    from pfl_kernels.ops import soft_threshold_
    buf = mu.detach().clone()
    first = buf.double()
    thr = Case("soft_threshold_", f"{k}x{mu.shape[1]}x{mu.shape[2]}", lambda: soft_threshold_(buf, 0.5),
               lambda: first.sign() * (first.abs() - 0.5).clamp_min(0), rerun_gives_expected=False)
    return [fwd, bwd_op, bwd, thr]


def branch_cases(dev, shape, k, b) -> list[Case]:
    from pfl_kernels.ops import branch_combine, project_simplex_
    from pfl_kernels.reference import branch as ref
    g = torch.Generator(device=dev).manual_seed(1)
    weights = torch.randn(k, b, *shape, device=dev, generator=g)
    alpha = torch.rand(k, b, device=dev, generator=g)
    alpha = alpha / alpha.sum(1, keepdim=True)
    name = f"K={k} B={b} {'x'.join(map(str, shape))}"
    fwd = Case("branch_combine", name, lambda: branch_combine(weights, alpha, shared_weights=False),
               lambda: ref.branch_combine(weights.double(), alpha.double()))
    gw, ga = weights.clone().requires_grad_(), alpha.clone().requires_grad_()
    out = branch_combine(gw, ga, shared_weights=False)
    grad = torch.randn_like(out)
    lw, la = weights.double().requires_grad_(), alpha.double().requires_grad_()
    expected_bwd = lambda: torch.autograd.grad(ref.branch_combine(lw, la), (lw, la), grad.double())  # noqa: E731
    bwd = Case("branch_combine backward", name,
               lambda: torch.autograd.grad(out, (gw, ga), grad, retain_graph=True), expected_bwd, via="autograd")
    bwd_op = Case("branch_combine_backward", name,
                  lambda: torch.ops.pfl.branch_combine_backward(grad, weights, alpha, [True, True]), expected_bwd)
    x = torch.randn(k, b, device=dev, generator=g)  # projected in place (the first call is checked)
    first = x.double()

    def simplex_ref():
        y = first.clone()
        ref.project_simplex_(y)
        return y

    proj = Case("project_simplex_", f"K={k} B={b}", lambda: project_simplex_(x), simplex_ref)
    return [fwd, bwd_op, bwd, proj]


def server_cases(dev, k, p, d, dry: bool) -> list[Case]:
    from pfl_kernels.ops import (branch_aggregate, class_means, pairwise_cosine, pairwise_sqdist,
                                 similarity_weights, weighted_average)
    from pfl_kernels.ops.similarity import GEMM_MIN_DIM
    from pfl_kernels.reference import aggregate as ref_agg
    from pfl_kernels.reference import branch_aggregate as ref_ba
    from pfl_kernels.reference import class_means as ref_cm
    from pfl_kernels.reference import similarity as ref_sim
    g = torch.Generator(device=dev).manual_seed(2)
    cases = []
    # weighted_average: sparse weights (density 0.05, as after similarity_weights) take the
    # Triton sparse kernel; dense ones the GEMM (cuBLAS), compared with torch.mm.
    params = torch.randn(k, p, device=dev, generator=g)
    w = torch.rand(k, k, device=dev, generator=g) * (torch.rand(k, k, device=dev, generator=g) < 0.05)
    w.fill_diagonal_(1.0)
    w = w / w.sum(1, keepdim=True)
    cases.append(Case("weighted_average", f"K={k} P={p} density~0.05", lambda: weighted_average(w, params),
                      lambda: ref_agg.weighted_average(w.double(), params.double())))
    dense = torch.softmax(torch.randn(k, k, device=dev, generator=g), 1)
    cases.append(Case("weighted_average", f"K={k} P={p} dense", lambda: weighted_average(dense, params),
                      lambda: ref_agg.weighted_average(dense.double(), params.double()),
                      library=lambda: torch.mm(dense, params)))
    # pairwise: short rows take the fused kernel, long float32 rows the GEMM form
    for dim in (d, GEMM_MIN_DIM):
        x = torch.randn(k, dim, device=dev, generator=g)
        lib = None if dim < GEMM_MIN_DIM else (lambda x=x: torch.mm(x, x.t()))
        cases.append(Case("pairwise_cosine", f"K={k} D={dim}", lambda x=x: pairwise_cosine(x),
                          lambda x=x: ref_sim.pairwise_cosine(x.double(), None, 1e-8), library=lib))
        cases.append(Case("pairwise_sqdist", f"K={k} D={dim}", lambda x=x: pairwise_sqdist(x),
                          lambda x=x: ref_sim.pairwise_sqdist(x.double(), None),
                          library=lib, tol=1e-4 * dim))  # expanded form: error relative to the norms
    sim = torch.rand(k, k, device=dev, generator=g) * 2 - 1
    cases.append(Case("similarity_weights", f"K={k}", lambda: similarity_weights(sim, tau=0.5, scale=10.0, min_keep=2),
                      lambda: ref_sim.similarity_weights(sim.double(), 0.5, 10.0, 2, None)))
    kb, b = max(k // 5, 2), 3
    bp = torch.randn(kb, b, p // 8 if not dry else p, device=dev, generator=g)
    alpha = torch.rand(kb, b, device=dev, generator=g) + 0.05
    counts = torch.randint(1, 100, (kb,), device=dev, generator=g)
    cases.append(Case("branch_aggregate", f"K={kb} B={b} P={bp.shape[2]}", lambda: branch_aggregate(bp, alpha, counts),
                      lambda: ref_ba.branch_aggregate(bp.double(), alpha.double(), counts)))
    n, c = (64, 10) if dry else (4096, 10)
    feats = torch.randn(n, 128 if not dry else 16, device=dev, generator=g)
    labels = torch.randint(0, c, (n,), device=dev, generator=g)
    # C <= D: the one-hot GEMM serves (ops.class_means.cuda_path), compared with that GEMM alone
    onehot = (labels[None, :] == torch.arange(c, device=dev)[:, None]).to(feats.dtype)
    cases.append(Case("class_means", f"N={n} D={feats.shape[1]} C={c}", lambda: class_means(feats, labels, c),
                      lambda: ref_cm.class_means(feats.double(), labels, c), got=lambda r: r[0],
                      library=lambda: torch.mm(onehot, feats)))
    return cases


def build_cases(dev: str, quick: bool, dry: bool) -> list[Case]:
    if dry:
        return [*factorized_cases(dev, (6, 3, 5, 5), 2), *branch_cases(dev, (6, 3, 5, 5), 3, 2),
                *server_cases(dev, 20, 257, 33, dry=True)]
    cases = [*factorized_cases(dev, (6, 3, 5, 5), 100), *branch_cases(dev, (16, 6, 5, 5), 20, 3),
             *server_cases(dev, 20, 65536, 4096, dry=False)]
    if not quick:
        cases += [*factorized_cases(dev, (256, 256, 3, 3), 100), *branch_cases(dev, (120, 84), 100, 3),
                  *server_cases(dev, 100, 10**6, 16384, dry=False)]
    return cases


# ---------------------------------------------------------------- timing

def per_call_us(fn: Callable[[], object], calls: int, repeats: int, cuda: bool) -> tuple[float, float]:
    """(host µs per call, device µs per call; nan without CUDA): medians over ``repeats`` runs
    of ``calls`` back-to-back calls."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    host, device = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host.append((time.perf_counter() - t0) / calls * 1e6)
        if cuda:
            end.record()
            end.synchronize()
            device.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(host), statistics.median(device) if device else float("nan")


@dataclass
class Row:
    op: str
    shape: str
    path: str  # "triton (n launches)" or the library call
    public_host_us: float
    bare_host_us: float
    public_device_us: float
    bare_device_us: float
    max_abs_err: float
    via: str = "op"
    direct_host_us: float = float("nan")  # the public op with direct launches on

    @property
    def overhead_us(self) -> float:
        return self.public_host_us - self.bare_host_us

    @property
    def within_target(self) -> bool:
        return self.overhead_us <= TARGET_US

    @property
    def direct_overhead_us(self) -> float:
        return self.direct_host_us - self.bare_host_us

    @property
    def within_target_direct(self) -> bool:
        return self.direct_overhead_us <= TARGET_US

    def to_json(self) -> dict:
        return {**asdict(self), "overhead_us": self.overhead_us, "within_target": self.within_target,
                "direct_overhead_us": self.direct_overhead_us, "within_target_direct": self.within_target_direct}


def format_table(rows: Sequence[Row]) -> str:
    head = (f"{'op':<27} {'shape':<26} {'path':<20} {'public us':>10} {'bare us':>9} {'diff us':>8} "
            f"{'dev us':>9} {'max err':>9} {'':>4} {'direct us':>9} {'diff us':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.op:<27} {r.shape:<26} {r.path:<20} {r.public_host_us:>10.1f} {r.bare_host_us:>9.1f} "
                     f"{r.overhead_us:>8.1f} {r.public_device_us:>9.1f} {r.max_abs_err:>9.2e} "
                     f"{'ok' if r.within_target else 'MISS':>4} {r.direct_host_us:>9.1f} {r.direct_overhead_us:>8.1f} "
                     f"{'ok' if r.within_target_direct else 'MISS'}")
    return "\n".join(lines)


def measure_case(case: Case, cuda: bool, calls: int, repeats: int) -> Row:
    name = f"{case.op} {case.shape}"
    with recording(snapshot=True) as launches:
        result = case.public()
    got = _as_tuple(case.got(result))
    want = _as_tuple(case.expected())
    err = max(common.check(f"{name} [{i}]", g.detach(), e.detach().double(), case.tol)
              for i, (g, e) in enumerate(zip(got, want)))
    if launches:
        check_replay(name, launches)
        # the bare launches keep the recorded arguments (and tensors) alive; drop the clones
        for rec in launches:
            rec.before, rec.after = {}, {}

    def replay() -> None:
        for rec in launches:
            rec.kernel[rec.grid](*rec.args, **rec.kwargs)
    counted = f"{len(launches)} launch{'es' if len(launches) > 1 else ''}"
    if case.library is not None:  # the library call, and the Triton launches around it (checks)
        library = case.library
        bare = (lambda: (library(), replay())) if launches else library
        path = "library (torch.mm)" + (f" + triton ({counted})" if launches else "")
    elif launches:
        bare, path = replay, f"triton ({counted})"
    else:
        raise AssertionError(f"{name}: no Triton launch recorded and no library call to compare with")
    with direct_launches(False):
        public_host, public_dev = per_call_us(case.public, calls, repeats, cuda)
    bare_host, bare_dev = per_call_us(bare, calls, repeats, cuda)
    with direct_launches(True):
        if case.rerun_gives_expected:
            case.public()  # a signature's first call goes through Triton and keeps the compiled kernel
            got = _as_tuple(case.got(case.public()))  # the second is launched directly: checked
            err = max(err, max(common.check(f"{name} (direct launches) [{i}]", g.detach(), e.detach().double(),
                                            case.tol) for i, (g, e) in enumerate(zip(got, want))))
        direct_host, _ = per_call_us(case.public, calls, repeats, cuda)
    return Row(case.op, case.shape, path, public_host, bare_host, public_dev, bare_dev, err, case.via, direct_host)


@contextlib.contextmanager
def direct_launches(on: bool) -> Iterator[None]:
    """Within the block, the ops launch their compiled kernels directly (``on``, the default:
    ``pfl_kernels.triton._direct``) or through Triton's launcher (``PFL_KERNELS_DIRECT_LAUNCH=0``)."""
    from pfl_kernels.triton import _direct
    saved = _direct.ENABLED
    _direct.ENABLED = on
    try:
        yield
    finally:
        _direct.ENABLED = saved


@contextlib.contextmanager
def _routing_on_cpu(dry: bool):
    """A dry run routes CPU tensors as CUDA ones would be (the GEMM forms included)."""
    if not dry:
        yield
        return
    from pfl_kernels.triton import aggregate as ta, class_means as tc, similarity as ts
    saved = ta._GEMM_DEVICES, ts._GEMM_DEVICES, tc._GEMM_DEVICES
    ta._GEMM_DEVICES = ts._GEMM_DEVICES = tc._GEMM_DEVICES = ("cuda", "cpu")
    try:
        yield
    finally:
        ta._GEMM_DEVICES, ts._GEMM_DEVICES, tc._GEMM_DEVICES = saved


class _Stub:
    """Stands in for what ``_launch(kernel)`` returns: ``[grid](...)`` does nothing, except for
    a kernel whose outputs the op reads on the host (data checks, counts): its ``emulate``, a
    plain-PyTorch stand-in, writes them, timed into ``emulated_s`` (the stand-in's sort and
    gathers on a CPU stand for a kernel on the device: not host work, so left out of the
    host time)."""

    emulated_s = 0.0  # seconds spent in emulations since the last reset

    def __init__(self, kernel):
        self.emulate = getattr(kernel, "emulate", None)

    def __getitem__(self, grid):
        if self.emulate is None:
            return lambda *args, **kwargs: None

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            self.emulate(*args, **kwargs)
            _Stub.emulated_s += time.perf_counter() - t0
        return timed


@contextlib.contextmanager
def stubbed_launches() -> Iterator[None]:
    """Within the block, every Triton launch of the ops is skipped (their results are garbage)."""
    import importlib

    modules = [importlib.import_module(f"pfl_kernels.triton.{name}") for name in TRITON_MODULES]
    saved = [(m, m._launch) for m in modules]
    try:
        for m in modules:
            m._launch = _Stub
        yield
    finally:
        for m, launch in saved:
            m._launch = launch


def host_us_per_call(fn: Callable[[], object], calls: int, repeats: int) -> tuple[float, float]:
    """(host µs per call less the emulations' time, the emulations' µs per call) under
    ``stubbed_launches``: medians over ``repeats`` runs of ``calls`` back-to-back calls."""
    fn()
    host, emulated = [], []
    for _ in range(repeats):
        _Stub.emulated_s = 0.0
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
        host.append((elapsed - _Stub.emulated_s) / calls * 1e6)
        emulated.append(_Stub.emulated_s / calls * 1e6)
    return statistics.median(host), statistics.median(emulated)


def host_us_both_ways(fn: Callable[[], object], calls: int, repeats: int) -> tuple[float, float, float]:
    """``host_us_per_call`` with plain eager calls past the dispatcher (``ops/_eager.py``,
    as the ops run) and through it, one repeat of each in turn, so both see the same machine:
    (host µs past it, host µs through it, emulations' µs)."""
    from pfl_kernels.ops import _eager

    enabled = _eager.ENABLED
    past, through, emulated = [], [], []
    try:
        for _ in range(repeats):
            for switch, times in ((True, past), (False, through)):
                _eager.ENABLED = switch
                host_us, emulated_us = host_us_per_call(fn, calls, 1)
                times.append(host_us)
                emulated.append(emulated_us)
    finally:
        _eager.ENABLED = enabled
    return statistics.median(past), statistics.median(through), statistics.median(emulated)


def host_main(calls: int, repeats: int, json_path: Optional[Path], dry_run: bool = False) -> int:
    """``--host``: on a CPU, each public op's host time per call at the quick shapes with its
    Triton launches skipped: the Python and dispatcher work around a launch, which a CPU
    session can shrink and check without a GPU (no interpreter: the launchers run as the CPU
    kernels, routed as on CUDA).  Ops that sync on a GPU do not here, and a GPU machine's CPU
    may be slower: compare these figures with each other, not with the GPU's."""
    import json
    import platform

    from pfl_kernels import triton as pfl_triton

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host work is one thread's; restored after (tests call this in-process)
    rows = []
    print(f"{'op':<27} {'shape':<26} {'host':>11}  {'through the dispatcher':>11}")
    try:
        with stubbed_launches(), pfl_triton.launchers_on_cpu(), _routing_on_cpu(True):
            for case in build_cases("cpu", quick=True, dry=False):
                if case.library is not None:  # its GEMM would run for real on the CPU: not host time
                    print(f"{case.op:<27} {case.shape:<26} skipped: served by a library GEMM", flush=True)
                    continue
                host_us, dispatched_us, emulated_us = host_us_both_ways(case.public, calls, repeats)
                rows.append({"op": case.op, "shape": case.shape, "host_us": host_us,
                             "through_dispatcher_us": dispatched_us, "emulated_us": emulated_us})
                emulated = f"  (+{emulated_us:.1f} us emulating a kernel whose output it reads)" if emulated_us else ""
                print(f"{case.op:<27} {case.shape:<26} {host_us:>8.1f} us  {dispatched_us:>8.1f} us{emulated}",
                      flush=True)
    finally:
        torch.set_num_threads(threads)
    # a dry run's figures (2 calls) mean nothing: never over the committed results
    path = json_path or (common.DRY_RUN_RESULTS if dry_run else common.RESULTS) / "launch_host_cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"suite": "launch_host", "machine": {
        "processor": platform.processor() or platform.machine(), "torch": torch.__version__, "threads": 1},
        "config": {"calls": calls, "repeats": repeats, "launches": "skipped (stubbed)",
                   "timing": "time.perf_counter around back-to-back calls; medians over repeats",
                   "emulated_us": "the plain-PyTorch stand-ins of kernels whose outputs the op reads "
                                  "(device work on a GPU), timed apart and left out of host_us",
                   "through_dispatcher_us": "host_us with PFL_KERNELS_DISPATCH_BYPASS=0 (every call through "
                                            "the dispatcher), repeats interleaved with host_us's"},
        "rows": rows}, indent=2))
    print(f"wrote {path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = common.parse_args(__doc__, argv, quick_help="the small shapes only, 100 calls x 7 repeats",
                             flags={"--host": "on a CPU: each op's host time with its Triton launches "
                                              "skipped (no GPU, no interpreter)"})
    if args.host:
        if args.dry_run:
            return host_main(DRY_CALLS, DRY_REPEATS, args.json, dry_run=True)
        return host_main(2000, 7, args.json)
    rt = common.start(args, "gpu_launch.py", "pfl::factorized_weight")
    if rt is None:
        return 2
    if args.dtype != "float32":
        print("gpu_launch.py measures float32 inputs only (host time does not depend on the dtype)", file=sys.stderr)
        return 2
    calls, repeats = ((DRY_CALLS, DRY_REPEATS) if args.dry_run else
                      (QUICK_CALLS, QUICK_REPEATS) if args.quick else (CALLS, REPEATS))
    rows: list[Row] = []
    with rt, _routing_on_cpu(args.dry_run):
        cases = build_cases(rt.device, args.quick, args.dry_run)
        print(format_table([]).splitlines()[0], flush=True)
        for case in cases:
            row = measure_case(case, not args.dry_run, calls, repeats)
            rows.append(row)
            print(format_table([row]).splitlines()[-1], flush=True)
            rt.empty_cache()
    missed = [f"{r.op} {r.shape}" for r in rows if not r.within_target]
    if args.dry_run:
        print("dry run: the cases and the bare replays check out; the times (interpreter, CPU) mean nothing")
    print(f"{len(rows) - len(missed)}/{len(rows)} cases within {TARGET_US:g} us of the bare launch"
          + (f"; missed: {', '.join(missed)}" if missed else ""))
    by_via = {via: {"cases": sum(r.via == via for r in rows),
                    "within_target": sum(r.via == via and r.within_target for r in rows),
                    "within_target_direct": sum(r.via == via and r.within_target_direct for r in rows)}
              for via in ("op", "autograd")}
    for via, what in (("op", "ops called"), ("autograd", "backward through torch.autograd.grad (the engine's time included)")):
        counts = by_via[via]
        print(f"{what}: {counts['within_target']}/{counts['cases']} within target, "
              f"{counts['within_target_direct']}/{counts['cases']} with direct launches")
    common.write_json(rt.json_path(args.json, "launch_gpu"), "benchmarks/gpu_launch.py", rt, {
        "config": {"quick": args.quick, "calls": calls, "repeats": repeats, "target_us": TARGET_US,
                   "timing": "host: time.perf_counter around back-to-back calls (no sync inside); "
                             "device: CUDA events around the same calls; medians over repeats",
                   "bare": "each Triton launch the op made, replayed as kernel[grid](*args, **kwargs); "
                           "where no kernel serves, the library call (torch.mm)"},
        "rows": [r.to_json() for r in rows],
        "summary": {"cases": len(rows), "within_target": len(rows) - len(missed), "missed": missed,
                    "by_via": by_via},
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
