"""What the Flower server accepts from a ClientApp: a reply is read against what the server
itself knows (the federation's cohorts and partition, the round), never against what the
client says about itself.  A reply that breaks a rule makes its client a failure of the round,
with one line naming the record key and what was expected; the round goes on with the others.

The rules:

* training metrics (``pfl.train``): ``loss`` a number, ``samples`` and ``steps`` ints >= 0,
  ``finite`` 0 or 1; ``finite = 1`` with samples needs a finite loss.  ``finite = 0`` is a
  non-finite client, skipped as natively (whatever it sent is ignored).
* the upload (``records.decode`` with :func:`expected_upload`): tensors only the client's
  cohort's parameter groups and ``buffers``, each flat [P_g] of its bank's dtype; all payloads
  together at most 4 parameter-and-buffer rows plus 2^16 elements (the largest upload of any
  algorithm is 2 rows, FedDWA's); all compared on the layout before anything is allocated.
* ``num-examples`` must equal the client's training samples in the server's own partition (the
  ClientApp sends ``view.num_examples``, that same count): a mismatch is a failure, so a client
  can never choose its aggregation weight.
* values: the decoded upload must be finite, and every floating value at most its dtype's
  largest / K in magnitude (K the round's clients; float numbers in the extras against
  float64's), so that no sum or weighted mean (weights in [0, 1]) of the round's uploads can
  overflow (3e38 in float32 overflows a sum of two).  The aggregation result must be finite
  too: when ``aggregate`` leaves a non-finite server state, or raises on what it was given (an
  extra an algorithm reads in its own way), the server restores its state and ledger and
  finishes the round without the round's uploads, every sender failed with the reason
  (:func:`finish_round_checked`).  The server state is ``algorithm.state_dict()`` whole, so an
  algorithm keeps no NaN there on purpose: a number it did not measure this round (FedGP's
  share of positive cosines without the target's upload, FedDAF's α and θ before the target
  sent them) is None, as ``round_metrics`` writes it to ``metrics.jsonl``.
* evaluation metrics (``pfl.eval``): ``samples`` equal to the client's split in the partition;
  ``accuracy`` NaN (nothing scored: an empty split or a diverged model) or in [0, 1] with a
  finite loss; anything else is that client's evaluation failed (NaN, out of the mean).
"""
from __future__ import annotations

import copy
import math
from logging import WARNING
from typing import Any, Callable, Mapping, Optional, TypeVar

import torch

from ..engine.client import EvalResult, TrainResult
from ..engine.groups import BUFFERS
from ..engine.local import LocalResult
from ..engine.rounds import RoundRecord, RoundStart, finish_round
from . import records
from .client import EVAL_METRICS, TRAIN_METRICS
from .records import RecordError

T = TypeVar("T")

# What reading one client's reply may raise besides RecordError: a failure of that client.
_REPLY_ERRORS = (RecordError, KeyError, TypeError, ValueError, IndexError, OverflowError, RecursionError)
# What an algorithm's aggregate may raise on uploads that passed those checks (torch raises
# RuntimeError for stacking extras of different shapes).
_AGGREGATE_ERRORS = (*_REPLY_ERRORS, RuntimeError)


def _reason(error: BaseException) -> str:
    """A refusal's reason: the RecordError's line, else the error's type and line."""
    text = records.one_line(error)
    return text if isinstance(error, RecordError) else f"{type(error).__name__}: {text}"


def expected_upload(fed, client: int, senders: int) -> records.Expected:
    """What ``client``'s upload may be (module docstring), in a round of ``senders`` clients."""
    cohort = fed.cohort_of(client)
    dtype = cohort.params.data.dtype
    tensors = {group: ((cohort.span(group).stop - cohort.span(group).start,), dtype) for group in cohort.groups.order}
    buffers = cohort.shared_buffer_span()
    tensors[BUFFERS] = ((buffers.stop - buffers.start,), cohort.buffers.data.dtype)
    row = cohort.params.data.shape[1] + cohort.buffers.data.shape[1]
    return records.Expected(tensors, most=4 * row + 2 ** 16, num_examples=int(fed.clients[client].train.numel()),
                            senders=senders)


def _metrics(content, name: str, kinds: Mapping[str, type]) -> dict:
    """The numbers ``kinds`` (key -> int or float) of the MetricRecord ``name`` of a reply."""
    from flwr.common import MetricRecord

    record = content[name] if name in content else None
    if not isinstance(record, MetricRecord):
        raise RecordError(f"{name}: missing, or not a MetricRecord")
    values = {}
    for key, kind in kinds.items():
        value = record.get(key)
        if type(value) not in ((int,) if kind is int else (int, float)):
            raise RecordError(f"{name}: {key} is {str(value)[:40]}, expected {'an int' if kind is int else 'a number'}")
        values[key] = kind(value)
    return values


