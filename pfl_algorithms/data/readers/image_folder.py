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
import struct
import zlib
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


# The most pixels an image may declare: PIL's default ``Image.MAX_IMAGE_PIXELS`` (about 256 MB
# decoded as RGB), checked from the header before anything is decoded.  (PIL only warns up to
# twice that, and raises its DecompressionBombError, a traceback, beyond.)
MAX_IMAGE_PIXELS = 89_478_485
# Adam7's passes: (first column, first row, column step, row step).
_ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
_PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # by colour type


def load_image(path: Path, image_size: int) -> np.ndarray:
    """One image as [3, image_size, image_size] uint8: RGB, PIL bilinear resize.

    The size the header declares is checked before the image is decoded (at most
    ``MAX_IMAGE_PIXELS``), and the whole image is decoded: a truncated file is refused, never
    read with its missing rows filled in (a PNG whose image data ends early too, which PIL
    accepts).  PIL's ``ImageFile.LOAD_TRUNCATED_IMAGES`` must therefore be False.

    Raises:
        ImportError: Pillow is not installed.  ValueError: one line naming the file, when PIL
        cannot decode it, it is truncated, or it declares more than MAX_IMAGE_PIXELS pixels.
    """
    try:
        from PIL import Image, ImageFile, UnidentifiedImageError
    except ImportError as error:
        raise ImportError("image-folder datasets need Pillow: pip install pillow") from error
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        raise ValueError(f"{path}: not read, because PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True in this process "
                         f"(truncated images would load with missing pixels); set it to False")
    try:
        with Image.open(path) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ValueError(f"{path}: the image declares {width}x{height} pixels, more than the "
                                 f"{MAX_IMAGE_PIXELS} this reader decodes (a decompression bomb?); refusing it")
            if image.format == "PNG":
                _check_png_data(path)
            image.load()  # the whole image: a truncated one raises OSError here
            rgb = image.convert("RGB").resize((image_size, image_size), Image.BILINEAR)
    except Image.DecompressionBombError as error:
        raise ValueError(f"{path}: refusing to decode it ({error})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, zlib.error) as error:
        raise ValueError(f"{path}: not a readable image ({error})") from None
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


def _png_data_size(width: int, height: int, bits: int, interlaced: bool) -> int:
    """The bytes a PNG's decompressed image data holds: per row of each (Adam7) pass, one filter
    byte and the row's pixels rounded up to whole bytes."""
    def size(w, h):
        return h * (1 + (w * bits + 7) // 8) if w and h else 0

    if not interlaced:
        return size(width, height)
    return sum(size(max(0, (width - x + dx - 1) // dx), max(0, (height - y + dy - 1) // dy))
               for x, y, dx, dy in _ADAM7)


def _check_png_data(path: Path) -> None:
    """ValueError when the PNG's image data (its IDAT chunks, decompressed a MiB at a time)
    holds fewer bytes than its header's size needs: a truncated file, or a stream that ends
    early, whose missing rows PIL would leave black.  Chunks PIL checks itself are left to it."""
    data = Path(path).read_bytes()
    pos, header, stream = 8, None, zlib.decompressobj()
    produced = 0
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT" and header is not None:
            while body and not stream.eof:
                produced += len(stream.decompress(body, 1 << 20))
                body = stream.unconsumed_tail
        elif kind == b"IEND":
            break
        pos += 12 + length
    while not stream.eof:  # output zlib held back when the last call's limit was reached
        more = len(stream.decompress(b"", 1 << 20))
        if not more:
            break
        produced += more
    if header is None or len(header) < 13 or header[9] not in _PNG_CHANNELS:
        return  # PIL refuses these
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", header[:13])
    needed = _png_data_size(width, height, depth * _PNG_CHANNELS[colour], bool(interlace))
    if produced < needed:
        raise ValueError(f"{path}: truncated PNG: its image data holds {produced} of the {needed} bytes its "
                         f"{width}x{height} pixels need; refusing it")


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
