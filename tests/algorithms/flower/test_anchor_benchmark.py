"""benchmarks/flower_anchor.py --quick: both sides (pfl's Flower app and Flower's quickstart
pattern) finish a tiny job under Ray and the result file has the comparison (two Ray starts,
about 25 s on 2 cores)."""
import json

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

from benchmarks import flower_anchor  # noqa: E402

pytestmark = pytest.mark.heavy(seconds=115)  # scheduled first under xdist (tests/conftest.py)


def test_quickstart_partitions_are_pfl_partitions():
    config = flower_anchor.run_config(**flower_anchor.QUICK)
    sizes = [len(flower_anchor.load_partition(config, i)) for i in range(config.clients)]
    assert sizes == [flower_anchor.QUICK["samples"]] * config.clients


def test_quick_mode_runs_both_sides_and_saves_the_ratio(tmp_path):
    path = tmp_path / "flower_anchor_quick.json"
    assert flower_anchor.main(["--quick", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["quick"] and result["job"]["clients"] == flower_anchor.QUICK["clients"]
    for side in flower_anchor.SIDES:
        assert len(result["server_s"][side]) == 1 and 0 < result["server_s"][side][0] < result["process_s"][side][0]
    assert result["ratio_quickstart_over_ours_server"] > 0 and result["cpu"]
