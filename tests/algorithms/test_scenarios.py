"""Scenarios: determinism, disjointness, coverage, label maps, skew, manifests, errors."""
import json

import pytest
import torch

from pfl_algorithms.data import SCENARIOS, ArrayDataset, Partition, load_dataset, make_partition, split_sizes


def _toy(samples=600, num_classes=10, seed=0):
    """Cheap labelled data: inputs do not matter to a partitioner."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(samples) % num_classes
    labels = labels[torch.randperm(samples, generator=gen)]
    return ArrayDataset("toy", torch.zeros(samples, 1), labels, num_classes)


DATA = _toy()
# The label-skew scenarios run on any labelled data; the domain scenarios have their own tests
# (test_scenarios_domains.py).
ALL = ["dirichlet", "iid", "pathological", "permuted-dirichlet", "permuted-iid"]


def test_registry_names():
    assert set(SCENARIOS) == {*ALL, "multi-domain", "fda", "natural"}
    for spec in SCENARIOS.values():
        assert spec.defaults["split"] == (0.8, 0.1, 0.1) and spec.defaults["samples_per_client"] is None
        assert spec.defaults["architectures"] is None


@pytest.mark.parametrize("name", ALL)
def test_deterministic_for_a_seed(name):
    a = make_partition(name, DATA, 8, seed=7)
    b = make_partition(name, DATA, 8, seed=7)
    assert a == b and a.manifest() == b.manifest()
    assert make_partition(name, DATA, 8, seed=8) != a


@pytest.mark.parametrize("name", ALL)
def test_disjoint_and_in_range(name):
    part = make_partition(name, DATA, 8, seed=1)
    everything = torch.cat([c.all_indices() for c in part.clients])
    assert everything.dtype == torch.int64
    assert everything.unique().numel() == everything.numel()  # every sample used at most once
    assert int(everything.min()) >= 0 and int(everything.max()) < len(DATA)
    for client in part.clients:
        assert client.test.numel() >= 1 and client.val.numel() >= 1 and client.train.numel() >= 1
    part.validate(DATA)


@pytest.mark.parametrize("name", ["iid", "dirichlet", "permuted-iid", "permuted-dirichlet"])
def test_full_coverage(name):
    part = make_partition(name, DATA, 8, seed=2)
    assert sorted(torch.cat([c.all_indices() for c in part.clients]).tolist()) == list(range(len(DATA)))


def test_iid_is_balanced():
    counts = make_partition("iid", DATA, 6, seed=0).label_counts(DATA, None)
    assert counts.sum().item() == len(DATA)
    assert int(counts.max() - counts.min()) <= 1  # 60 per class over 6 clients: 10 each


def test_dirichlet_skew_is_visible():
    data = _toy(4000, 10)
    def spread(alpha):
        counts = make_partition("dirichlet", data, 10, seed=0, alpha=alpha).label_counts(data, None).double()
        share = counts / counts.sum(1, keepdim=True)
        return float(share.max(1).values.mean())  # mean share of each client's largest class
    assert spread(0.1) > 0.5 > spread(100.0)
    assert spread(100.0) < 0.2  # near the IID 0.1


def test_dirichlet_min_samples():
    part = make_partition("dirichlet", DATA, 10, seed=3, alpha=0.1, min_samples=20)
    assert min(c.all_indices().numel() for c in part.clients) >= 20
    with pytest.raises(ValueError, match="lower min_samples"):
        make_partition("dirichlet", DATA, 10, seed=0, min_samples=61)  # 10 x 61 > 600
    with pytest.raises(ValueError, match="1000 draws"):
        make_partition("dirichlet", DATA, 10, seed=0, alpha=0.01, min_samples=59)


def test_pathological_classes_per_client():
    part = make_partition("pathological", DATA, 10, seed=4, classes_per_client=3)
    counts = part.label_counts(DATA, None)
    assert ((counts > 0).sum(1) == 3).all()
    assert counts.sum().item() == len(DATA)  # 30 slots over 10 classes: every class held
    few = make_partition("pathological", DATA, 2, seed=0, classes_per_client=2).label_counts(DATA, None)
    assert ((few > 0).sum(1) == 2).all() and few.sum().item() == 4 * 60


def test_pathological_cyclic_pairs_and_random_layout():
    """Cyclic, 10 clients × 2 of 10 classes: five pairs (i, i + 5) holding the same two classes
    (pFedMB's Section 5.2).  Random: each client draws its own 2 classes, so the class sets are
    not that pattern, every client still holds exactly 2 and a class's holders share it evenly."""
    paired = make_partition("pathological", DATA, 10, seed=3).label_counts(DATA, None) > 0
    assert (paired.sum(1) == 2).all()
    assert all(torch.equal(paired[i], paired[i + 5]) for i in range(5))
    assert len({tuple(row.tolist()) for row in paired}) == 5
    layouts = [make_partition("pathological", DATA, 15, seed=s, layout="random").label_counts(DATA, None)
               for s in range(3)]
    for counts in layouts:
        held = counts > 0
        assert (held.sum(1) == 2).all()
        for c in range(10):  # a class is cut evenly over its holders
            sizes = counts[held[:, c], c]
            assert sizes.numel() == 0 or int(sizes.max() - sizes.min()) <= 1
    assert len({tuple(row.tolist()) for row in layouts[0] > 0}) > 5  # not 5 repeated pairs
    with pytest.raises(ValueError, match="layout"):
        make_partition("pathological", DATA, 4, seed=0, layout="shuffled")


def test_pathological_pfedhn_layout_follows_the_codes_rule():
    """pFedHN's split (gen_classes_per_node, gen_data_split): 10 clients x 2 of 10 classes, so
    every class has 2 holders whose proportions come from U(0.4, 0.6), normalized; a client gets
    floor(n_c·α) of class c.  The counts match the assignment drawn from the same seed, and the
    scenario is deterministic and disjoint."""
    from pfl_algorithms.data.label_skew import pfedhn_classes

    part = make_partition("pathological", DATA, 10, seed=6, layout="pfedhn")
    assert part == make_partition("pathological", DATA, 10, seed=6, layout="pfedhn")
    assert part != make_partition("pathological", DATA, 10, seed=7, layout="pfedhn")
    counts = part.label_counts(DATA, None)
    classes, shares = pfedhn_classes(10, 10, 2, torch.Generator().manual_seed(6))
    want = torch.zeros_like(counts)
    for client, (held, alphas) in enumerate(zip(classes, shares)):
        for c, alpha in zip(held, alphas):
            want[client, c] += int(60 * alpha)  # 60 samples per class
    assert torch.equal(counts, want)
    holders = (counts > 0).sum(0)
    assert (holders == 2).all()  # every class has k·K/C = 2 holders
    everything = torch.cat([c.all_indices() for c in part.clients])
    assert everything.unique().numel() == everything.numel()
    # the proportions of a class's two holders sum to 1, so each lies in [0.4, 0.6]
    for c in range(10):
        alphas = [a for held, share in zip(classes, shares) for h, a in zip(held, share) if h == c]
        assert len(alphas) == 2 and sum(alphas) == pytest.approx(1.0) and all(0.4 <= a <= 0.6 for a in alphas)
    # one holder per class: it takes the whole class
    whole = make_partition("pathological", DATA, 5, seed=0, classes_per_client=2, layout="pfedhn")
    assert whole.label_counts(DATA, None).sum().item() == len(DATA)
    with pytest.raises(ValueError, match="multiple of the 10 classes"):
        make_partition("pathological", DATA, 4, seed=0, layout="pfedhn")  # 4 x 2 slots over 10 classes


@pytest.mark.parametrize("name", ["permuted-iid", "permuted-dirichlet"])
def test_label_maps_are_permutations(name):
    part = make_partition(name, DATA, 6, seed=5)
    maps = [c.label_map for c in part.clients]
    for m in maps:
        assert m.dtype == torch.int64 and sorted(m.tolist()) == list(range(10))
    assert len({tuple(m.tolist()) for m in maps}) > 1
    # Same seed: the same client samples as the unpermuted scenario; only the labels move.
    base = make_partition(name.removeprefix("permuted-"), DATA, 6, seed=5)
    for p, b in zip(part.clients, base.clients):
        assert torch.equal(p.train, b.train) and torch.equal(p.test, b.test) and b.label_map is None
    for part_name in ("train", "test"):
        seen = part.client_labels(DATA, 2, part_name)
        assert torch.equal(seen, maps[2][DATA.labels[part.clients[2].part(part_name)]])
    torch.testing.assert_close(part.label_counts(DATA, "train", mapped=True)[1][maps[1]],
                               part.label_counts(DATA, "train")[1])


def test_split_rounding():
    assert split_sizes(10, (0.8, 0.1, 0.1)) == (8, 1, 1)
    assert split_sizes(3, (0.8, 0.1, 0.1)) == (1, 1, 1)  # at least one sample in each split
    assert split_sizes(2, (0.8, 0.1, 0.1)) == (2, 0, 0)
    assert split_sizes(25, (0.8, 0.1, 0.1)) == (19, 3, 3)  # 2.5 rounds half up to 3
    assert split_sizes(15, (0.8, 0.1, 0.1)) == (11, 2, 2)  # 1.5 -> 2
    assert split_sizes(5, (1.0, 0.0, 0.0)) == (5, 0, 0)
    assert split_sizes(3, (0.05, 0.9, 0.05)) == (1, 1, 1)
    part = make_partition("iid", DATA, 4, seed=0, split=(0.5, 0.25, 0.25))
    assert [c.train.numel() for c in part.clients] == [74] * 4  # 37.5 -> 38 val and test and part.options["split"] == (0.5, 0.25, 0.25)


def test_samples_per_client_caps():
    part = make_partition("iid", DATA, 5, seed=0, samples_per_client=20)
    assert [c.all_indices().numel() for c in part.clients] == [20] * 5
    assert [(c.train.numel(), c.val.numel(), c.test.numel()) for c in part.clients] == [(16, 2, 2)] * 5


@pytest.mark.parametrize("name", ALL)
def test_manifest_round_trip(name, tmp_path):
    part = make_partition(name, DATA, 5, seed=11)
    manifest = part.manifest()
    assert json.loads(json.dumps(manifest)) == manifest
    assert manifest["seed"] == 11 and manifest["dataset"] == "toy" and manifest["num_samples"] == 600
    again = Partition.from_manifest(manifest)
    assert again == part and again.options == part.options and again.seed == 11
    for a, b in zip(again.clients, part.clients):
        assert a == b
    path = tmp_path / "partition.json"
    part.save(path)
    assert Partition.load(path) == part
    assert [p.name for p in tmp_path.iterdir()] == ["partition.json"]  # no temp file left behind


def test_real_digits_and_gaussian_mixture():
    pytest.importorskip("sklearn")
    digits = load_dataset("digits")
    part = make_partition("permuted-dirichlet", digits, 20, seed=0)
    assert part.num_clients == 20 and part.label_counts(digits, None).sum().item() == len(digits)
    toy = load_dataset("gaussian-mixture")
    assert make_partition("dirichlet", toy, 4, seed=0, alpha=0.3).num_clients == 4


def test_partitioning_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    for name in ALL:
        make_partition(name, DATA, 4, seed=0)
    assert torch.equal(torch.get_rng_state(), state)


def test_errors():
    with pytest.raises(ValueError, match=r"valid scenarios: \['dirichlet', 'fda', 'iid', 'multi-domain'"):
        make_partition("fedx", DATA, 4, seed=0)
    with pytest.raises(ValueError, match=r"valid options: \['architectures', 'samples_per_client', 'split'\]"):
        make_partition("iid", DATA, 4, seed=0, alpha=0.5)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        make_partition("dirichlet", DATA, 4, seed=0, alpha=0)
    with pytest.raises(ValueError, match="classes_per_client"):
        make_partition("pathological", DATA, 4, seed=0, classes_per_client=11)
    with pytest.raises(ValueError, match="split must be"):
        make_partition("iid", DATA, 4, seed=0, split=(0.8, 0.1))
    with pytest.raises(ValueError, match="samples_per_client"):
        make_partition("iid", DATA, 4, seed=0, samples_per_client=0)
    with pytest.raises(ValueError, match="num_clients"):
        make_partition("iid", DATA, 0, seed=0)
    with pytest.raises(ValueError, match="no samples"):
        make_partition("iid", _toy(5, 5), 6, seed=0)
    with pytest.raises(ValueError, match="format"):
        Partition.from_manifest({"format": 99})
    with pytest.raises(ValueError, match="samples"):
        make_partition("iid", DATA, 4, seed=0).validate(_toy(100))
