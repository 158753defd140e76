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


# ---- hostile and broken files: decompression bombs and truncated images --------------------

def _png(width, height, raw: bytes, colour=2, depth=8, interlace=0) -> bytes:
    """A PNG with the given header whose one IDAT chunk is ``raw`` compressed (raw: the filter
    byte and pixels of each row, as the format stores them)."""
    import struct
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, interlace)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def _write_pacs_with(tmp_path, content: bytes):
    write_image_folder(tmp_path, "PACS", ("photo",), ("dog",), 2, np.random.default_rng(3))
    path = tmp_path / "PACS" / "photo" / "dog" / "img9.png"
    path.write_bytes(content)
    return path


def _one_line_naming(error, path) -> str:
    message = str(error.value)
    assert str(path) in message and "\n" not in message, message
    return message


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL warns above its limit, then we refuse
def test_a_png_declaring_30000_by_30000_pixels_is_one_line(tmp_path):
    path = _write_pacs_with(tmp_path, _png(30000, 30000, bytes(30000 * 3 + 1)))
    with pytest.raises(ValueError) as error:
        load_dataset("pacs", root=tmp_path, domains=["photo"], image_size=8)
    assert "30000x30000" in _one_line_naming(error, path) or "900000000 pixels" in str(error.value)
    # Between this reader's limit and PIL's (twice as high): refused from the header, never decoded.
    path.write_bytes(_png(10000, 10000, bytes(10000 * 3 + 1)))
    with pytest.raises(ValueError, match="declares 10000x10000 pixels, more than the 89478485") as error:
        load_dataset("pacs", root=tmp_path, domains=["photo"], image_size=8)
    _one_line_naming(error, path)


@pytest.mark.parametrize("cut", ["file_cut_in_its_image_data", "stream_ends_after_half_the_rows"])
def test_a_truncated_png_is_refused(tmp_path, cut):
    rng = np.random.default_rng(4)
    pixels = rng.integers(0, 256, size=(40, 40, 3), dtype=np.uint8)
    rows = b"".join(b"\x00" + row.tobytes() for row in pixels)
    whole = _png(40, 40, rows)
    content = whole[:len(whole) // 2] if cut == "file_cut_in_its_image_data" else _png(40, 40, rows[:len(rows) // 2])
    path = _write_pacs_with(tmp_path, content)
    with pytest.raises(ValueError, match="truncated") as error:
        load_dataset("pacs", root=tmp_path, domains=["photo"], image_size=8)
    _one_line_naming(error, path)
    path.write_bytes(whole)
    data = load_dataset("pacs", root=tmp_path, domains=["photo"], image_size=8)
    assert len(data) == 3


def test_truncated_images_stay_refused_when_pil_is_told_to_load_them(tmp_path, monkeypatch):
    from PIL import ImageFile

    path = _write_pacs_with(tmp_path, b"")
    path.unlink()
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(ValueError, match="LOAD_TRUNCATED_IMAGES is True") as error:
        load_dataset("pacs", root=tmp_path, domains=["photo"], image_size=8)
    assert "\n" not in str(error.value) and "PACS/photo/dog/img" in str(error.value)


def test_every_png_layout_passes_the_size_check(tmp_path):
    """Palette, 1-bit, 16-bit, grey+alpha and interlaced PNGs decode as PIL decodes them."""
    from pfl_algorithms.data.readers.image_folder import load_image

    rng = np.random.default_rng(5)
    rgb = rng.integers(0, 256, size=(13, 11, 3), dtype=np.uint8)
    paths = []
    for mode in ("P", "1", "I;16", "LA", "RGB"):
        image = Image.fromarray(rgb).convert(mode) if mode != "I;16" else Image.fromarray(
            rng.integers(0, 2**16, size=(13, 11), dtype=np.uint16))
        paths.append(tmp_path / f"{mode.replace(';', '')}.png")
        image.save(paths[-1])
    # Adam7: pass p holds the pixels (y, x) with y = y0 + k*dy, x = x0 + j*dx, rows filter byte 0.
    from pfl_algorithms.data.readers.image_folder import _ADAM7

    raw = b""
    for x0, y0, dx, dy in _ADAM7:
        block = rgb[y0::dy, x0::dx]
        if block.size:
            raw += b"".join(b"\x00" + row.tobytes() for row in block)
    paths.append(tmp_path / "interlaced.png")
    paths[-1].write_bytes(_png(11, 13, raw, interlace=1))
    for path in paths:
        assert np.array_equal(load_image(path, 5), _decoded([path], 5)[0]), path.name
    with Image.open(paths[-1]) as image:
        assert np.array_equal(np.asarray(image.convert("RGB")), rgb)
    paths[-1].write_bytes(_png(11, 13, raw[:-10], interlace=1))
    with pytest.raises(ValueError, match=r"holds 445 of the 455 bytes its 11x13 pixels need"):
        load_image(paths[-1], 5)
