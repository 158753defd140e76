"""The domain scenarios: multi-domain (feature shifts, superclasses, a dataset's domains), fda,
natural (writers), per-client architectures; determinism, disjointness, label maps, domain
assignment, the target's noise and kept fraction, manifests that reproduce the split."""
import math

import pytest
import torch
from torch.nn import functional as F

from pfl_algorithms.data import ArrayDataset, Partition, make_partition, split_sizes
from pfl_algorithms.data.datasets import normalize_images
from pfl_algorithms.data.multi_domain import SUPERCLASS_GROUPS


def _images(labels, *, channels=1, size=6, seed=0, **fields):
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.rand(labels.numel(), channels, size, size, generator=gen) * 0.8 + 0.1
    inputs, mean, std = normalize_images(pixels)
    return ArrayDataset("toy-images", inputs, labels, int(labels.max()) + 1, mean=mean, std=std, **fields)


def _shuffled_labels(per_class, classes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(per_class * classes) % classes
    return labels[torch.randperm(labels.numel(), generator=gen)]


DIGITS_LIKE = _images(_shuffled_labels(30, 10), size=7)
CIFAR100_LIKE = _images(_shuffled_labels(6, 100, seed=1), channels=3, size=2)
CIFAR100_LIKE.coarse_labels = CIFAR100_LIKE.labels // 5  # a stand-in for CIFAR-100's coarse map


def _domains_dataset(shared_classes=True):
    labels = _shuffled_labels(20, 4, seed=2)
    domains = torch.arange(labels.numel()) % 3
    if not shared_classes:
        labels = labels + 4 * domains  # domain d holds classes 4d..4d+3
    return _images(labels, channels=3, size=4, domains=domains, domain_names=("art", "photo", "sketch"))


def _everything(part):
    return torch.cat([c.all_indices() for c in part.clients])


def _assert_disjoint(part, dataset):
    idx = _everything(part)
    assert idx.unique().numel() == idx.numel()
    part.validate(dataset)


# ------------------------------------------------------------------ multi-domain: feature shifts

def test_feature_shift_domains_and_determinism():
    part = make_partition("multi-domain", DIGITS_LIKE, 10, seed=3, domains="feature-shift")
    assert part == make_partition("multi-domain", DIGITS_LIKE, 10, seed=3, domains="feature-shift")
    assert part != make_partition("multi-domain", DIGITS_LIKE, 10, seed=4, domains="feature-shift")
    _assert_disjoint(part, DIGITS_LIKE)
    assert sorted(_everything(part).tolist()) == list(range(len(DIGITS_LIKE)))
    assert part.domain_names == ["identity", "rotate-90", "invert", "blur-0.6", "noise-0.3"]
    assert [c.domain for c in part.clients] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # contiguous blocks
    assert all(c.label_map is None for c in part.clients) and part.output_classes is None  # classes shared
    # Each domain holds every class evenly: 30 per class over 5 domains.
    per_domain = torch.stack([part.label_counts(DIGITS_LIKE, None)[2 * d:2 * d + 2].sum(0) for d in range(5)])
    assert per_domain.tolist() == [[6] * 10] * 5
    assert [t["shift"] for t in part.transforms] == ["rotate-90", "invert", "blur-0.6", "noise-0.3"]
    assert [t["clients"] for t in part.transforms] == [[2, 3], [4, 5], [6, 7], [8, 9]]


def _blur_reference(pixels, sigma):
    radius = max(1, math.ceil(3 * sigma))
    k = torch.exp(-0.5 * (torch.arange(-radius, radius + 1, dtype=torch.float64) / sigma) ** 2)
    k = k / k.sum()
    x = pixels.double()
    h, w = x.shape[-2:]
    out = torch.zeros_like(x)
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            rows = (torch.arange(h) + dy).clamp(0, h - 1)
            cols = (torch.arange(w) + dx).clamp(0, w - 1)
            out += k[dy + radius] * k[dx + radius] * x[..., rows, :][..., :, cols]
    return out


def test_feature_shifts_applied_exactly():
    shifts = ("identity", "rotate-90", "invert", "blur-0.8", "noise-0.25", "rotate-180")
    part = make_partition("multi-domain", DIGITS_LIKE, 6, seed=0, domains="feature-shift", shifts=shifts,
                          samples_per_client=20)
    before = DIGITS_LIKE.inputs.clone()
    shifted = part.apply_transforms(DIGITS_LIKE)
    assert torch.equal(DIGITS_LIKE.inputs, before)  # never in place
    pixels, out = DIGITS_LIKE.to_pixels(DIGITS_LIKE.inputs), DIGITS_LIKE.to_pixels(shifted.inputs)
    used = torch.zeros(len(DIGITS_LIKE), dtype=torch.bool)
    for client, split in enumerate(part.clients):
        idx = split.all_indices().sort().values
        used[idx] = True
        got, orig = out[idx].double(), pixels[idx].double()
        kind = shifts[split.domain]
        if kind == "identity":
            expected = orig
        elif kind == "rotate-90":
            expected = torch.rot90(orig, 1, dims=(-2, -1))
        elif kind == "rotate-180":
            expected = orig.flip(-1).flip(-2)
        elif kind == "invert":
            expected = 1 - orig
        elif kind == "blur-0.8":
            expected = _blur_reference(orig, 0.8)
        else:  # the noise of the transform's recorded seed, drawn over the domain's sorted samples
            transform = next(t for t in part.transforms if t["shift"] == kind)
            domain_idx = torch.cat([part.clients[c].all_indices() for c in transform["clients"]]).sort().values
            noise = torch.randn(len(domain_idx), *pixels.shape[1:],
                                generator=torch.Generator().manual_seed(transform["seed"]))
            expected = orig + 0.25 * noise[torch.searchsorted(domain_idx, idx)].double()
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=0, msg=f"client {client} ({kind})")
    assert torch.equal(shifted.inputs[~used], DIGITS_LIKE.inputs[~used])  # samples nobody holds: untouched


