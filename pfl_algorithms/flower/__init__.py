"""Every registered algorithm as a Flower app (``flwr[simulation]``, the ``flower`` extra).

* :mod:`.records`  pfl Messages <-> Flower records (one ArrayRecord per parameter group or
  extra tensor, Sparse payloads as indices + values, counts in a MetricRecord, the layout in a
  ConfigRecord); the bits of a decoded message are the bits of the message that was encoded.
* :mod:`.strategy` ``PflStrategy``: a Flower ``Strategy`` that drives an algorithm's server side.
* :mod:`.client`   the ClientApp: a node runs its own client's training and evaluation tasks.
* :mod:`.app`      ``server_app`` / ``client_app``, named in ``pyproject.toml``'s
  ``[tool.flwr.app.components]`` so that ``flwr run .`` runs the configured algorithm.
* :mod:`.loopback` a Grid whose nodes are ClientApp calls in this process (tests, debugging).

Nothing here is imported by the rest of the package: flwr stays optional.
"""
from __future__ import annotations

import sys

# The releases the extra allows (pyproject.toml): the app needs 1.42's task identity and CLI.
SUPPORTED = (1, 42), (2, 0)


def require_flwr() -> None:
    """Raise ImportError (one line, naming the extra) when flwr is not installed, or is a release
    outside :data:`SUPPORTED`."""
    from importlib.metadata import PackageNotFoundError, version

    if sys.version_info < (3, 11):
        raise ImportError(f"Flower needs Python >= 3.11 (flwr>=1.42 requires it); this is Python "
                          f"{sys.version_info[0]}.{sys.version_info[1]}")
    try:
        import flwr  # noqa: F401

        installed = version("flwr")
    except (ImportError, PackageNotFoundError):
        raise ImportError("Flower is not installed: pip install -e '.[flower]' (the 'flower' extra, "
                          "flwr[simulation]>=1.42,<2)") from None
    if not SUPPORTED[0] <= tuple(int(part) for part in installed.split(".")[:2]) < SUPPORTED[1]:
        raise ImportError(f"flwr {installed} is installed; pfl's Flower app needs flwr>=1.42,<2: "
                          "pip install -e '.[flower]'")
