"""Plain-PyTorch definition of per-class mean embeddings (Fed-CMA), any device, any float dtype.

``features`` [N, D] with ``labels`` [N] (or [K, N, D] with [K, N]: one set per client) give

    e^c = (1 / n_c) Σ_{n : label_n = c} features[n],   n_c = #{n : label_n = c}

(Fed-CMA's class-conditional mean embedding e_i^k, Sec. 4).  Classes without a sample get
mean 0 and count 0.  Means are statistics: returned in the accumulation dtype (float32 for
bfloat16/float16/float32 features, float64 for float64).
"""
from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 features, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def class_means(features: torch.Tensor, labels: torch.Tensor, num_classes: int):
    """(means [K?, C, D] in the accumulation dtype, counts [K?, C] int64).

    index_add_ sums in sample order on CPU (on CUDA it uses atomics: not bit-reproducible).
    """
    acc = acc_dtype(features.dtype)
    batched = features.dim() == 3
    f = features if batched else features.unsqueeze(0)
    lab = (labels if batched else labels.unsqueeze(0)).to(torch.int64)
    k, n, d = f.shape
    # One flat index space of K·C classes: client k's class c is row k·C + c.
    keys = (lab + torch.arange(k, device=lab.device)[:, None] * num_classes).reshape(-1)
    sums = torch.zeros(k * num_classes, d, dtype=acc, device=f.device)
    sums.index_add_(0, keys, f.reshape(k * n, d).to(acc))
    counts = torch.bincount(keys, minlength=k * num_classes)[: k * num_classes].to(torch.int64)
    means = sums / counts.clamp_min(1)[:, None].to(acc)
    means = means.reshape(k, num_classes, d)
    counts = counts.reshape(k, num_classes)
    return (means, counts) if batched else (means[0], counts[0])


def class_means_backward(grad_means: torch.Tensor, labels: torch.Tensor, counts: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """grad_features [K?, N, D] in ``dtype``: grad_features[n] = grad_means[label_n] / n_{label_n}."""
    scaled = grad_means / counts.clamp_min(1)[..., None].to(grad_means.dtype)
    if labels.dim() == 1:
        return scaled.index_select(0, labels.to(torch.int64)).to(dtype)
    idx = labels.to(torch.int64)[..., None].expand(*labels.shape, grad_means.shape[-1])
    return torch.gather(scaled, 1, idx).to(dtype)
