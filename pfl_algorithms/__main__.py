"""``python -m pfl_algorithms`` is the ``pfl`` command."""
import sys

from .cli import main

sys.exit(main())
