"""PACS, VLCS and Office-Caltech read back from tiny domain/class/image folders (PNG, BMP,
JPEG; RGB, grey and RGBA), resized with PIL, and their errors."""
import numpy as np
import pytest
import torch

from pfl_algorithms.data import load_dataset
from pfl_algorithms.data.readers import OFFICE_CALTECH, PACS, VLCS
from tests.algorithms.fake_files import assert_normalized, write_image_folder

Image = pytest.importorskip("PIL.Image")


def _decoded(paths, size):
    """What the reader must give: PIL's RGB conversion and bilinear resize, as [N, 3, s, s]."""
    out = []
    for path in paths:
        with Image.open(path) as image:
            out.append(np.asarray(image.convert("RGB").resize((size, size), Image.BILINEAR)).transpose(2, 0, 1))
    return np.stack(out)


@pytest.mark.parametrize("layout", [PACS, VLCS, OFFICE_CALTECH], ids=lambda layout: layout.dataset)
def test_image_folders(tmp_path, layout):
    classes = ("zebra", "apple", "Mango")  # sorted: Mango, apple, zebra
    paths = write_image_folder(tmp_path, layout.folder, layout.domains, classes, 3, np.random.default_rng(0))
    data = load_dataset(layout.dataset, root=tmp_path, image_size=8)
    assert data.name == layout.dataset and data.input_shape == (3, 8, 8) and len(data) == 4 * 3 * 3
    assert data.num_classes == 3 and data.class_names == ("Mango", "apple", "zebra")
    assert data.domain_names == layout.domains and data.test_mask is None
    assert data.domains.tolist() == [d for d in range(4) for _ in range(9)]
    assert [data.class_names[c] for c in data.labels.tolist()] == [p.parent.name for p in paths]
    assert [data.domain_names[d] for d in data.domains.tolist()] == [p.parts[-3] for p in paths]
    assert data.labels.tolist() == [c for _ in range(4) for c in range(3) for _ in range(3)]
    assert_normalized(data, _decoded(paths, 8))


def test_domain_subset_and_default_size(tmp_path):
    paths = write_image_folder(tmp_path, "PACS", PACS.domains, ("dog", "horse"), 2, np.random.default_rng(1))
    data = load_dataset("pacs", root=tmp_path, domains=["sketch", "art_painting"])
    assert data.input_shape == (3, 64, 64) and data.domain_names == ("sketch", "art_painting")
    chosen = [p for p in paths if p.parts[-3] == "sketch"] + [p for p in paths if p.parts[-3] == "art_painting"]
    assert data.domains.tolist() == [0] * 4 + [1] * 4
    assert_normalized(data, _decoded(chosen, 64))
    same = load_dataset("pacs", root=tmp_path, domains="sketch, art_painting")
    assert torch.equal(same.inputs, data.inputs)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        load_dataset("vlcs", root=tmp_path)
    for part in ("'Caltech101'", str(tmp_path / "VLCS"), "DomainBed", "PFL_DATA_ROOT"):
        assert part in str(error.value)
    rng = np.random.default_rng(2)
    write_image_folder(tmp_path, "PACS", PACS.domains[:3], ("dog", "horse"), 1, rng)
    write_image_folder(tmp_path, "PACS", PACS.domains[3:], ("dog", "cat"), 1, rng)
    with pytest.raises(ValueError, match=r"domain 'sketch' has classes \['cat', 'dog'\] but 'art_painting' has "
                                         r"\['dog', 'horse'\]"):
        load_dataset("pacs", root=tmp_path)
    with pytest.raises(ValueError, match=r"domains must be distinct names among \['art_painting', 'cartoon'"):
        load_dataset("pacs", root=tmp_path, domains=["photo", "clipart"])
    with pytest.raises(ValueError, match="domains must be distinct"):
        load_dataset("pacs", root=tmp_path, domains=["photo", "photo"])
    with pytest.raises(ValueError, match="image_size must be an integer >= 1, got 0"):
        load_dataset("pacs", root=tmp_path, image_size=0)
    with pytest.raises(ValueError, match="download=True is not available"):
        load_dataset("pacs", root=tmp_path, download=True)
    broken = next((tmp_path / "PACS" / "photo" / "dog").glob("img0.*"))
    broken.write_bytes(b"not an image")
    with pytest.raises(ValueError, match=f"photo/dog/{broken.name}: not a readable image"):
        load_dataset("pacs", root=tmp_path, domains=["photo"])
    next((tmp_path / "PACS" / "cartoon" / "horse").glob("img0.*")).unlink()
    with pytest.raises(FileNotFoundError, match=r"no image \(.jpg, .jpeg, .png, .bmp\) in .*cartoon/horse"):
        load_dataset("pacs", root=tmp_path, domains=["cartoon"])