def test_feature_shift_manifest_reproduces_inputs(tmp_path):
    part = make_partition("multi-domain", DIGITS_LIKE, 5, seed=9, domains="feature-shift")
    part.save(tmp_path / "partition.json")
    again = Partition.load(tmp_path / "partition.json")
    assert again == part and again.transforms == part.transforms and again.domain_names == part.domain_names
    assert torch.equal(again.apply_transforms(DIGITS_LIKE).inputs, part.apply_transforms(DIGITS_LIKE).inputs)


def test_rotation_by_other_angles_and_errors():
    from pfl_algorithms.data import parse_shift, shift_pixels

    x = torch.rand(2, 1, 5, 5)
    torch.testing.assert_close(shift_pixels(x, "rotate-360"), x)
    assert shift_pixels(x, "rotate-30").shape == x.shape
    with pytest.raises(ValueError, match="square"):
        shift_pixels(torch.rand(1, 1, 4, 5), "rotate-90")
    for bad in ("spin-3", "blur-0", "noise--1", "rotate-x", "invert-2", 3):
        with pytest.raises(ValueError, match="shift|sigma|angle"):
            parse_shift(bad)
    with pytest.raises(ValueError, match="unknown shift"):
        make_partition("multi-domain", DIGITS_LIKE, 5, seed=0, domains="feature-shift", shifts=("identity", "warp"))


# ------------------------------------------------------------------ multi-domain: superclasses

