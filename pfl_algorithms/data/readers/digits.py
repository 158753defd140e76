"""scikit-learn's 8x8 digits (1,797 images, 10 classes), read from the file scikit-learn ships.

``sklearn.datasets.load_digits`` reads ``sklearn/datasets/data/digits.csv.gz`` with
``numpy.loadtxt``; this reader reads the same file the same way without importing scikit-learn,
whose import (scipy and its own modules) took 2.9 s of a fresh process's 8.4 s for a 4-round
``pfl run`` on digits (2 cores), more than importing torch. Every process that loads digits pays
it: each resumed run, torchrun worker and Flower ClientApp. Where the file is not at that place
(another scikit-learn layout), ``load_digits`` itself is called.
"""
from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .common import RawData

# Where the file lies inside the scikit-learn package (sklearn 0.2x to 1.x).
_CSV = Path("datasets") / "data" / "digits.csv.gz"


def _sklearn_csv() -> Optional[Path]:
    """The digits CSV inside the installed scikit-learn, found without importing it; None if absent."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ImportError("dataset 'digits' needs scikit-learn: pip install scikit-learn")
    found = (Path(folder) / _CSV for folder in spec.submodule_search_locations or ())
    return next((path for path in found if path.is_file()), None)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images [1797, 8, 8] float64 in 0..16, target [1797] int)``, equal to
    ``load_digits().images`` and ``.target``."""
    path = _sklearn_csv()
    if path is None:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    with gzip.open(path, "rt") as rows:
        data = np.loadtxt(rows, delimiter=",")  # as load_digits: pixels then the label, per row
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def read_digits(root=None, *, download: bool = False) -> RawData:
    """The digits as ``RawData``: pixels 0..16 scaled to [0, 1] as float32 [1797, 1, 8, 8],
    int64 labels, no official test split.  ``root`` and ``download`` are unused: the data
    come with scikit-learn."""
    images, target = digits_arrays()
    return RawData(pixels=torch.as_tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0,
                   labels=torch.as_tensor(target, dtype=torch.int64), num_classes=10,
                   class_names=tuple(str(d) for d in range(10)))
