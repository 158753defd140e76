"""The simulation engine: cohorts of client banks, the flat working model and optimizers, local
plans run as client tasks by executors, the round loop, messages and their accounting, run
directories and checkpoints.  Algorithms use it only through ``pfl_algorithms.api``."""