def test_superclass_domains():
    part = make_partition("multi-domain", CIFAR100_LIKE, 20, seed=0, domains="superclass")
    _assert_disjoint(part, CIFAR100_LIKE)
    assert part.output_classes == 5 and part.classes_seen == 5
    for client, split in enumerate(part.clients):
        assert split.domain == client
        coarse = CIFAR100_LIKE.coarse_labels[split.all_indices()]
        assert coarse.unique().tolist() == [client]  # one superclass per client (SimFed)
        expected = torch.full((100,), -1)
        expected[5 * client:5 * client + 5] = torch.arange(5)  # its classes in id order -> 0..4
        assert torch.equal(split.label_map, expected)
    counts = part.label_counts(CIFAR100_LIKE, None, mapped=True)
    assert counts.shape == (20, 5) and counts.sum().item() == len(CIFAR100_LIKE)
    two_each = make_partition("multi-domain", CIFAR100_LIKE, 40, seed=0, domains="superclass")
    assert [c.domain for c in two_each.clients] == [d for d in range(20) for _ in range(2)]
    _assert_disjoint(two_each, CIFAR100_LIKE)


def test_superclass_groups_with_permuted_labels():
    part = make_partition("multi-domain", CIFAR100_LIKE, 20, seed=5, domains="superclass-groups",
                          permute_labels=True)
    assert part.domain_names == list(SUPERCLASS_GROUPS) and part.output_classes == 10
    assert [c.domain for c in part.clients] == [d for d in range(5) for _ in range(4)]
    used_coarse = {c for pair in SUPERCLASS_GROUPS.values() for c in pair}
    maps = []
    for split in part.clients:
        pair = list(SUPERCLASS_GROUPS.values())[split.domain]
        classes = torch.cat([torch.arange(5 * c, 5 * c + 5) for c in sorted(pair)])
        assert set(CIFAR100_LIKE.coarse_labels[split.all_indices()].tolist()) == set(pair)
        assert sorted(split.label_map[classes].tolist()) == list(range(10))  # a permutation of 0..9
        assert (split.label_map >= 0).sum() == 10
        maps.append(split.label_map)
    assert not all(torch.equal(maps[0], m) for m in maps[1:4])  # permuted per client
    held = CIFAR100_LIKE.coarse_labels[_everything(part)].unique().tolist()
    assert set(held) == used_coarse  # the other 10 superclasses are not used


def test_dataset_domains_relabel_rule():
    shared = _domains_dataset(shared_classes=True)
    part = make_partition("multi-domain", shared, 6, seed=0)
    assert [c.domain for c in part.clients] == [0, 0, 1, 1, 2, 2] and part.domain_names == ["art", "photo", "sketch"]
    assert all(c.label_map is None for c in part.clients) and part.info["relabel"] is False
    for split in part.clients:
        assert shared.domains[split.all_indices()].unique().tolist() == [split.domain]
    disjoint = _domains_dataset(shared_classes=False)
    part = make_partition("multi-domain", disjoint, 4, seed=0)  # 2, 1, 1 clients per domain
    assert [c.domain for c in part.clients] == [0, 0, 1, 2] and part.output_classes == 4
    for split in part.clients:
        assert sorted(part.client_labels(disjoint, part.clients.index(split), "train").unique().tolist()) == [0, 1, 2, 3]
    forced = make_partition("multi-domain", shared, 3, seed=0, relabel=True, alpha=1.0)
    assert forced.output_classes == 4 and all(torch.equal(c.label_map, torch.arange(4)) for c in forced.clients)


def test_multi_domain_errors():
    with pytest.raises(ValueError, match="needs a dataset with domains"):
        make_partition("multi-domain", DIGITS_LIKE, 4, seed=0)
    with pytest.raises(ValueError, match="superclass labels"):
        make_partition("multi-domain", DIGITS_LIKE, 4, seed=0, domains="superclass")
    with pytest.raises(ValueError, match="at least as many clients"):
        make_partition("multi-domain", CIFAR100_LIKE, 19, seed=0, domains="superclass")
    with pytest.raises(ValueError, match="domains must be one of"):
        make_partition("multi-domain", DIGITS_LIKE, 4, seed=0, domains="styles")
    with pytest.raises(ValueError, match="alpha"):
        make_partition("multi-domain", DIGITS_LIKE, 5, seed=0, domains="feature-shift", alpha=0)


