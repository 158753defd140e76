"""Simulations of personalized federated learning papers over ``pfl_kernels``.

The engine, datasets, scenarios and algorithms arrive in later issues; this package
depends on ``pfl_kernels`` and never the other way round.
"""
