"""Multi-domain image folders (PACS, VLCS, Office-Caltech-10): ``domain/class/image``.

    <root>/PACS/{art_painting,cartoon,photo,sketch}/<class>/<image>
    <root>/VLCS/{Caltech101,LabelMe,SUN09,VOC2007}/<class>/<image>
    <root>/office_caltech_10/{amazon,caltech,dslr,webcam}/<class>/<image>

(DomainBed's downloader writes PACS and VLCS this way.)  Class ids are the sorted class
directory names, as torchvision's ``ImageFolder`` numbers them, and every domain must have
the same classes.  Images are the files below a class directory (subdirectories included)
whose extension is .jpg, .jpeg, .png or .bmp (any case), sorted by path; each is decoded with
PIL, converted to RGB and resized to ``image_size`` x ``image_size`` with PIL's bilinear
resampling.  Samples are ordered by domain (in the order asked for), then class, then path.
These datasets have no official test split, so ``test_mask`` is None.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

from .common import RawData, check_download, missing_file, name_list

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")


@dataclass(frozen=True)
class ImageFolderLayout:
    """One multi-domain image-folder dataset: its registry name, its directory under the
    data root, its domain directories (in id order) and where to get it."""

    dataset: str
    folder: str
    domains: tuple
    how_to_get: str


_DOMAINBED = ("with DomainBed's downloader (https://github.com/facebookresearch/DomainBed, "
              "domainbed/scripts/download.py)")
PACS = ImageFolderLayout("pacs", "PACS", ("art_painting", "cartoon", "photo", "sketch"),
                         f"get PACS {_DOMAINBED} or from https://domaingeneralization.github.io/ as "
                         f"domain/class/image folders")
VLCS = ImageFolderLayout("vlcs", "VLCS", ("Caltech101", "LabelMe", "SUN09", "VOC2007"),
                         f"get VLCS {_DOMAINBED} as domain/class/image folders")
OFFICE_CALTECH = ImageFolderLayout(
    "office-caltech", "office_caltech_10", ("amazon", "caltech", "dslr", "webcam"),
    "get Office-Caltech-10 (e.g. from FedBN's data, https://github.com/med-air/FedBN) as domain/class/image folders")


def select_domains(layout: ImageFolderLayout, domains: Union[None, str, Sequence[str]]) -> tuple:
    """The domains to load: all of ``layout``'s for None, else the names given (a sequence
    or a comma-separated string), in that order, each known and none twice."""
    if domains is None:
        return layout.domains
    names = name_list(domains)
    unknown = [d for d in names if d not in layout.domains]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"{layout.dataset}: domains must be distinct names among {list(layout.domains)}, "
                         f"got {list(names)}")
    return names


def list_images(folder: Path) -> list[Path]:
    """The image files below ``folder`` (any depth), sorted by path."""
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def load_image(path: Path, image_size: int) -> np.ndarray:
    """One image as [3, image_size, image_size] uint8: RGB, PIL bilinear resize.

    Raises:
        ImportError: Pillow is not installed.  ValueError: naming the file, when PIL cannot decode it.
    """
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as error:
        raise ImportError("image-folder datasets need Pillow: pip install pillow") from error
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB").resize((image_size, image_size), Image.BILINEAR)
    except (UnidentifiedImageError, OSError, SyntaxError) as error:
        raise ValueError(f"{path}: not a readable image ({error})") from error
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


def read_image_folder(root: Path, layout: ImageFolderLayout, *, domains=None, image_size: int = 64,
                      download: bool = False) -> RawData:
    """The images of ``layout``'s ``domains`` (default all) as [N, 3, image_size, image_size]
    uint8 with labels, ``domains`` (index into the domains loaded) and ``domain_names``.

    Raises:
        FileNotFoundError: a domain directory is missing or a class directory holds no image.
        ValueError: the domains disagree on the classes, an image cannot be decoded, or bad options.
    """
    directory = Path(root) / layout.folder
    check_download(download, layout.dataset, directory, layout.how_to_get, supported=False)
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"{layout.dataset}: image_size must be an integer >= 1, got {image_size!r}")
    names = select_domains(layout, domains)
    classes: Optional[tuple] = None
    files, labels, domain_ids = [], [], []
    for domain_id, domain in enumerate(names):
        folder = directory / domain
        if not folder.is_dir():
            raise missing_file(folder, layout.dataset, layout.how_to_get)
        found = tuple(sorted(entry.name for entry in folder.iterdir() if entry.is_dir()))
        if classes is None:
            classes = found
        elif found != classes:
            raise ValueError(f"{layout.dataset}: domain {domain!r} has classes {list(found)} but {names[0]!r} has "
                             f"{list(classes)}; every domain needs the same class directories")
        for label, name in enumerate(classes):
            images = list_images(folder / name)
            if not images:
                raise FileNotFoundError(f"{layout.dataset}: no image ({', '.join(IMAGE_EXTENSIONS)}) in "
                                        f"{folder / name}")
            files += images
            labels += [label] * len(images)
            domain_ids += [domain_id] * len(images)
    if not classes:
        raise FileNotFoundError(f"{layout.dataset}: no class directories in {directory / names[0]}; "
                                f"{layout.how_to_get}")
    # PIL releases the GIL while it decodes and resizes; map keeps the order.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        pixels = np.stack(list(pool.map(lambda path: load_image(path, image_size), files)))
    return RawData(torch.from_numpy(pixels), torch.tensor(labels, dtype=torch.int64), len(classes),
                   class_names=classes, domains=torch.tensor(domain_ids, dtype=torch.int64), domain_names=names)
