"""Every Triton kernel compiles for the GPUs the library is measured on (sm_90: H100, H200),
on a CPU without a GPU: what the interpreter tests cannot see.

The launchers run as the CPU kernels of their ops (``launchers_on_cpu``) with each launch
recorded instead of made, over the layouts, dtypes and flags the ops use; every distinct
(kernel, argument types, constexprs, warps) is then compiled to a cubin with
``triton.compile`` (source -> TTIR -> TTGIR -> LLVM IR -> PTX -> ptxas), as its first launch
on a GPU would.  CI runs this on the default torch's Triton and, in the floor phase, on
torch 2.11's Triton 3.6, the GPU image's.
"""
from __future__ import annotations

import importlib
import inspect
import math
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles kernels: not in the interpreter"),
    pytest.mark.heavy(seconds=60),
]

triton = pytest.importorskip("triton")

MODULES = ("aggregate", "branch", "branch_aggregate", "class_means", "factorized", "similarity")
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")
POINTER_TYPES = {torch.float32: "*fp32", torch.float64: "*fp64", torch.bfloat16: "*bf16", torch.float16: "*fp16",
                 torch.int64: "*i64", torch.int32: "*i32", torch.bool: "*i1", torch.uint8: "*u8"}


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


class _Recorder:
    def __init__(self, kernel, seen: dict):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
            bound = self.kernel.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            signature, constexprs = {}, {}
            for param, (name, value) in zip(self.kernel.params, bound.arguments.items()):
                if param.is_constexpr:
                    signature[name], constexprs[name] = "constexpr", value
                else:
                    signature[name] = _arg_type(value)
            key = (self.kernel.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())),
                   tuple(sorted(options.items())))
            self.seen.setdefault(key, (self.kernel, signature, constexprs, options))
            emulate = getattr(self.kernel, "emulate", None)  # outputs the op reads on the host
            if emulate is not None:
                emulate(*args, **kwargs)
        return record


def _launches() -> dict:
    """The distinct Triton launches of the ops over their layouts, dtypes and flags."""
    from pfl_kernels import ops
    from pfl_kernels import triton as pfl_triton
    from pfl_kernels.triton import aggregate as ta

    seen: dict = {}
    modules = [importlib.import_module(f"pfl_kernels.triton.{name}") for name in MODULES]
    saved = [(m, m._launch) for m in modules]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for m in modules:
            m._launch = lambda kernel: _Recorder(kernel, seen)
        g = torch.Generator().manual_seed(0)
        with pfl_triton.launchers_on_cpu():
            for dtype in (torch.float32, torch.float64, torch.bfloat16):
                def rand(*shape):
                    return torch.randn(*shape, generator=g).to(dtype)
                # factorized: every layout, with and without mask, forward and each backward mask
                for shape, layout in (((6, 3, 5, 5), "spatial"), ((6, 3, 5, 5), "simfed"), ((6, 3, 5, 5), "view"),
                                      ((7, 9), "linear")):
                    rows, cols = ((9, 7) if layout == "linear" else (15, 30) if layout == "simfed" else (25, 18))
                    u, v, mu, mask = rand(2, rows, 2), rand(2, 2, cols), rand(2, rows, cols), rand(2, rows, cols)
                    ops.factorized_weight(u, v, shape=list(shape), layout=layout)
                    w = ops.factorized_weight(u, v, mu, mask, shape=list(shape), layout=layout)
                    for output_mask in ([True] * 4, [True, False, False, True]):
                        torch.ops.pfl.factorized_weight_backward(w, u, v, mu, mask, shape=list(shape), layout=layout,
                                                                 output_mask=output_mask)
                if dtype == torch.float32:  # the backward's whole-matrix tile, 16 warps (LeNet-5's 120 x 84)
                    torch.ops.pfl.factorized_weight_backward(rand(2, 84, 120), rand(2, 120, 1), rand(2, 1, 84),
                                                             rand(2, 120, 84), None, shape=[84, 120], layout="linear",
                                                             output_mask=[True] * 4)
                with torch.no_grad():
                    x = rand(4, 6, 10)
                    ops.soft_threshold_(x, 0.1)
                    ops.soft_threshold_(x, 0.0)  # its float64 bits fit in 32: an int32 argument
                    ops.soft_threshold_(x[:, ::2, 1:], 0.1)
                    ops.project_simplex_(rand(5, 3))
                # branch: per client and shared, forward and backward
                weights, alpha = rand(3, 4, 6, 5), torch.rand(3, 4, generator=g).to(dtype)
                out = ops.branch_combine(weights, alpha)
                ops.branch_combine(rand(4, 6, 5), alpha, shared_weights=True)
                for output_mask in ([True, True], [False, True]):
                    torch.ops.pfl.branch_combine_backward(out, weights, alpha, output_mask)
                # server ops
                params = rand(8, 300)
                sparse = torch.eye(8, dtype=dtype)
                ops.weighted_average(sparse, params)  # the compaction, then the sparse kernel
                torch.backends.cuda.matmul.allow_tf32 = True  # the tl.dot kernel serves dense weights then
                ops.weighted_average(torch.softmax(torch.randn(8, 8, generator=g), 1).to(dtype), params)
                torch.backends.cuda.matmul.allow_tf32 = tf32
                # The GEMM form (dense weights on CUDA): the weights counted before it once the
                # signature took it, the product's row 0 counted where a weight is zero.
                holes = torch.softmax(torch.randn(8, 8, generator=g), 1).to(dtype)
                holes[0, 1] = 0
                route, ta._GEMM_DEVICES = ta._GEMM_DEVICES, ("cpu",)
                try:
                    for _ in range(2):
                        ops.weighted_average(holes, params)
                finally:
                    ta._GEMM_DEVICES = route
                x, y = rand(5, 70), rand(3, 70)
                for fn in (ops.pairwise_cosine, ops.pairwise_sqdist):
                    fn(x)
                    fn(x, y)
                if dtype == torch.float32:  # the GEMM form's epilogue (long float32 rows on CUDA)
                    from pfl_kernels.ops import similarity as sim_ops
                    from pfl_kernels.triton import similarity as ts
                    route = sim_ops.GEMM_MIN_DIM, ts._GEMM_DEVICES
                    sim_ops.GEMM_MIN_DIM, ts._GEMM_DEVICES = 0, ("cpu",)
                    try:
                        for fn in (ops.pairwise_cosine, ops.pairwise_sqdist):
                            fn(x)
                            fn(x, y)
                    finally:
                        sim_ops.GEMM_MIN_DIM, ts._GEMM_DEVICES = route
                ops.similarity_weights(torch.rand(6, 6, generator=g).to(dtype), tau=0.5, scale=10.0, min_keep=2)
                for out in (None, rand(3, 50)):  # .out: the aggregation guarded by the flags
                    ops.branch_aggregate(rand(4, 3, 50), torch.rand(4, 3, generator=g).to(dtype) + 0.1,
                                         torch.tensor([3, 1, 4, 2]), out=out)
                ops.class_means(rand(40, 3), torch.randint(0, 5, (40,), generator=g), 5)  # C > D: the kernel
                ops.class_means(rand(300, 3), torch.zeros(300, dtype=torch.int64), 5)  # a class in 5 chunks
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for m, launch in saved:
            m._launch = launch
    assert ta._launch.__module__ == "pfl_kernels.triton.factorized"
    return seen