# ------------------------------------------------------------------ fda

def _with_test_set(dataset, test_fraction=1 / 6):
    n = len(dataset)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[n - round(n * test_fraction):] = True
    dataset.test_mask = mask
    return dataset


def test_fda_synthetic_target_from_the_official_test_set():
    data = _with_test_set(_images(_shuffled_labels(36, 10, seed=4), channels=3, size=4))
    part = make_partition("fda", data, 6, seed=1, noise=0.6, target_fraction=0.25, min_samples=5)
    assert part == make_partition("fda", data, 6, seed=1, noise=0.6, target_fraction=0.25, min_samples=5)
    _assert_disjoint(part, data)
    target = part.clients[-1]
    assert part.info == {"target_client": 5, "source_clients": [0, 1, 2, 3, 4]}
    test_set = torch.nonzero(data.test_mask).flatten()
    kept_train, _, n_test = split_sizes(test_set.numel(), (0.2, 0.0, 0.8))
    assert target.test.numel() == n_test and target.val.numel() == 0
    assert target.train.numel() == math.floor(0.25 * kept_train + 0.5)  # the kept fraction, rounded half up
    # The target's pool is the test set; the train split's left-out samples belong to nobody.
    assert set(target.all_indices().tolist()) <= set(test_set.tolist())
    assert test_set.numel() - target.all_indices().numel() == kept_train - target.train.numel()
    sources = torch.cat([c.all_indices() for c in part.clients[:-1]])
    assert sorted(sources.tolist()) == torch.nonzero(~data.test_mask).flatten().tolist()
    # Noise exactly sigma * N(0, 1) from the recorded seed, over the target's sorted samples.
    (transform,) = part.transforms
    assert transform["shift"] == "noise-0.6" and transform["clients"] == [5]
    idx = target.all_indices().sort().values
    noisy = part.apply_transforms(data)
    delta = data.to_pixels(noisy.inputs[idx]) - data.to_pixels(data.inputs[idx])
    noise = torch.randn(idx.numel(), 3, 4, 4, generator=torch.Generator().manual_seed(transform["seed"]))
    torch.testing.assert_close(delta, 0.6 * noise, atol=2e-6, rtol=0)
    others = torch.ones(len(data), dtype=torch.bool)
    others[idx] = False
    assert torch.equal(noisy.inputs[others], data.inputs[others])


def test_fda_without_a_test_set_and_without_noise():
    part = make_partition("fda", DIGITS_LIKE, 4, seed=0, min_samples=5)
    assert part.transforms == [] and part.apply_transforms(DIGITS_LIKE) is DIGITS_LIKE
    target = part.clients[-1]
    n_train, _, n_test = split_sizes(round(len(DIGITS_LIKE) / 6), (0.2, 0.0, 0.8))
    assert (target.train.numel(), target.test.numel()) == (n_train, n_test)
    assert sorted(_everything(part).tolist()) == list(range(len(DIGITS_LIKE)))
    share = make_partition("fda", DIGITS_LIKE, 4, seed=0, min_samples=5, target_share=0.5)
    assert share.clients[-1].all_indices().numel() == 150


