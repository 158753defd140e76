"""``--samples-per-client``: synthetic data is generated so that every client holds that many
samples; on real data it is a cap, and a cap above what a client holds warns."""
from __future__ import annotations

import json

import pytest

from pfl_algorithms.cli import main
from pfl_algorithms.config import RunConfig, check
from pfl_algorithms.data.scenarios import ShortShareWarning
from pfl_algorithms.runner import build


def client_sizes(partition) -> list[int]:
    return [c.all_indices().numel() for c in partition.clients]


# Each asks for more samples than the dataset's default size (synthetic-cifar 1,024,
# gaussian-mixture 1,000) holds.
@pytest.mark.parametrize("fields", [
    dict(dataset="synthetic-cifar", model="lenet5", scenario="iid", clients=5, samples_per_client=250),
    dict(dataset="synthetic-cifar", model="lenet5", scenario="permuted-iid", clients=20, samples_per_client=250),
    dict(dataset="gaussian-mixture", model="mlp", scenario="dirichlet", clients=10, samples_per_client=150,
         scenario_options={"min_samples": 5}),
])
def test_synthetic_data_gives_every_client_that_many_samples(fields, recwarn):
    _, _, partition = build(check(RunConfig(**fields)))
    assert client_sizes(partition) == [fields["samples_per_client"]] * fields["clients"]
    train = [c.train.numel() for c in partition.clients]
    assert train == [round(0.8 * fields["samples_per_client"])] * fields["clients"]
    assert not [w for w in recwarn if issubclass(w.category, ShortShareWarning)]


def test_the_sized_synthetic_data_is_the_same_for_the_same_seed():
    config = dict(dataset="synthetic-cifar", model="lenet5", scenario="iid", clients=3, samples_per_client=40)
    a, _, pa = build(check(RunConfig(**config)))
    b, _, pb = build(check(RunConfig(**config)))
    assert pa == pb and a.inputs.equal(b.inputs)


def test_an_explicit_size_is_kept_and_a_cap_above_a_share_warns():
    config = RunConfig(dataset="gaussian-mixture", model="mlp", scenario="iid", clients=4, samples_per_client=100,
                       dataset_options={"samples": 240})
    with pytest.warns(ShortShareWarning, match=r"samples_per_client=100 is more than 4 of 4 clients hold"):
        _, _, partition = build(check(config))
    assert client_sizes(partition) == [60] * 4


def test_real_data_warns_on_the_command_line(tmp_path, capsys):
    pytest.importorskip("sklearn")  # the digits ship inside scikit-learn
    out = tmp_path / "r"
    assert main(["run", "local", "--dataset", "digits", "--scenario", "iid", "--clients", "4", "--rounds", "1",
                 "--samples-per-client", "1000", "--quiet", "--out", str(out)]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if "samples_per_client" in line]
    assert warning == [warning[0]] and warning[0].startswith("pfl: warning: samples_per_client=1000 is more than "
                                                            "4 of 4 clients hold")
    sizes = [len(c["train"]) + len(c["val"]) + len(c["test"])
             for c in json.loads((out / "partition.json").read_text())["clients"]]
    assert 440 <= min(sizes) and max(sizes) < 1000
