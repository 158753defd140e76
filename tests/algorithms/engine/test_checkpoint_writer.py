"""Checkpoints streamed to the file and written on a background thread
(``engine/checkpoint.py``, ``engine/checkpoint_writer.py``): the file holds what a synchronous
``torch.save`` of the round's state holds, even while the next round changes that state, an
error of the write reaches the run, and files of the earlier (unpadded) format still read."""
from __future__ import annotations

import collections
import hashlib
import io
import json
import threading

import pytest
import torch

from pfl_algorithms.config import RunConfig, apply_sets, check
from pfl_algorithms.engine import checkpoint_writer
from pfl_algorithms.engine.checkpoint import HEADER_BYTES, read_checkpoint, write_checkpoint
from pfl_algorithms.engine.checkpoint_writer import CheckpointWriter, host_copy
from pfl_algorithms.runner import run

Point = collections.namedtuple("Point", "x y")


def saved_bytes(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def mixed_state(seed: int = 0, *, namedtuple: bool = False) -> dict:
    """Random tensors of the kinds a state may hold: views sharing a storage, a transposed and
    a sliced view, a Parameter that requires grad, an empty tensor, integers, a sparse tensor,
    inside dicts, an OrderedDict, lists and tuples (a namedtuple too if ``namedtuple``: a
    checkpoint read refuses it, as any class but the plain ones)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(7, 5, generator=g, dtype=torch.float64)
    sparse = torch.randn(4, 3, generator=g).relu().to_sparse()
    return {"round": 3, "name": "x", "rows": [base[1], base[2:5]], "t": base.t(), "whole": base,
            "od": collections.OrderedDict(p=torch.nn.Parameter(torch.randn(3, generator=g))),
            "pair": (torch.randint(0, 9, (5,), generator=g), (Point if namedtuple else lambda *items: items)(torch.empty(0, 2), 1.5)),
            "slice": torch.randn(11, generator=g)[::3], "sparse": sparse, "none": None}


def test_the_host_copy_saves_as_the_state_itself_and_is_independent_of_it():
    state = mixed_state(namedtuple=True)
    copy = host_copy(state)
    assert saved_bytes(copy) == saved_bytes(state)  # the same storages, views, types and flags
    assert copy["rows"][0].untyped_storage().data_ptr() == copy["whole"].untyped_storage().data_ptr()
    assert type(copy["od"]) is collections.OrderedDict and type(copy["pair"][1]) is Point
    assert isinstance(copy["od"]["p"], torch.nn.Parameter) and copy["od"]["p"].requires_grad
    before = saved_bytes(copy)
    with torch.no_grad():
        for tensor in (state["whole"], state["od"]["p"], state["pair"][0], state["slice"]):
            tensor.add_(1)
    assert saved_bytes(copy) == before


def test_the_host_copy_copies_other_objects_too():
    marks = {"seen": [1, 2]}

    class Box:
        def __init__(self):
            self.items = [torch.ones(2)]

    state = {"box": Box(), "marks": marks}
    copy = host_copy(state)
    state["box"].items[0].add_(1)
    marks["seen"].append(3)
    assert copy["box"].items[0].tolist() == [1.0, 1.0] and copy["marks"] == {"seen": [1, 2]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_host_copy_of_cuda_tensors_is_on_the_host_with_their_values_and_views():
    state = mixed_state()
    state.pop("sparse")  # kept on the CPU: the strided tensors' storages are what moves
    on_gpu = {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
    on_gpu["rows"] = [on_gpu["whole"][1], on_gpu["whole"][2:5]]
    copy = host_copy(on_gpu)
    assert copy["whole"].device.type == "cpu" and copy["rows"][1].device.type == "cpu"
    assert copy["rows"][0].untyped_storage().data_ptr() == copy["whole"].untyped_storage().data_ptr()
    torch.testing.assert_close(copy["rows"][1], state["whole"][2:5], rtol=0, atol=0)
    torch.testing.assert_close(copy["t"], state["t"], rtol=0, atol=0)
    on_gpu["whole"].add_(1)
    torch.testing.assert_close(copy["whole"], state["whole"], rtol=0, atol=0)


def test_a_streamed_checkpoint_has_a_fixed_header_and_reads_back(tmp_path):
    state = mixed_state()
    write_checkpoint(tmp_path / "c.pt", state)
    data = (tmp_path / "c.pt").read_bytes()
    assert data.index(b"\n") == HEADER_BYTES - 1
    payload = data[HEADER_BYTES:]
    header = json.loads(data[len(b"pfl-checkpoint "):HEADER_BYTES])
    assert header == {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload), "version": 1}
    assert payload == saved_bytes(state)
    assert saved_bytes(read_checkpoint(tmp_path / "c.pt")) == saved_bytes(state)


def test_a_checkpoint_of_the_unpadded_format_still_reads(tmp_path):
    state = mixed_state(1)
    payload = saved_bytes(state)
    header = {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload), "version": 1}
    (tmp_path / "old.pt").write_bytes(b"pfl-checkpoint " + json.dumps(header, sort_keys=True).encode() + b"\n"
                                      + payload)
    assert saved_bytes(read_checkpoint(tmp_path / "old.pt")) == payload


def test_the_background_write_holds_the_state_as_it_was_when_saved(tmp_path, monkeypatch):
    """The next round's in-place updates, made while the file is written, are not in it."""
    state = mixed_state(2)
    want = saved_bytes(state)
    release = threading.Event()
    write = checkpoint_writer.write_checkpoint

    def slow_write(path, snapshot):
        release.wait(10)  # the caller changes the state meanwhile
        write(path, snapshot)

    monkeypatch.setattr(checkpoint_writer, "write_checkpoint", slow_write)
    writer = CheckpointWriter()
    writer.save(tmp_path / "c.pt", state)
    with torch.no_grad():
        state["whole"].mul_(-3)
        state["od"]["p"].zero_()
    release.set()
    writer.wait()
    assert saved_bytes(read_checkpoint(tmp_path / "c.pt")) == want


def test_an_error_of_the_write_is_raised_by_the_next_save_and_the_old_file_stays(tmp_path, monkeypatch):
    writer = CheckpointWriter()
    writer.save(tmp_path / "c.pt", {"round": torch.tensor(1)})
    writer.wait()
    good = (tmp_path / "c.pt").read_bytes()

    def full_disk(path, snapshot):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_writer, "write_checkpoint", full_disk)
    writer.save(tmp_path / "c.pt", {"round": torch.tensor(2)})  # returns: the write runs behind it
    with pytest.raises(OSError, match="No space left"):
        writer.save(tmp_path / "c.pt", {"round": torch.tensor(3)})  # raised before this write starts
    writer.wait()  # so nothing is in flight, and the error was raised once
    assert (tmp_path / "c.pt").read_bytes() == good
    assert not list(tmp_path.glob(".*.tmp"))


