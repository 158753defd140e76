"""The algorithms, one module each; every module of this package is imported here, and each
``Algorithm`` subclass with a ``name`` registers itself, so adding a method is one new file."""
import importlib
import pkgutil

from ..api import ALGORITHMS, Algorithm, algorithm_class

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def make_algorithm(name: str, **settings) -> Algorithm:
    """An algorithm by its registered name, with its settings (unknown names raise ValueError)."""
    return algorithm_class(name)(**settings)


__all__ = ["ALGORITHMS", "Algorithm", "algorithm_class", "make_algorithm"]
