"""Data of the simulations: datasets as device tensors and scenarios that deal them out to
clients as per-client index tensors (with a manifest saved in each run directory)."""
from .augment import AUGMENTATIONS, make_augmentation
from .datasets import DATASETS, ArrayDataset, DatasetSpec, load_dataset
from .partition import ClientSplit, Partition
from .scenarios import SCENARIOS, ScenarioSpec, make_partition, split_sizes
from .shifts import parse_shift, shift_pixels

__all__ = [
    "AUGMENTATIONS", "make_augmentation",
    "ArrayDataset", "DatasetSpec", "DATASETS", "load_dataset",
    "ClientSplit", "Partition", "ScenarioSpec", "SCENARIOS", "make_partition", "split_sizes",
    "parse_shift", "shift_pixels",
]
