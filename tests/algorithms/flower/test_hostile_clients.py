"""A hostile or careless ClientApp can neither poison nor stop the Flower server: through the
in-process grid, each malformed reply makes its client a failure of the round (one line naming
the key), and the others aggregate exactly as in a run where that client simply failed."""
import json
import logging
import re
import resource
import tracemalloc

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict  # noqa: E402

from pfl_algorithms.engine.messages import Message as PflMessage, Sparse  # noqa: E402
from pfl_algorithms.flower import records, validate  # noqa: E402
from pfl_algorithms.flower.app import run_server  # noqa: E402
from pfl_algorithms.flower.client import EVAL_METRICS, TRAIN_METRICS, flower_federation, make_client_app  # noqa: E402
from pfl_algorithms.flower.loopback import LoopbackGrid  # noqa: E402

from ..state_checks import assert_same  # noqa: E402
from .common import as_json, small_config  # noqa: E402
from .test_records import npy, with_array  # noqa: E402

logging.getLogger("flwr").setLevel(logging.ERROR)

HOSTILE = 1  # the client that misbehaves in the single-client cases
CONFIG = small_config("fedavg", clients=3, rounds=1)


# ------------------------------------------------------------------ a hostile ClientApp

def forged_upload(config, message: Message, client: int, *, sparse: bool = False) -> RecordDict:
    """An honest-looking training reply made without training (the node's state is untouched,
    as a client that fails): the download's tensors sent back, as Sparse ones if ``sparse``."""
    fed = flower_federation(config)[0]
    down = records.decode(message.content, "down")
    tensors = {name: Sparse(down.dense(name)) if sparse else down.dense(name) for name in down.tensors}
    upload = PflMessage(tensors, {}, int(fed.clients[client].train.numel()))
    content = RecordDict({TRAIN_METRICS: MetricRecord({"loss": 1.0, "samples": 40, "steps": 1, "finite": 1})})
    for name, record in records.encode(upload, "up").items():
        content[name] = record
    return content


def hostile_app(config, train=None, evaluate=None, *, sparse: bool = False, clients=(HOSTILE,)):
    """pfl's ClientApp, except that ``clients`` answer training with ``train(forged reply)`` and
    evaluation with ``evaluate(honest reply)`` (None: honestly)."""
    honest = make_client_app(config)

    def app(message: Message, context):
        client = int(context.node_config["partition-id"])
        kind = message.metadata.message_type
        if client in clients and kind == MessageType.TRAIN and train is not None:
            content = train(forged_upload(config, message, client, sparse=sparse), client)
            return Message(content, reply_to=message)
        reply = honest(message, context)
        if client in clients and kind == MessageType.EVALUATE and evaluate is not None:
            return Message(evaluate(reply.content), reply_to=message)
        return reply

    return app


def first_tensor(content) -> str:
    return json.loads(content["up.layout"]["layout"])["tensors"][0]["name"]


def values(content) -> np.ndarray:
    return content[f"up.tensor.{first_tensor(content)}"]["values"].numpy()


def with_values(change):
    """Replace the first tensor's values by ``change(values)``."""
    return lambda content, client: with_array(content, f"up.tensor.{first_tensor(content)}", "values",
                                             change(values(content)))


def with_layout(change):
    """Replace the layout's text by ``change(layout)`` (a dict; a str is sent as it is)."""
    def corrupt(content, client):
        layout = change(json.loads(content["up.layout"]["layout"]))
        content["up.layout"] = ConfigRecord({"layout": layout if isinstance(layout, str) else json.dumps(layout)})
        return content
    return corrupt


def with_first_spec(**changes):
    def change(layout):
        layout["tensors"][0].update(changes)
        return layout
    return with_layout(change)


def with_indices(change):
    return lambda content, client: with_array(content, f"up.tensor.{first_tensor(content)}", "indices",
                                             change(content[f"up.tensor.{first_tensor(content)}"]["indices"].numpy()))


def with_count(**counts):
    def corrupt(content, client):
        content["up.counts"] = MetricRecord({**dict(content["up.counts"]), **counts})
        return content
    return corrupt


def replaced(name, record):
    def corrupt(content, client):
        content[name] = record
        return content
    return corrupt


def without(name):
    def corrupt(content, client):
        del content[name]
        return content
    return corrupt


def poisoned(value: float):
    return with_values(lambda v: np.full_like(v, value))