def train_result(fed, client: int, content, senders: int) -> TrainResult:
    """``client``'s training reply as a TrainResult (module docstring).

    Raises:
        RecordError: the reply breaks a rule."""
    train = _metrics(content, TRAIN_METRICS, {"loss": float, "samples": int, "steps": int, "finite": int})
    if train["finite"] not in (0, 1) or train["samples"] < 0 or train["steps"] < 0:
        raise RecordError(f"{TRAIN_METRICS}: finite {train['finite']}, samples {train['samples']}, steps "
                          f"{train['steps']}: expected finite 0 or 1 and counts >= 0")
    if train["finite"] and train["samples"] and not math.isfinite(train["loss"]):
        raise RecordError(f"{TRAIN_METRICS}: loss {train['loss']} where finite = 1")
    upload = None
    if train["finite"] and records.has_message(content, "up"):
        upload = records.decode(content, "up", fed.device, expected_upload(fed, client, senders))
    return TrainResult(client, LocalResult(train["loss"], train["samples"], train["steps"], bool(train["finite"])),
                       upload)


def eval_result(fed, client: int, content, split: str = "test") -> EvalResult:
    """``client``'s evaluation reply on ``split`` as an EvalResult (module docstring).

    Raises:
        RecordError: the reply breaks a rule."""
    metrics = _metrics(content, EVAL_METRICS, {"accuracy": float, "loss": float, "samples": int})
    accuracy, loss, samples = metrics["accuracy"], metrics["loss"], metrics["samples"]
    held = int(fed.clients[client].part(split).numel())
    if samples != held:
        raise RecordError(f"{EVAL_METRICS}: samples {samples}, expected the partition's {held} {split} samples")
    if not math.isnan(accuracy) and not (0.0 <= accuracy <= 1.0 and math.isfinite(loss) and samples > 0):
        raise RecordError(f"{EVAL_METRICS}: accuracy {accuracy:.6g} with loss {loss:.6g} on {samples} samples, "
                          "expected NaN, or in [0, 1] with a finite loss")
    return EvalResult(client, accuracy, loss, samples)


def read_each(contents: Mapping[int, Any], read: Callable[[int, Any], T]) -> tuple[dict[int, T], dict[int, str]]:
    """(``read(client, content)`` by client, the reason by client where it raised): one bad
    reply is its client's failure, never the server's."""
    values, refused = {}, {}
    for client, content in contents.items():
        try:
            values[client] = read(client, content)
        except _REPLY_ERRORS as error:
            refused[client] = _reason(error)
    return values, refused


def train_results(fed, contents: Mapping[int, Any], senders: int) -> tuple[list[TrainResult], dict[int, str]]:
    """The training replies (content by client) of a round of ``senders`` clients: the
    TrainResults of those accepted, in client order, and the reason of each one refused."""
    results, refused = read_each(contents, lambda client, content: train_result(fed, client, content, senders))
    return [results[client] for client in sorted(results)], refused


def eval_results(fed, contents: Mapping[int, Any], split: str = "test") -> tuple[dict[int, EvalResult],
                                                                                 dict[int, str]]:
    """The evaluation replies (content by client): the EvalResults of those accepted, and the
    reason of each one refused."""
    return read_each(contents, lambda client, content: eval_result(fed, client, content, split))


def _non_finite(state, path: str = "state") -> Optional[str]:
    """The path of the first non-finite float in a state dict (tensors, numbers, containers)."""
    if isinstance(state, torch.Tensor):
        return path if state.is_floating_point() and not bool(torch.isfinite(state).all()) else None
    if isinstance(state, float):
        return None if math.isfinite(state) else path
    if isinstance(state, Mapping):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return None
    for key, item in items:
        found = _non_finite(item, f"{path}.{key}")
        if found is not None:
            return found
    return None


def finish_round_checked(fed, algorithm, start: RoundStart, results: list[TrainResult],
                         failed: Mapping[int, str]) -> RoundRecord:
    """``finish_round`` (without its evaluation) whose aggregation must stay finite: when it
    raises or leaves a non-finite server state that was finite, the server state and the
    ledger are restored and the round is finished again without the round's uploads, each
    sender failed with the reason."""
    from flwr.common import log

    failed = dict(sorted(failed.items()))
    before = copy.deepcopy((algorithm.state_dict(), fed.comm.state_dict()))
    try:
        record = finish_round(fed, algorithm, start, results, failed=failed, evaluate=False)
        where = _non_finite(algorithm.state_dict())
        if where is None or _non_finite(before[0]) is not None:
            return record
        reason = f"the round's aggregate made {where} non-finite; the server kept its state"
    except _AGGREGATE_ERRORS as error:
        reason = f"the round's aggregate raised {_reason(error)}; the server kept its state"
    log(WARNING, "round %d: %s", start.round + 1, reason)
    algorithm.load_state_dict(before[0])
    fed.comm.load_state_dict(before[1])
    senders = {r.client for r in results if r.finite and r.upload is not None}
    return finish_round(fed, algorithm, start, [r for r in results if r.client not in senders],
                        failed={**failed, **{client: reason for client in sorted(senders)}}, evaluate=False)