def test_fda_real_shift():
    data = _domains_dataset()
    part = make_partition("fda", data, 3, seed=0, target_domain="sketch", target_split=(0.5, 0.0, 0.5))
    assert [c.domain for c in part.clients] == [0, 1, 2] and part.domain_names == ["art", "photo", "sketch"]
    assert sorted(part.clients[-1].all_indices().tolist()) == torch.nonzero(data.domains == 2).flatten().tolist()
    for split in part.clients[:-1]:
        assert data.domains[split.all_indices()].unique().tolist() == [split.domain]
    by_id = make_partition("fda", data, 5, seed=0, target_domain=0)
    assert [c.domain for c in by_id.clients] == [1, 1, 2, 2, 0]
    with pytest.raises(ValueError, match="target_domain must be one of"):
        make_partition("fda", data, 3, seed=0, target_domain="cartoon")
    with pytest.raises(ValueError, match="num_clients >= 3"):
        make_partition("fda", data, 2, seed=0, target_domain="art")
    with pytest.raises(ValueError, match="needs a dataset with domains"):
        make_partition("fda", DIGITS_LIKE, 3, seed=0, target_domain="art")


def test_fda_errors():
    for options, message in (({"noise": -1}, "noise"), ({"target_fraction": 0}, "target_fraction"),
                             ({"target_fraction": 1.5}, "target_fraction"), ({"target_share": 1}, "target_share"),
                             ({"target_split": (0.5, 0.6, 0.1)}, "split must be")):
        with pytest.raises(ValueError, match=message):
            make_partition("fda", DIGITS_LIKE, 4, seed=0, min_samples=5, **options)
    with pytest.raises(ValueError, match="at least 2 clients"):
        make_partition("fda", DIGITS_LIKE, 1, seed=0)


@pytest.mark.parametrize("name,options,idle", [
    ("fda", {"target_domain": "sketch", "alpha": 0.05}, "alpha"),
    ("fda", {"target_domain": 0, "min_samples": 1}, "min_samples"),
    ("fda", {"target_domain": "art", "target_share": 0.5}, "target_share"),
    ("multi-domain", {"domains": "dataset", "shifts": ("invert",)}, "shifts"),
    ("multi-domain", {"domains": "dataset", "min_samples": 3}, "min_samples"),
])
def test_an_option_with_no_effect_at_these_settings_is_refused(name, options, idle):
    """Such an option was accepted and recorded in partition.json, though the partition was
    the same whatever its value; the same options with the setting they need still work."""
    data = _domains_dataset()
    with pytest.raises(ValueError, match=rf"^scenario '{name}': {idle} has no effect with"):
        make_partition(name, data, 3, seed=0, **options)
    if name == "multi-domain":
        needs = {"shifts": {"domains": "feature-shift"}, "min_samples": {"alpha": 1.0}}[idle]
        assert make_partition(name, data, 5, seed=0, **{**options, **needs}).options[idle] == options[idle]
    else:
        alone = {k: v for k, v in options.items() if k != "target_domain"}
        assert make_partition(name, data, 3, seed=0, **alone).options[idle] == options[idle]


# ------------------------------------------------------------------ natural (writers)

def _writers_dataset():
    gen = torch.Generator().manual_seed(6)
    sizes = [3, 12, 15, 20, 9, 30, 11]  # samples per writer
    writers = torch.cat([torch.full((s,), w) for w, s in enumerate(sizes)])
    labels = torch.randint(0, 5, (writers.numel(),), generator=gen)
    test_mask = torch.rand(writers.numel(), generator=gen) < 0.25
    names = tuple(f"f{w:04d}_{w}" for w in range(len(sizes)))
    return _images(labels, writers=writers, writer_names=names, test_mask=test_mask)