# name -> (train corruption, sparse upload, a pattern of the failure reason)
TRAIN_CASES = {
    "nan with finite=1": (poisoned(float("nan")), False, r"up\.tensor\.\w+\.values: \d+ non-finite"),
    "3e38 with finite=1": (poisoned(3e38), False, r"up\.tensor\.\w+\.values: values up to 3e\+38, beyond"),
    "half the values": (with_values(lambda v: v[: len(v) // 2]), False, r"\.values: holds \d+ elements where"),
    "a shape that does not fit": (with_first_spec(shape=[7, 3]), False,
                                  r"up\.tensor\.\w+: the layout says float32 \[7, 3\], expected float32 \[\d+\]"),
    "layout not JSON": (with_layout(lambda l: "{'tensors': oops"), False, r"up\.layout: not JSON"),
    "dtype ['x']": (with_first_spec(dtype=["x"]), False, r"up\.tensor\.\w+: dtype .* is none of bool"),
    "dtype 'load'": (with_first_spec(dtype="load"), False, r"up\.tensor\.\w+: dtype 'load' is none of"),
    "an object array": (with_values(lambda v: npy({"descr": "|O", "fortran_order": False, "shape": v.shape},
                                                  b"\0" * 8 * v.size)), False,
                        r"\.values: holds object where the layout says float32"),
    "a sparse index of 1e9": (with_indices(lambda i: np.where(i == i.max(), 10 ** 9, i)), True,
                              r"\.indices: positions must be strictly increasing in \[0, \d+\)"),
    "a sparse index of -1": (with_indices(lambda i: np.where(i == i.min(), -1, i)), True,
                             r"\.indices: positions must be strictly increasing"),
    "a sparse shape of 2**40": (with_first_spec(shape=[2 ** 40]), True,
                                r"the layout says float32 \[1099511627776\], expected float32"),
    "no pfl.train record": (without(TRAIN_METRICS), False, r"pfl\.train: missing"),
    "no counts record": (without("up.counts"), False, r"up\.counts: missing"),
    "num-examples -40": (with_count(**{"num-examples": -40}), False, r"up\.counts: num-examples -40, expected an int"),
    "num-examples 1e15": (with_count(**{"num-examples": 10 ** 15}), False,
                          r"num-examples 1000000000000000, expected the partition's \d+ training samples"),
    "an unknown group": (with_first_spec(name="evil"), False, r"up\.tensor\.evil: no tensor 'evil' expected"),
    "finite=2": (replaced(TRAIN_METRICS, MetricRecord({"loss": 1.0, "samples": 40, "steps": 1, "finite": 2})), False,
                 r"pfl\.train: finite 2"),
}


def run(app, config=CONFIG):
    strategy = run_server(config, LoopbackGrid(app, config.clients))
    return strategy, as_json(strategy.history)


def comparable(history: list[dict]) -> list[dict]:
    """The history without its timings and failure reasons (the failed clients kept)."""
    return [{**{k: v for k, v in line.items() if k not in ("wall_s", "failed", "eval_failed")},
             "failed": sorted(line.get("failed", {})), "eval_failed": sorted(line.get("eval_failed", {}))}
            for line in history]


@pytest.fixture(scope="module")
def failed_run():
    """The run in which the hostile client simply fails (its ClientApp raises in training)."""
    return run(make_client_app(CONFIG, faults=f"raise:{HOSTILE}@1"))


@pytest.fixture(scope="module")
def honest_run():
    return run(make_client_app(CONFIG))


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_a_malformed_upload_is_its_clients_failure_and_the_others_aggregate_exactly(case, failed_run):
    corrupt, sparse, reason = TRAIN_CASES[case]
    strategy, history = run(hostile_app(CONFIG, corrupt, sparse=sparse))
    (line,) = history
    assert list(line["failed"]) == [str(HOSTILE)]
    assert re.search(reason, line["failed"][str(HOSTILE)]), line["failed"]
    assert "\n" not in line["failed"][str(HOSTILE)]
    assert comparable(history) == comparable(failed_run[1])
    assert_same(strategy.algorithm.state_dict(), failed_run[0].algorithm.state_dict())


def test_two_hostile_clients_of_five_change_nothing_for_the_other_three():
    config = small_config("fedavg", clients=5, rounds=2)
    nan, huge = TRAIN_CASES["nan with finite=1"][0], TRAIN_CASES["3e38 with finite=1"][0]
    app = hostile_app(config, lambda content, client: (nan if client == 1 else huge)(content, client), clients=(1, 3))
    strategy, history = run(app, config)
    failed_strategy, failed_history = run(make_client_app(config, faults="raise:1@1,raise:1@2,raise:3@1,raise:3@2"),
                                          config)
    assert [sorted(line["failed"]) for line in history] == [["1", "3"], ["1", "3"]]
    assert all("non-finite" in line["failed"]["1"] and "beyond" in line["failed"]["3"] for line in history)
    assert comparable(history) == comparable(failed_history)
    assert_same(strategy.algorithm.state_dict(), failed_strategy.algorithm.state_dict())
    assert all(torch.isfinite(t).all() for t in strategy.algorithm.global_model.values())


# name -> (evaluation corruption, a pattern of the reason)
EVAL_CASES = {
    "accuracy 1e9": ({"accuracy": 1e9}, r"pfl\.eval: accuracy 1e\+09 with loss .* expected NaN, or in \[0, 1\]"),
    "accuracy -0.5": ({"accuracy": -0.5}, r"pfl\.eval: accuracy -0\.5"),
    "a NaN loss where accuracy is claimed": ({"accuracy": 0.9, "loss": float("nan")}, r"accuracy 0\.9 with loss nan"),
    "samples not the partition's": ({"samples": 10 ** 6}, r"pfl\.eval: samples 1000000, expected the partition's"),
    "accuracy not a number": ({"accuracy": [0.5, 0.5]}, r"pfl\.eval: accuracy is \[0\.5, 0\.5\], expected a number"),
}


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_an_absurd_evaluation_is_that_clients_evaluation_failed(case, honest_run):
    changes, reason = EVAL_CASES[case]
    evaluate = lambda content: RecordDict({EVAL_METRICS: MetricRecord({**dict(content[EVAL_METRICS]), **changes})})
    strategy, (line,) = run(hostile_app(CONFIG, evaluate=evaluate))
    (honest,) = honest_run[1]
    assert list(line["eval_failed"]) == [str(HOSTILE)] and re.search(reason, line["eval_failed"][str(HOSTILE)])
    assert line["eval"]["accuracy"][str(HOSTILE)] is None
    others = [honest["eval"]["accuracy"][str(c)] for c in range(CONFIG.clients) if c != HOSTILE]
    assert [line["eval"]["accuracy"][str(c)] for c in range(CONFIG.clients) if c != HOSTILE] == others
    assert line["eval"]["mean_accuracy"] == sum(others) / len(others)
    assert line["train_loss"] == honest["train_loss"] and line["failed"] == {}


def test_a_missing_evaluation_record_is_that_clients_evaluation_failed():
    _, (line,) = run(hostile_app(CONFIG, evaluate=lambda content: RecordDict()))
    assert line["eval_failed"] == {str(HOSTILE): "pfl.eval: missing, or not a MetricRecord"}


def _address_space() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_AS"), reason="needs an address-space limit (Linux)")
@pytest.mark.parametrize("where", ["tensor", "extra"])
def test_a_sparse_shape_of_2_to_the_40_is_refused_without_allocating(where):
    """Decoded with 200 MB of address space to spare (a lazy allocation counts too) and under
    tracemalloc: refused by its layout, nothing allocated."""
    fed = flower_federation(CONFIG)[0]
    sparse = Sparse(torch.tensor([0.0, 1.5, 0.0]))
    message = PflMessage({}, {"bomb": sparse}) if where == "extra" else PflMessage({"body": sparse})
    content = RecordDict({TRAIN_METRICS: MetricRecord({"loss": 1.0, "samples": 40, "steps": 1, "finite": 1})})
    for name, record in records.encode(message, "up").items():
        content[name] = record
    layout = json.loads(content["up.layout"]["layout"])
    (layout["extras"]["dict"][0][1] if where == "extra" else layout["tensors"][0])["shape"] = [2 ** 40]
    content["up.layout"] = ConfigRecord({"layout": json.dumps(layout)})
    counts = {**dict(content["up.counts"]), "num-examples": int(fed.clients[1].train.numel())}
    content["up.counts"] = MetricRecord(counts)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    tracemalloc.start()
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + 200 * 2 ** 20, hard))
    try:
        with pytest.raises(records.RecordError, match=r"1099511627776"):
            validate.train_result(fed, 1, content, senders=3)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 200 * 2 ** 20
