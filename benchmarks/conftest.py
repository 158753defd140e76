"""Shared pytest hooks of the benchmark suites (``bench_factorized.py``, ``bench_branch.py``).

Conventions every suite follows, which these hooks and ``benchmarks/report.py`` rely on:
each test is parametrized with ``repeat`` (0, 1, ...: the same measurement taken again,
later in the run) and labels its benchmark's ``extra_info`` with ``case``, ``shape``,
``side`` and ``impl`` (plus ``branches`` where the suite varies B).

* Records, in pytest-benchmark's JSON, what the measuring process ran on;
  ``benchmarks/report.py`` reads it back from there, so the backends it prints are those
  active while the numbers were taken (not those of the report's own process).
* With ``--benchmark-disable`` (a smoke run: each function called once, nothing timed)
  only the first repeat of each group runs: the others would call the same code again.
  This holds for any set of suites run together, e.g.
  ``pytest benchmarks/bench_factorized.py benchmarks/bench_branch.py --benchmark-disable``.
"""
from __future__ import annotations

import os

import torch

import pfl_kernels


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["pfl"] = {
        "backend_info": pfl_kernels.backend_info(),
        "torch_version": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        # The vector ISA torch's kernels dispatch to (AVX2, AVX512, ...): machines that report
        # the same CPU name can differ here, and the round ratios with them.
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "quick": os.environ.get("PFL_BENCH_QUICK", "") not in ("", "0"),
    }


def pytest_collection_modifyitems(config, items):
    if not config.getoption("benchmark_disable") or config.getoption("benchmark_enable"):
        return
    kept, extra = [], []
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        (extra if params.get("repeat", 0) > 0 else kept).append(item)
    if extra:
        config.hook.pytest_deselected(items=extra)
        items[:] = kept
