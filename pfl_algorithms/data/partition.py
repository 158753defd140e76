"""What a scenario produces: per-client train/val/test index tensors, label maps, domains and
architectures, plus the input transforms some scenarios apply (feature shifts, noise), with a
JSON manifest that records them exactly (saved in each run directory)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import Tensor

from ..atomic_io import atomic_write_json
from .datasets import ArrayDataset
from .shifts import apply_transform

MANIFEST_FORMAT = 2
PARTS = ("train", "val", "test")


@dataclass(eq=False)
class ClientSplit:
    """One client's share of the pooled dataset.

    Attributes:
        train, val, test: int64 index tensors into the pooled dataset, disjoint.
        label_map: None, or a [num_classes] int64 map: a sample whose label is ``y`` is seen
            by this client as ``label_map[y]`` (train, val and test alike).  A permutation in
            the permuted scenarios; in multi-domain scenarios that relabel each domain's
            classes it maps them to [0, output_classes) and every other class to -1 (the
            client holds no sample of those).
        domain: the client's domain id (multi-domain and fda scenarios), else None.
        architecture: the client's model name when the scenario gives clients different
            architectures (option ``architectures``), else None.
    """

    train: Tensor
    val: Tensor
    test: Tensor
    label_map: Optional[Tensor] = None
    domain: Optional[int] = None
    architecture: Optional[str] = None

    def part(self, name: str) -> Tensor:
        """The index tensor of split ``name`` ('train', 'val' or 'test')."""
        if name not in PARTS:
            raise ValueError(f"split name must be one of {PARTS}, got {name!r}")
        return getattr(self, name)

    def all_indices(self) -> Tensor:
        """train, val and test indices together."""
        return torch.cat([self.train, self.val, self.test])

    def to(self, device) -> "ClientSplit":
        """A copy with every tensor on ``device``."""
        move = lambda t: None if t is None else t.to(device)
        return ClientSplit(move(self.train), move(self.val), move(self.test), move(self.label_map),
                           self.domain, self.architecture)

    def __eq__(self, other) -> bool:
        if not isinstance(other, ClientSplit):
            return NotImplemented
        same = lambda a, b: (a is None and b is None) or (a is not None and b is not None and torch.equal(a.cpu(), b.cpu()))
        return (all(same(getattr(self, n), getattr(other, n)) for n in (*PARTS, "label_map"))
                and (self.domain, self.architecture) == (other.domain, other.architecture))


@dataclass(eq=False)
class Partition:
    """A scenario applied to a pooled dataset: one ``ClientSplit`` per client.

    Attributes:
        scenario: the scenario's registry name.  clients: one split per client.
        num_classes: classes of the dataset (the length of every label map).
        options: every scenario option, defaults filled in.
        seed: the seed it was drawn with.  dataset: the dataset's name.
        num_samples: the pooled dataset's size (checked by ``validate``).
        output_classes: the width of the clients' classifiers (labels they see are in
            [0, output_classes)); None means num_classes.
        domain_names: names of the domain ids of ``ClientSplit.domain``, if any.
        transforms: input transforms the scenario applies to some clients' samples (see
            ``apply_transforms``), as JSON-ready dicts.
        info: scenario facts worth recording (e.g. fda's target client).
    """

    scenario: str
    clients: list[ClientSplit]
    num_classes: int
    options: dict
    seed: Optional[int] = None
    dataset: Optional[str] = None
    num_samples: Optional[int] = None
    output_classes: Optional[int] = None
    domain_names: Optional[list] = None
    transforms: list = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        """The number of clients."""
        return len(self.clients)

    @property
    def classes_seen(self) -> int:
        """How many classes the clients' models output: ``output_classes`` or ``num_classes``."""
        return self.num_classes if self.output_classes is None else self.output_classes

    @property
    def architectures(self) -> Optional[list[str]]:
        """Each client's architecture, or None when they all use the run's model."""
        names = [c.architecture for c in self.clients]
        return None if all(n is None for n in names) else names

    @property
    def roles(self) -> dict[str, list[int]]:
        """The clients of each role the scenario gives (the fda scenario: one ``target``, the
        other clients ``source``); empty when every client plays the same part."""
        if "target_client" not in self.info:
            return {}
        target = int(self.info["target_client"])
        return {"source": [k for k in range(self.num_clients) if k != target], "target": [target]}

    def apply_transforms(self, dataset: ArrayDataset) -> ArrayDataset:
        """The dataset the clients see: ``dataset`` with this partition's input transforms
        (feature shifts, Gaussian noise) applied to the samples of the clients they name.
        Returns ``dataset`` itself when there are none; never modifies it in place.  The
        result depends only on the manifest (the noise seeds are recorded in it)."""
        if not self.transforms:
            return dataset
        self.validate(dataset)
        inputs = dataset.inputs.clone()
        for transform in self.transforms:
            idx = torch.cat([self.clients[c].all_indices() for c in transform["clients"]]).sort().values
            idx = idx.to(inputs.device)
            inputs[idx] = apply_transform(dataset, inputs[idx], transform)
        return replace(dataset, inputs=inputs)

    def client_labels(self, dataset: ArrayDataset, client: int, part: str = "train") -> Tensor:
        """The labels client ``client`` sees on its ``part`` split (its label map applied)."""
        split = self.clients[client]
        idx = split.part(part)
        labels = dataset.labels[idx.to(dataset.labels.device)]
        if split.label_map is not None:
            labels = split.label_map.to(labels.device)[labels]
        return labels

    def label_counts(self, dataset: ArrayDataset, part: Optional[str] = "train", *, mapped: bool = False) -> Tensor:
        """[num_clients, num_classes] int64 counts of each class in each client's ``part`` split
        (all three splits when ``part`` is None), by the dataset's labels or, with
        ``mapped=True``, by the labels the client sees ([num_clients, classes_seen] then)."""
        rows = []
        for i, split in enumerate(self.clients):
            if mapped:
                labels = (torch.cat([self.client_labels(dataset, i, p) for p in PARTS]) if part is None
                          else self.client_labels(dataset, i, part))
            else:
                idx = split.all_indices() if part is None else split.part(part)
                labels = dataset.labels[idx.to(dataset.labels.device)]
            width = self.classes_seen if mapped else self.num_classes
            rows.append(torch.bincount(labels.cpu(), minlength=width))
        return torch.stack(rows)

    def to(self, device) -> "Partition":
        """A copy whose index tensors and label maps live on ``device``."""
        return Partition(self.scenario, [c.to(device) for c in self.clients], self.num_classes, dict(self.options),
                         self.seed, self.dataset, self.num_samples, self.output_classes, self.domain_names,
                         list(self.transforms), dict(self.info))

    def validate(self, dataset: ArrayDataset) -> None:
        """Check that this partition fits ``dataset`` (same size and classes, indices in range).

        Raises:
            ValueError: saying what does not match (e.g. a manifest from another dataset).
        """
        if self.num_samples is not None and self.num_samples != len(dataset):
            raise ValueError(f"partition was made for {self.num_samples} samples, dataset has {len(dataset)}")
        if self.num_classes != dataset.num_classes:
            raise ValueError(f"partition was made for {self.num_classes} classes, dataset has {dataset.num_classes}")
        for i, split in enumerate(self.clients):
            idx = split.all_indices()
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= len(dataset)):
                raise ValueError(f"client {i} has indices outside [0, {len(dataset)})")

    def manifest(self) -> dict:
        """A JSON-serializable record of the partition: every client's index lists, label
        map, domain and architecture, the scenario, its options, the seed, the dataset's name
        and size, the classifier width, the domain names, the input transforms and the info."""
        def to_list(t):
            return None if t is None else [int(v) for v in t.cpu().tolist()]

        return {
            "format": MANIFEST_FORMAT,
            "scenario": self.scenario,
            "dataset": self.dataset,
            "num_samples": self.num_samples,
            "num_classes": int(self.num_classes),
            "seed": self.seed,
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in self.options.items()},
            "output_classes": self.output_classes,
            "domain_names": None if self.domain_names is None else list(self.domain_names),
            "transforms": [dict(t) for t in self.transforms],
            "info": dict(self.info),
            "clients": [{"train": to_list(c.train), "val": to_list(c.val), "test": to_list(c.test),
                         "label_map": to_list(c.label_map), "domain": c.domain, "architecture": c.architecture}
                        for c in self.clients],
        }

    @classmethod
    def from_manifest(cls, manifest: dict) -> "Partition":
        """The partition a ``manifest()`` describes, exactly (tensors on the CPU).

        Raises:
            ValueError: a manifest of an unknown format or with missing fields.
        """
        # Format 1 (before domains, architectures and transforms) reads as a format-2 manifest
        # without them.
        if manifest.get("format") not in (1, MANIFEST_FORMAT):
            raise ValueError(f"unknown partition manifest format {manifest.get('format')!r}; "
                             f"expected 1 or {MANIFEST_FORMAT}")
        try:
            def to_tensor(values):
                return None if values is None else torch.tensor(values, dtype=torch.int64).reshape(-1)

            clients = [ClientSplit(to_tensor(c["train"]), to_tensor(c["val"]), to_tensor(c["test"]),
                                   to_tensor(c["label_map"]), c.get("domain"), c.get("architecture"))
                       for c in manifest["clients"]]
            # JSON has no tuples: list-valued options (split, shifts) were tuples when made.
            options = {k: tuple(v) if isinstance(v, list) else v for k, v in manifest["options"].items()}
            return cls(manifest["scenario"], clients, int(manifest["num_classes"]), options,
                       manifest.get("seed"), manifest.get("dataset"), manifest.get("num_samples"),
                       manifest.get("output_classes"), manifest.get("domain_names"),
                       list(manifest.get("transforms", [])), dict(manifest.get("info", {})))
        except (KeyError, TypeError) as error:
            raise ValueError(f"malformed partition manifest: {error!r}") from error

    def save(self, path) -> None:
        """Write ``manifest()`` as JSON to ``path`` atomically (a temp file in the same
        directory, then ``os.replace``), so a killed run never leaves half a manifest."""
        atomic_write_json(path, self.manifest(), compact=True)

    @classmethod
    def load(cls, path) -> "Partition":
        """The partition saved at ``path`` by ``save``."""
        with open(path) as f:
            return cls.from_manifest(json.load(f))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        return self.manifest() == other.manifest()
