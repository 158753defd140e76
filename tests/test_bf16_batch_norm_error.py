"""benchmarks/bf16_batch_norm_error.py runs on the CPU, and there every way of computing a
bfloat16 BatchNorm's gradients is within bfloat16's rounding of float64."""
from __future__ import annotations

import json

from benchmarks import bf16_batch_norm_error


def test_every_way_is_within_bfloat16_rounding_on_the_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bf16_batch_norm_error, "SHAPES", {"small": (3, 7, 5, 3, 4), "odd": (2, 5, 3, 7, 2)})
    out = tmp_path / "rows.json"
    assert bf16_batch_norm_error.main(["--device", "cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["way"] for r in rows} == {"unbatched", "folded", "float32"} and len(rows) == 6
    for r in rows:
        # affine gradients: float32 sums of exact products; the input gradient rounds to bfloat16
        assert r["weight"] < 1e-6 and r["bias"] < 1e-6 and 0 < r["input"] < 2 ** -7, r
    assert "float32" in capsys.readouterr().out
