"""The algorithms, one file each, and the registry the ``pfl`` command reads."""
from .base import Algorithm
from .fedavg import FedAvg
from .fedavg_ft import FedAvgFT
from .fedper import FedPer
from .fedprox import FedProx
from .local import Local

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (Local, FedAvg, FedProx, FedPer, FedAvgFT)}


def make_algorithm(name: str, **settings) -> Algorithm:
    """An algorithm by its registered name, with its settings (unknown names raise ValueError)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(sorted(ALGORITHMS))}")
    return ALGORITHMS[name](**settings)


__all__ = ["ALGORITHMS", "Algorithm", "FedAvg", "FedAvgFT", "FedPer", "FedProx", "Local", "make_algorithm"]
