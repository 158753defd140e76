"""``python -m pfl_kernels``: print which implementation of each op is active, then which
path serves which shapes on CUDA where an op has more than one (issue 30, item 2)."""
from __future__ import annotations

import torch

from ._backends import main


def format_cuda_paths() -> str:
    """The per-shape CUDA paths of ``weighted_average``, the pairwise similarity ops and
    ``class_means``, with the thresholds in force (``ops.aggregate.cuda_path``,
    ``ops.similarity.cuda_pairwise_path``, ``ops.class_means.cuda_path``)."""
    from .ops import aggregate, similarity
    from .ops.class_means import cuda_path as class_means_path

    tf32 = torch.backends.cuda.matmul.allow_tf32
    dense = aggregate.cuda_path(1, 1, 1, torch.float32, tf32)
    pair = similarity.cuda_pairwise_path(similarity.GEMM_MIN_DIM, torch.float32, tf32)
    means = class_means_path(1, 1, torch.float32, tf32)
    gemm_dim = f"D >= {similarity.GEMM_MIN_DIM}"
    rows = [
        ("weighted_average", f"nonzero weights < {aggregate.SPARSE_DENSITY:g}*K*M", "triton (sparse gather)"),
        ("weighted_average", "dense weights, float64", "gemm (cuBLAS dgemm)"),
        ("weighted_average", "dense weights, float32/bfloat16/float16",
         "gemm (torch.mm, NaN/Inf fix-up when params hold them)" if dense == "gemm"
         else "triton (3xTF32 tl.dot kernel: TF32 is allowed, which the GEMM would use)"),
        ("pairwise_cosine/sqdist", "float64", "reference (cuBLAS dgemm)"),
        ("pairwise_cosine/sqdist", f"float32, {gemm_dim}",
         "gemm (torch.mm, as torch.cdist, + one epilogue launch; no sync)" if pair == "gemm"
         else "triton (fused kernel: TF32 is allowed, which the GEMM would use)"),
        ("pairwise_cosine/sqdist", f"float32, D < {similarity.GEMM_MIN_DIM}; bfloat16, float16",
         "triton (fused kernel)"),
        ("class_means", "C <= D",
         "gemm (one-hot bmm; segment kernel when the sums are not finite)" if means == "gemm"
         else "triton (segment kernel: TF32 is allowed, which the GEMM would use)"),
        ("class_means", "C > D", "triton (segment kernel)"),
    ]
    width = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    lines = ["", "CUDA paths per shape (issue 30):", f"{'op':<{width[0]}}  {'shapes':<{width[1]}}  path"]
    lines += [f"{op:<{width[0]}}  {shapes:<{width[1]}}  {path}" for op, shapes, path in rows]
    lines += ["", f"Triton launches in eager mode: {direct_launch_state()}",
              f"Functional ops in plain eager mode: {dispatch_bypass_state()}"]
    return "\n".join(lines)


def direct_launch_state() -> str:
    """How the Triton kernels are launched in eager mode (``pfl_kernels/triton/_direct.py``)."""
    try:
        from .triton import _direct
    except ImportError as exc:  # pragma: no cover (the package always has it)
        return f"unknown ({exc})"
    if _direct.REASON is not None:
        return f"through Triton's launcher ({_direct.REASON})"
    if _direct.ENABLED:
        return "direct (the compiled kernel, bound once per signature; PFL_KERNELS_DIRECT_LAUNCH=0: off)"
    return "through Triton's launcher (PFL_KERNELS_DIRECT_LAUNCH=0; unset it to launch directly)"


def dispatch_bypass_state() -> str:
    """Whether a plain eager call reaches its CUDA launcher past the dispatcher (``ops/_eager.py``)."""
    from .ops import _eager

    if _eager.ENABLED:
        return "the CUDA launcher called directly where nothing needs the dispatcher (PFL_KERNELS_DISPATCH_BYPASS=0: off)"
    return "through the dispatcher (PFL_KERNELS_DISPATCH_BYPASS=0)"


if __name__ == "__main__":
    main()
    print(format_cuda_paths())
