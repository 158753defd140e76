"""benchmarks/checkpoint_write.py runs, and its three ways of writing give one payload."""
from __future__ import annotations

from benchmarks import checkpoint_write


def test_the_checkpoint_benchmark_writes_one_payload_three_ways(tmp_path, capsys):
    assert checkpoint_write.main(["--clients", "2", "--repeats", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint of 2 clients" in out and all(way in out for way in ("in-memory", "streamed", "background"))
    assert not list(tmp_path.iterdir())  # its scratch folder is gone