@pytest.fixture(scope="module")
def launches():
    pytest.importorskip("triton.backends.nvidia")
    return _launches()


def test_every_kernel_is_launched(launches):
    kernels = {key[0] for key in launches}
    defined = set()
    for name in MODULES:
        module = importlib.import_module(f"pfl_kernels.triton.{name}")
        defined |= {n for n, obj in inspect.getmembers(module)
                    if isinstance(obj, triton.runtime.JITFunction) and obj.__module__ == module.__name__
                    and n.endswith("_kernel")}
    assert defined <= kernels, f"never launched here: {sorted(defined - kernels)}"


def test_every_launch_compiles_for_sm90(launches):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    failures = []
    for kernel, signature, constexprs, options in launches.values():
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        try:
            compiled = triton.compile(source, target=target, options=options)
            assert compiled.asm.get("cubin"), "no cubin"
        except Exception as exc:  # noqa: BLE001  (report every failing launch, not the first)
            failures.append(f"{kernel.__name__} {constexprs} {options}: {type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}")
    assert not failures, f"{len(failures)} of {len(launches)} launches do not compile:\n" + "\n".join(failures)
    assert math.isfinite(len(launches))


def test_the_backward_takes_a_small_matrix_in_one_tile(launches):
    """LeNet-5's 120 x 84 linear layer (R = 120 > _MAX_BLOCK_R): one 128 x 128 tile per client
    at 16 warps, so grad_u and grad_v need no summing pass; ResNet-9's 3x3 convs keep theirs."""
    from pfl_kernels.triton import factorized as tf

    whole = [(c, o) for (name, _, c, o) in launches
             if name == "_factorized_weight_backward_kernel" and dict(c)["BLOCK_R"] * dict(c)["BLOCK_C"] > 4096]
    assert whole and all(dict(o)["num_warps"] == 16 for _, o in whole)
    assert tf._backward_blocks(120, 84, tf._MAX_TILE, tf._MAX_BLOCK_R, tf._MAX_WHOLE_TILE) == (128, 128)
    assert tf._backward_blocks(400, 120, tf._MAX_TILE, tf._MAX_BLOCK_R, tf._MAX_WHOLE_TILE) == \
        tf._blocks(400, 120, tf._MAX_TILE, tf._MAX_BLOCK_R)
    assert tf._backward_blocks(9, 65536, tf._MAX_TILE, tf._MAX_BLOCK_R, tf._MAX_WHOLE_TILE) == (16, 256)
