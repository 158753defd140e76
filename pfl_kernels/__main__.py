"""``python -m pfl_kernels``: print which implementation of each op is active."""
from ._backends import main

main()
