"""Per-class mean embeddings (Fed-CMA's class-conditional means).

Op in the ``pfl`` namespace:

* ``class_means(features, labels, num_classes) -> (means, counts)``: features [N, D] with
  labels [N] -> means [C, D], counts [C]; or, one set per client, features [K, N, D] with
  labels [K, N] -> means [K, C, D], counts [K, C].

dtypes.  features float16/bfloat16/float32/float64; labels int64 or int32.  The means are
STATISTICS: returned in the accumulation dtype (float32 for float16/bfloat16/float32
features, float64 for float64).  counts are int64.

Semantics.  mean_c = (1/n_c) Σ_{n : label_n = c} features[n] (Fed-CMA Sec. 4, e_i^k); a
class without a sample gets mean 0 and count 0.  Labels outside [0, num_classes) raise
ValueError in every kernel (a device sync for the Triton one), never in the wrapper or the
fake kernel: the op runs on meta tensors and under torch.compile.
The CPU kernel sums each class's samples in sample order within fixed blocks of rows
(their size depends on K and N only), then the blocks' sums in block order: the result does not
depend on the thread count (no atomics).  Differentiable w.r.t. features:
grad_features[n] = grad_means[label_n] / n_{label_n} (a gather, plain PyTorch).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from ..reference import class_means as ref
from ._checks import FLOAT_DTYPES, check_is_tensor, integer
from ._eager import kernel_for
from ._library import define_op, register_autograd
from ._memo import metadata_cached

__all__ = ["class_means"]

LABEL_DTYPES = (torch.int64, torch.int32)


@metadata_cached
def _check_op_args(features, labels, num_classes):
    """Checks of the op contract that also hold under tracing; returns (means shape, counts shape)."""
    torch._check_value(features.dim() in (2, 3),
                       lambda: f"features must be [N, D] or [K, N, D], got {list(features.shape)}")
    torch._check_value(labels.dim() == features.dim() - 1 and list(labels.shape) == list(features.shape[:-1]),
                       lambda: f"labels must have shape {list(features.shape[:-1])} to match features "
                               f"{list(features.shape)}, got {list(labels.shape)}")
    torch._check_type(features.dtype in FLOAT_DTYPES,
                      lambda: f"features must be a floating tensor, got {features.dtype}")
    torch._check_type(labels.dtype in LABEL_DTYPES, lambda: f"labels must be int64 or int32, got {labels.dtype}")
    torch._check_value(labels.device == features.device,
                       lambda: f"labels must be on features' device {features.device}, got {labels.device}")
    torch._check_value(num_classes >= 1, lambda: f"num_classes must be >= 1, got {num_classes}")
    lead = list(features.shape[:-2])
    return lead + [num_classes, features.shape[-1]], lead + [num_classes]


def check_label_values(labels, num_classes) -> None:
    """The check that reads the data: ValueError naming the first label outside
    [0, num_classes) (in sample order, client by client).  Every kernel makes it (the C++ one
    while counting, the reference and Triton ones here), none of the wrappers or fake
    kernels, so the op traces on meta/fake tensors and raises the same error everywhere."""
    if not labels.numel():
        return
    bad = (labels < 0) | (labels >= num_classes)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        where = ", ".join(str(i) for i in idx)
        raise ValueError(f"labels must be in [0, num_classes={num_classes}), got labels[{where}] = {int(labels[idx])}")


def cuda_path(num_classes: int, dim: int, dtype: torch.dtype, tf32: bool) -> str:
    """Which implementation serves ``class_means`` on CUDA: 'gemm' (``gemm_class_sums``: the
    one-hot matrix [C, N] times the features, one cuBLAS GEMM per client) or 'triton' (the
    segment kernel).

    On an H200 (issue 30) the segment kernel took 2.2 ms at N = 100,000, D = 256, C = 10
    against 0.31 ms for ``index_add_``: with few classes its grid had few programs, each adding
    thousands of rows in turn.  It now splits each class's rows over many programs, untimed on
    a GPU yet (``benchmarks/gpu_branch_aggregate.py`` times it beside the GEMM), so the
    routing stays as that measurement set it.  The GEMM reads the features once, whatever C, and is
    deterministic; it serves where its one-hot matrix is no larger than the features (C <= D)
    and, in float32, where torch's matmuls may not use TF32, which would lose three decimal
    digits of the sums (``torch.backends.cuda.matmul.allow_tf32``, off by default)."""
    if num_classes > max(dim, 1) or (tf32 and dtype != torch.float64):
        return "triton"
    return "gemm"


def gemm_class_sums(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class sums [K, C, D] in the accumulation dtype of features [K, N, D] with labels
    [K, N] (int64), as ``onehot(labels)ᵀ @ features``: one batched GEMM (cuBLAS on CUDA), and
    the per-class counts [K, C] in float64 (exact), summed from the same one-hot matrix.

    A label outside [0, C) matches no class (its row adds nothing and is not counted: the
    counts then total fewer than K·N, which is how a caller sees it without reading the
    labels again).  0·NaN = NaN, so a NaN/Inf feature makes its column non-finite in every
    class's sum, not only its own: a caller must take a non-finite result as "recompute" (the
    sums are all finite exactly when the features hold no NaN/Inf and no sum overflows)."""
    acc = ref.acc_dtype(features.dtype)
    classes = torch.arange(num_classes, device=labels.device)
    onehot = (labels[:, None, :] == classes[None, :, None]).to(acc)
    return torch.bmm(onehot, features.to(acc)), onehot.sum(2, dtype=torch.float64)


_INT64_MAX = 2**63 - 1


