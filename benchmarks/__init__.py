"""Benchmarks of pfl-kernels (pytest-benchmark); see ``benchmarks/report.py``.

A package so that pytest's default import mode puts the repository root on ``sys.path``
and ``pfl_kernels`` imports from this checkout even when it is not installed.
"""
