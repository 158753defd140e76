"""Every test starts from the same global RNG state, so a failure reproduces exactly; files
marked ``heavy`` are collected first, longest first."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Move the tests of files marked ``heavy(seconds=...)`` to the front, longest first (a stable
    sort: every other test keeps its place).  Under ``--dist loadfile --no-loadscope-reorder``
    (scripts/test.sh) xdist hands files out in this order, so a file of a few long tests (a Flower
    deployment, torchrun jobs) starts while the short files fill the other workers, instead of
    running alone at the end: xdist's own order, most tests first, put exactly those files last."""
    def seconds(item):
        marker = item.get_closest_marker("heavy")
        return marker.kwargs.get("seconds", 0) if marker is not None else 0

    items.sort(key=lambda item: -seconds(item))