def tiny_config(**overrides) -> RunConfig:
    settings = dict(algorithm="fedavg", dataset="gaussian-mixture", model="mlp", scenario="dirichlet", clients=3,
                    rounds=3, batch_size=16, lr=0.1, checkpoint_every=1)
    config = RunConfig(**{**settings, **overrides})
    apply_sets(config, ["samples=150", "min_samples=5"])
    return check(config)


def test_a_run_raises_the_error_of_its_last_checkpoint(tmp_path, monkeypatch):
    def full_disk(path, snapshot):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_writer, "write_checkpoint", full_disk)
    with pytest.raises(OSError, match="No space left"):
        run(tiny_config(rounds=1), tmp_path / "r", progress=False)
    assert not (tmp_path / "r" / "summary.json").exists()


def test_a_run_stopping_on_another_error_keeps_it_and_says_the_write_failed(tmp_path, monkeypatch, capsys):
    def full_disk(path, snapshot):
        raise OSError(28, "No space left on device")

    def stop(record):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_writer, "write_checkpoint", full_disk)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_config(rounds=3, checkpoint_every=1), tmp_path / "r", progress=False,
            on_round=lambda record: stop(record) if record["round"] == 1 else None)
    err = capsys.readouterr().err
    assert "could not be written either" in err and "No space left" in err


def test_a_run_returns_with_its_checkpoint_on_disk_and_equal_to_a_synchronous_one(tmp_path):
    summary = run(tiny_config(), tmp_path / "r", progress=False)
    state = read_checkpoint(tmp_path / "r" / "checkpoint.pt")
    assert state["federation"]["round"] == 3 and summary["rounds"] == 3
    write_checkpoint(tmp_path / "sync.pt", state)
    assert (tmp_path / "sync.pt").read_bytes() == (tmp_path / "r" / "checkpoint.pt").read_bytes()