@metadata_cached
def check_output_size(features, num_classes, memory: Optional[int] = None) -> None:
    """ValueError naming ``num_classes`` when the output cannot exist: means [K?, C, D] with
    more elements than an int64 counts, or (given ``memory``, bytes) means and counts that
    need more bytes than that.  Computed in Python integers, which never wrap.  Every layer
    checks both through ``check_output_fits`` (the C++ kernel in its own words, the same)."""
    lead = int(features.shape[0]) if features.dim() == 3 else 1
    dim = int(features.shape[-1])
    shape = [*([lead] if features.dim() == 3 else []), num_classes, dim]
    if lead * num_classes * max(dim, 1) > _INT64_MAX:
        raise ValueError(f"num_classes={num_classes} is too large: means of shape {shape} would have more than "
                         f"2**63 - 1 elements")
    need = lead * num_classes * (dim * ref.acc_dtype(features.dtype).itemsize + 8)  # means and int64 counts
    if memory is not None and need > memory:
        raise ValueError(f"num_classes={num_classes} is too large: means of shape {shape} and their counts need "
                         f"{need / 2**30:.1f} GiB, more than the {memory / 2**30:.1f} GiB of memory of "
                         f"{features.device}")


@functools.lru_cache(maxsize=None)
def device_memory(device: torch.device) -> Optional[int]:
    """The bytes of memory of ``device`` (a CPU: the machine's physical memory; a CUDA GPU:
    its total memory), None where that is unknown (other devices, meta)."""
    try:
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
    except (ValueError, OSError, AttributeError, RuntimeError):
        pass
    return None


def check_output_fits(features, num_classes) -> None:
    """``check_output_size`` against the memory of features' device: the ValueError naming
    num_classes that every layer gives (wrapper, C++ kernel, reference, fake kernel, Triton
    launcher), where before the allocator failed ("can't allocate memory ...").  Skipped for
    symbolic sizes (torch.compile's tracing): a guard on them would specialize the graph."""
    if not all(isinstance(s, int) for s in (*features.shape, num_classes)):
        return
    check_output_size(features, num_classes, device_memory(features.device))


def _reference_forward(features, labels, num_classes):
    _check_op_args(features, labels, num_classes)
    check_output_fits(features, num_classes)
    check_label_values(labels, num_classes)
    return ref.class_means(features, labels, num_classes)


CLASS_MEANS = define_op("class_means(Tensor features, Tensor labels, int num_classes) -> (Tensor, Tensor)",
                        _reference_forward)


@torch.library.register_fake(CLASS_MEANS)
def _class_means_fake(features, labels, num_classes):
    means_shape, counts_shape = _check_op_args(features, labels, num_classes)
    check_output_fits(features, num_classes)
    return (features.new_empty(means_shape, dtype=ref.acc_dtype(features.dtype)),
            features.new_empty(counts_shape, dtype=torch.int64))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    features, labels, _ = inputs
    _, counts = output
    ctx.save_for_backward(labels, counts)
    ctx.features_dtype = features.dtype


def _backward(ctx, grad_means, grad_counts):
    labels, counts = ctx.saved_tensors
    grad_features = None
    if ctx.needs_input_grad[0]:
        grad_features = ref.class_means_backward(grad_means, labels, counts, ctx.features_dtype)
    return grad_features, None, None


register_autograd(CLASS_MEANS, _backward, _setup_context)


def class_means(features: torch.Tensor, labels: torch.Tensor, num_classes: int):
    """Mean feature vector and sample count of every class.

    Fed-CMA (Sec. 4): the class-conditional mean embedding e^c = (1/n_c) Σ_{label_n = c} z_n
    that each client shares with the server; with a leading client dim, all clients' means
    in one call.

    Args:
        features: [N, D] or [K, N, D], float16/bfloat16/float32/float64.
        labels: [N] or [K, N] (features' leading dims), int64 or int32, in [0, num_classes).
        num_classes: C >= 1, with means [K?, C, D] that fit in int64 elements and in the
            device's memory.

    Returns:
        (means, counts): means [C, D] (or [K, C, D]) in float32 (float64 for float64
        features), counts [C] (or [K, C]) int64.  A class without a sample has mean 0 and
        count 0.  means is differentiable w.r.t. features.

    Raises:
        TypeError: non-tensor arguments, non-floating features, labels neither int64 nor
        int32, num_classes not an int (3.0 included).  ValueError: shapes that do not fit,
        num_classes < 1 or so large that the output would have more than 2**63 - 1 elements
        or more bytes than the device's memory (naming num_classes, also at the op level),
        devices that differ, or a label outside [0, num_classes)
        (naming the label and its index).
    """
    for name, t in (("features", features), ("labels", labels)):
        check_is_tensor(name, t)
    if features.dtype not in FLOAT_DTYPES:
        raise TypeError(f"features must be a floating tensor (float16/bfloat16/float32/float64), got {features.dtype}")
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"labels must be an int64 or int32 tensor, got {labels.dtype}")
    num_classes = integer("num_classes", num_classes)
    if num_classes < 1:
        raise ValueError(f"num_classes must be an integer >= 1, got {num_classes}")
    if features.dim() not in (2, 3):
        raise ValueError(f"features must be [N, D] or [K, N, D], got shape {list(features.shape)}")
    if tuple(labels.shape) != tuple(features.shape[:-1]):
        want = "[N]" if features.dim() == 2 else "[K, N]"
        raise ValueError(f"labels must have shape {want} = {list(features.shape[:-1])} to match features "
                         f"{list(features.shape)}, got {list(labels.shape)}")
    if labels.device != features.device:
        raise ValueError(f"labels must be on the device of features ({features.device}), got {labels.device}")
    if not torch.compiler.is_compiling():  # traced, the shapes may be symbolic
        check_output_fits(features, num_classes)
    # Labels outside [0, num_classes): checked by the op itself (every kernel), not here.
    return kernel_for("class_means", features, labels)(features, labels, num_classes)