def test_natural_one_writer_per_client():
    data = _writers_dataset()
    part = make_partition("natural", data, 4, seed=2)
    assert part == make_partition("natural", data, 4, seed=2)
    _assert_disjoint(part, data)
    writers = [data.writers[c.all_indices()].unique().tolist() for c in part.clients]
    assert all(len(w) == 1 for w in writers)
    ids = [w[0] for w in writers]
    assert ids == sorted(ids) and set(ids) <= {1, 2, 3, 5, 6}  # writer 0 (3) and 4 (9) have < 10 samples
    assert part.info["writers"] == [data.writer_names[w] for w in ids]
    for split, writer in zip(part.clients, ids):
        mine = torch.nonzero(data.writers == writer).flatten()
        assert sorted(split.test.tolist()) == mine[data.test_mask[mine]].tolist()  # the official test samples
        rest = mine[~data.test_mask[mine]].numel()
        assert (split.train.numel(), split.val.numel()) == split_sizes(rest, (8 / 9, 1 / 9, 0.0))[:2]
    plain = make_partition("natural", data, 5, seed=2, min_samples=10, official_split=False)
    assert all(c.test.numel() == split_sizes(c.all_indices().numel(), (0.8, 0.1, 0.1))[2] for c in plain.clients)
    with pytest.raises(ValueError, match="only 5 writers"):
        make_partition("natural", data, 6, seed=0)
    with pytest.raises(ValueError, match="needs a dataset with writers"):
        make_partition("natural", DIGITS_LIKE, 2, seed=0)


# ------------------------------------------------------------------ per-client architectures

def test_architectures_are_dealt_round_robin_and_recorded():
    part = make_partition("dirichlet", DIGITS_LIKE, 5, seed=0, min_samples=5,
                          architectures=["digits-cnn", "mlp(hidden=(64,))"])
    assert part.architectures == ["digits-cnn", "mlp(hidden=(64,))"] * 2 + ["digits-cnn"]
    again = Partition.from_manifest(part.manifest())
    assert again == part and again.architectures == part.architectures
    assert make_partition("iid", DIGITS_LIKE, 3, seed=0).architectures is None
    with pytest.raises(ValueError, match="architectures must be"):
        make_partition("iid", DIGITS_LIKE, 3, seed=0, architectures=[])


def test_build_client_models_checks_the_embedding_size():
    from pfl_algorithms.models import build_client_models, parse_architecture

    models = build_client_models(["digits-cnn", "mlp(hidden=(32, 64))", "digits-cnn"], input_shape=(1, 8, 8),
                                 num_classes=10)
    assert list(models) == ["digits-cnn", "mlp(hidden=(32, 64))"]
    assert {m.embedding_dim for m in models.values()} == {64}
    x = torch.randn(3, 1, 8, 8)
    assert all(m(x).shape == (3, 10) for m in models.values())
    same = build_client_models(["digits-cnn", "fedgen-cnn"], input_shape=(1, 8, 8), num_classes=10,
                               options={"embedding_dim": 16})
    assert {m.embedding_dim for m in same.values()} == {16}
    with pytest.raises(ValueError, match="same embedding size"):
        build_client_models(["digits-cnn", "mlp"], input_shape=(1, 8, 8), num_classes=10)
    assert parse_architecture("mlp( hidden=(3,), activation=None )") == ("mlp", {"hidden": (3,), "activation": None})
    for bad in ("resnet10", "mlp(3)", "mlp(hidden=x)", ""):
        with pytest.raises(ValueError, match="architectures entry|an architectures entry"):
            parse_architecture(bad)


def test_scenarios_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    make_partition("multi-domain", DIGITS_LIKE, 5, seed=0, domains="feature-shift").apply_transforms(DIGITS_LIKE)
    make_partition("fda", DIGITS_LIKE, 4, seed=0, noise=0.3, min_samples=5).apply_transforms(DIGITS_LIKE)
    make_partition("natural", _writers_dataset(), 3, seed=0)
    assert torch.equal(torch.get_rng_state(), state)


def test_old_manifests_still_load():
    part = make_partition("iid", DIGITS_LIKE, 3, seed=0)
    manifest = part.manifest()
    old = {k: v for k, v in manifest.items() if k not in ("output_classes", "domain_names", "transforms", "info")}
    old["format"] = 1
    old["clients"] = [{k: c[k] for k in ("train", "val", "test", "label_map")} for c in manifest["clients"]]
    old["options"] = {k: v for k, v in manifest["options"].items() if k != "architectures"}
    assert Partition.from_manifest(old).clients == part.clients
