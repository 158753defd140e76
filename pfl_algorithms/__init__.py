"""Simulations of personalized federated learning papers over ``pfl_kernels``.

``engine`` (client banks in cohorts, local plans, executors, rounds, messages and their
accounting, run directories and checkpoints), ``algorithms`` (one file per method, written
against the contract in ``api``), ``data`` (datasets, scenarios, augmentation), ``models``
and the ``pfl`` command (``cli``).  This package depends on ``pfl_kernels``, never the other
way round.
"""
