"""benchmarks/round_traffic.py: the batched executor moves about the bytes the sequential one does.

vmap's own rules for BatchNorm and max pooling made a batched factorized ResNet-9 round move 1.66
times the sequential round's bytes (2 clients x 128 images; 2.7 times under bf16, with
MixedBatchNorm's casts) before ``engine/folded_channels.py``.  At this test's 2 x 16 the folds
give 1.07 (bf16 1.08), and without them 1.36 (1.64): a fold that stops applying shows here."""
from __future__ import annotations

import pytest

from benchmarks import round_traffic

pytestmark = pytest.mark.heavy(seconds=60)  # scheduled first under xdist (tests/conftest.py)


@pytest.mark.parametrize("autocast", [None, "bf16"])
def test_a_batched_round_moves_about_the_sequential_rounds_bytes(autocast):
    sizes = dict(factorized=True, clients=2, samples=16, batch=16, autocast=autocast)
    sequential = round_traffic.round_traffic("resnet9", executor="sequential", **sizes).total
    batched = round_traffic.round_traffic("resnet9", executor="batched", **sizes).total
    assert sequential > 0 and batched < 1.2 * sequential, (batched, sequential)


def test_the_script_prints_both_executors(capsys):
    assert round_traffic.main(["--model", "lenet5", "--clients", "2", "--samples", "8", "--batch", "4", "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("sequential") and out[3].startswith("batched") and "MB a sample" in out[0]
