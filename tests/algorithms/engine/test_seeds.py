"""The seed mixing function: explicit, documented, stable across platforms and Python versions."""
from __future__ import annotations

import pytest
import torch

from pfl_algorithms.engine.seeds import mix_seed, splitmix64, stream_generator


def test_splitmix64_matches_the_reference_outputs():
    # The first outputs of SplitMix64 seeded with 0 (Vigna's reference implementation):
    # state += 0x9E3779B97F4A7C15, then the finalizer.
    state, outputs = 0, []
    for _ in range(3):
        outputs.append(splitmix64(state))
        state = (state + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_mix_seed_is_fixed_and_separates_its_parts():
    assert mix_seed(0, 2, 5, 3) == mix_seed(0, 2, 5, 3)
    seeds = {mix_seed(s, stream, r, c) for s in range(3) for stream in (1, 2, 4) for r in range(4)
             for c in (-1, 0, 1, 2)}
    assert len(seeds) == 3 * 3 * 4 * 4  # no two (seed, stream, round, client) share a stream
    assert mix_seed(1, 2) != mix_seed(2, 1)  # order matters
    assert all(0 <= s < 2 ** 63 for s in seeds)
    assert mix_seed(0, 0, 0, -1) == mix_seed(0, 0, 0, 2 ** 64 - 1)  # -1 enters as two's complement


def test_generators_of_a_stream_are_reproducible():
    a = torch.randperm(10, generator=stream_generator(7, "train", 3, 2))
    b = torch.randperm(10, generator=stream_generator(7, "train", 3, 2))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="stream"):
        stream_generator(0, "algorithm", 0)
    with pytest.raises(TypeError):
        mix_seed(0, 1.5)
