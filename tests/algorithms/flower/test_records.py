"""Payload mapping: pfl Messages through Flower records and back, bits kept; what is received
is refused, one line naming its key, unless it is what its layout and its receiver expect
(``records.decode``, ``flower.validate``)."""
import io
import json

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402

from pfl_algorithms.api import ClassMeans  # noqa: E402
from pfl_algorithms.engine.messages import Message, Sparse  # noqa: E402
from pfl_algorithms.flower.records import Expected, RecordError, decode, encode  # noqa: E402


def round_trip(message: Message) -> Message:
    return decode(RecordDict(encode(message, "up")), "up")


def test_dense_groups_buffers_and_counts_round_trip_bitwise():
    message = Message({"body": torch.randn(7), "head": torch.randn(3, dtype=torch.float64),
                       "buffers": torch.randn(4).bfloat16()}, num_examples=17)
    back = round_trip(message)
    assert list(back.tensors) == list(message.tensors)
    for name, tensor in message.tensors.items():
        assert back.tensors[name].dtype == tensor.dtype and torch.equal(back.tensors[name], tensor)
    assert back.num_examples == 17 and back.bits() == message.bits()


def test_a_download_that_is_read_not_loaded_keeps_its_apply_flag():
    message = Message({"body": torch.randn(5)}, apply=False)
    back = round_trip(message)
    assert back.apply is False and torch.equal(back.tensors["body"], message.tensors["body"])
    assert round_trip(Message({"body": torch.randn(5)})).apply is True
    assert back.bits() == message.bits()  # the flag is part of the layout, not a payload
    records = encode(message, "down")
    layout = json.loads(records["down.layout"]["layout"])
    records["down.layout"] = ConfigRecord({"layout": json.dumps({**layout, "apply": "no"})})
    with pytest.raises(RecordError, match="down.layout: apply no, expected true or false"):
        decode(RecordDict(records), "down")


def test_records_are_one_array_record_per_group_and_extra_tensor():
    message = Message({"u": torch.randn(3), "v": torch.randn(2)},
                      {"weights": torch.randn(2), "nested": {"loss": 0.5, "pair": (torch.ones(1), 3)}}, 9)
    records = encode(message, "up")
    arrays = sorted(k for k, v in records.items() if isinstance(v, ArrayRecord))
    assert arrays == ["up.extra.0", "up.extra.1", "up.tensor.u", "up.tensor.v"]
    assert isinstance(records["up.layout"], ConfigRecord) and isinstance(records["up.counts"], MetricRecord)
    assert records["up.counts"]["num-examples"] == 9


@pytest.mark.parametrize("threshold,index_bits", [(0.0, 0), (0.5, 0), (0.5, 32)])
def test_sparse_travels_as_indices_and_values_and_costs_the_same(threshold, index_bits):
    tensor = torch.tensor([0.0, 0.2, -0.7, -0.0, 1.5, -0.5])  # a -0.0 does not travel: +0.0 on both sides
    message = Message({"mu": Sparse(tensor, threshold, index_bits)})
    records = encode(message, "down")
    kept = Sparse(tensor, threshold).kept()
    assert records["down.tensor.mu"]["values"].numpy().tolist() == tensor[kept].tolist()
    assert records["down.tensor.mu"]["indices"].numpy().tolist() == torch.nonzero(kept).flatten().tolist()
    back = decode(RecordDict(records), "down")
    sent = back.tensors["mu"]
    assert isinstance(sent, Sparse) and (sent.threshold, sent.index_bits) == (threshold, index_bits)
    assert torch.equal(back.dense("mu").view(torch.int32), message.dense("mu").view(torch.int32))  # bitwise
    assert not message.dense("mu").signbit()[3]
    assert back.bits() == message.bits()


def test_nested_extras_keep_their_structure_types_and_bits():
    extras = {"models": {"body": torch.randn(2, 3)}, "numbers": [1, 2.5, True], 3: (torch.arange(4), float("inf")),
              "sparse": Sparse(torch.tensor([0.0, 2.0]))}
    message = Message({}, extras)
    back = round_trip(message)
    assert back.bits() == message.bits()
    assert torch.equal(back.extras["models"]["body"], extras["models"]["body"])
    assert back.extras["numbers"] == [1, 2.5, True] and [type(v) for v in back.extras["numbers"]] == [int, float, bool]
    assert isinstance(back.extras[3], tuple) and torch.equal(back.extras[3][0], torch.arange(4))
    assert back.extras[3][1] == float("inf")
    assert torch.equal(back.extras["sparse"].dense(), extras["sparse"].dense())


def test_a_class_means_request_must_be_resolved_before_sending():
    request = ClassMeans(torch.randn(4, 2), torch.tensor([0, 1, 1, 0]), 2)
    with pytest.raises(TypeError, match="ClassMeans"):
        encode(Message({}, {"means": request}), "up")


@pytest.mark.parametrize("where", ["tensor", "extra", "sparse"])
def test_a_tensor_no_receiver_can_decode_is_refused_when_sent(where):
    """A complex tensor was encoded, then refused by the receiver's decode (its dtype is none of
    DTYPES): the sender learns it at once, naming the dtype."""
    value = torch.ones(3, dtype=torch.complex64)
    message = {"tensor": Message({"body": value}),
               "extra": Message({"body": torch.ones(3)}, extras={"z": value}),
               "sparse": Message({"body": Sparse(value, 0.5)})}[where]
    with pytest.raises(TypeError, match="a complex64 tensor cannot be sent: a message carries bool, "):
        encode(message, "p")


def test_no_message_under_a_prefix_decodes_to_none():
    assert decode(RecordDict(), "down") is None


# ------------------------------------------------------------------ what decoding refuses

def sent(message: Message) -> RecordDict:
    return RecordDict(encode(message, "up"))


def with_layout(content: RecordDict, change) -> RecordDict:
    layout = json.loads(content["up.layout"]["layout"])
    change(layout)
    content["up.layout"] = ConfigRecord({"layout": json.dumps(layout)})
    return content


def with_array(content: RecordDict, key: str, field: str, array) -> RecordDict:
    record = ArrayRecord()
    for name in content[key]:
        record[name] = content[key][name]
    record[field] = array if isinstance(array, Array) else Array(array)
    content[key] = record
    return content


def npy(header: dict, data: bytes) -> Array:
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, header)
    stream.write(data)
    return Array(dtype="x", shape=header["shape"], stype="numpy.ndarray", data=stream.getvalue())


DENSE = Message({"body": torch.arange(6.0)}, {"w": torch.ones(2), "n": 3}, 9)
SPARSE = Message({"body": Sparse(torch.tensor([0.0, 2.0, 0.0, 3.0, 4.0]))}, {}, 9)
BAD = {  # name -> (message, how it is broken, the error's pattern)
    "layout not JSON": (DENSE, lambda c: c.__setitem__("up.layout", ConfigRecord({"layout": "{nope"})),
                        r"^up\.layout: not JSON"),
    "layout without tensors": (DENSE, lambda c: c.__setitem__("up.layout", ConfigRecord({"layout": "[1]"})),
                               r"^up\.layout: expected an object with a 'tensors' list"),
    "dtype load": (DENSE, lambda c: with_layout(c, lambda l: l["tensors"][0].update(dtype="load")),
                   r"^up\.tensor\.body: dtype 'load' is none of bool, uint8"),
    "dtype list": (DENSE, lambda c: with_layout(c, lambda l: l["tensors"][0].update(dtype=["x"])),
                   r"^up\.tensor\.body: dtype"),
    "dtype of another record": (DENSE, lambda c: with_layout(c, lambda l: l["tensors"][0].update(dtype="float64")),
                                r"^up\.tensor\.body\.values: holds float32 where the layout says float64"),
    "negative size": (DENSE, lambda c: with_layout(c, lambda l: l["tensors"][0].update(shape=[-6])),
                      r"^up\.tensor\.body: shape \[-6\] is not a list"),
    "a shape that does not fit": (DENSE, lambda c: with_layout(c, lambda l: l["tensors"][0].update(shape=[4, 2])),
                                  r"^up\.tensor\.body\.values: holds 6 elements where the layout's shape needs 8"),
    "half the values": (DENSE, lambda c: with_array(c, "up.tensor.body", "values", np.zeros(3, np.float32)),
                        r"^up\.tensor\.body\.values: holds 3 elements"),
    "an object array": (DENSE, lambda c: with_array(c, "up.tensor.body", "values", npy(
        {"descr": "|O", "fortran_order": False, "shape": (6,)}, b"\0" * 48)), r"holds object where"),
    "a big-endian array": (DENSE, lambda c: with_array(c, "up.tensor.body", "values", np.zeros(6, ">f4")),
                           r"holds >f4 where the layout says float32"),
    "a header declaring more than its data": (DENSE, lambda c: with_array(c, "up.tensor.body", "values", npy(
        {"descr": "<f4", "fortran_order": False, "shape": (6,)}, b"\0" * 8)), r"8 bytes of data where its header"),
    "bytes that are no array": (DENSE, lambda c: with_array(c, "up.tensor.body", "values", Array(
        dtype="float32", shape=(6,), stype="numpy.ndarray", data=b"nonsense")), r"not a \.npy array"),
    "a missing tensor record": (DENSE, lambda c: c.__delitem__("up.tensor.body"), r"^up\.tensor\.body: missing"),
    "a missing extra record": (DENSE, lambda c: c.__delitem__("up.extra.0"), r"^up\.extra\.0: missing"),
    "counts missing": (DENSE, lambda c: c.__delitem__("up.counts"), r"^up\.counts: missing"),
    "num-examples a float": (DENSE, lambda c: c.__setitem__("up.counts", MetricRecord({"num-examples": 9.5})),
                             r"^up\.counts: num-examples 9\.5, expected an int >= 0"),
    "a number of the wrong type": (DENSE, lambda c: c.__setitem__("up.counts", MetricRecord(
        {"num-examples": 9, "number.0": 2.5})), r"^up\.counts: number\.0 is 2\.5, expected an int"),
    "extras nested too deep": (DENSE, lambda c: with_layout(c, lambda l: l.update(
        extras=json.loads('{"list": [' * 40 + ']}' * 40))), r"nested deeper than 32"),
    "an unknown extras entry": (DENSE, lambda c: with_layout(c, lambda l: l.update(extras={"set": []})),
                                r"^up\.layout: extras entry"),
    "a sparse index of -1": (SPARSE, lambda c: with_array(c, "up.tensor.body", "indices", np.array([-1, 3, 4])),
                             r"^up\.tensor\.body\.indices: positions must be strictly increasing in \[0, 5\)"),
    "a sparse index of 1e9": (SPARSE, lambda c: with_array(c, "up.tensor.body", "indices", np.array([1, 3, 10 ** 9])),
                              r"^up\.tensor\.body\.indices: positions"),
    "repeated sparse indices": (SPARSE, lambda c: with_array(c, "up.tensor.body", "indices", np.array([1, 1, 4])),
                                r"^up\.tensor\.body\.indices: positions"),
    "more sparse indices than entries": (SPARSE, lambda c: with_array(c, "up.tensor.body", "indices", np.arange(6)),
                                         r"expected a vector of at most 5 elements"),
    "a sparse threshold of NaN": (SPARSE, lambda c: with_layout(c, lambda l: l["tensors"][0].update(
        threshold=float("nan"))), r"^up\.tensor\.body: threshold nan is not a number >= 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_record_is_refused_in_one_line_naming_its_key(case):
    message, corrupt, pattern = BAD[case]
    content = sent(message)
    corrupt(content)
    with pytest.raises(RecordError, match=pattern) as error:
        decode(content, "up")
    assert "\n" not in str(error.value)


EXPECTED = Expected({"body": ((6,), torch.float32), "head": ((2,), torch.float32)}, most=20, num_examples=9,
                    senders=4)


def test_an_expected_message_decodes_as_sent():
    message = Message({"body": torch.arange(6.0), "head": Sparse(torch.tensor([0.0, 1.0]))}, {"w": torch.ones(2)}, 9)
    back = decode(sent(message), "up", expected=EXPECTED)
    assert torch.equal(back.dense("body"), message.dense("body")) and back.bits() == message.bits()


@pytest.mark.parametrize("message,pattern", [
    (Message({"evil": torch.zeros(6)}, {}, 9), r"^up\.tensor\.evil: no tensor 'evil' expected \(one of body, head\)"),
    (Message({"body": torch.zeros(7)}, {}, 9), r"^up\.tensor\.body: the layout says float32 \[7\], expected float32 "
                                               r"\[6\]"),
    (Message({"body": torch.zeros(6, dtype=torch.float64)}, {}, 9), r"says float64 \[6\], expected float32 \[6\]"),
    (Message({"body": torch.zeros(6)}, {}, 10), r"^up\.counts: num-examples 10, expected the partition's 9"),
    (Message({"body": torch.zeros(6)}, {"big": torch.zeros(15)}, 9), r"declares 21 elements in all, more than the 20"),
    (Message({"body": torch.full((6,), float("nan"))}, {}, 9), r"^up\.tensor\.body\.values: 6 non-finite values"),
    (Message({}, {"w": torch.tensor([1.0, float("inf")])}, 9), r"^up\.extra\.0\.values: 1 non-finite"),
    (Message({"body": torch.full((6,), 1e38)}, {}, 9), r"values up to 1e\+38, beyond 8\.51e\+37 \(float32's largest "
                                                       r"/ 4"),
    (Message({}, {"loss": float("nan")}, 9), r"^up\.counts number\.0: 1 non-finite"),
    (Message({}, {"loss": 1e308}, 9), r"^up\.counts number\.0: values up to 1e\+308, beyond"),
])
def test_what_the_receiver_does_not_expect_is_refused(message, pattern):
    with pytest.raises(RecordError, match=pattern):
        decode(sent(message), "up", expected=EXPECTED)


def test_a_sparse_layout_of_2_to_the_40_is_refused_before_anything_is_allocated():
    content = with_layout(sent(SPARSE), lambda l: l["tensors"][0].update(shape=[2 ** 40]))
    with pytest.raises(RecordError, match=r"says float32 \[1099511627776\], expected float32 \[6\]"):
        decode(content, "up", expected=EXPECTED)
    extra = with_layout(sent(Message({}, {"bomb": Sparse(torch.ones(3))}, 9)),
                        lambda l: l["extras"]["dict"][0][1].update(shape=[2 ** 40]))
    with pytest.raises(RecordError, match=r"declares 1099511627776 elements in all, more than the 20"):
        decode(extra, "up", expected=EXPECTED)


# ------------------------------------------------------------------ the server's rules (flower.validate)

@pytest.fixture(scope="module")
def fed_and_algorithm():
    from pfl_algorithms.runner import build

    from .common import small_config

    fed, algorithm, _ = build(small_config("fedavg", clients=3, rounds=1))
    return fed, algorithm


def reply(metrics: dict, upload=None, name="pfl.train") -> RecordDict:
    content = RecordDict({name: MetricRecord(metrics)})
    for key, record in (encode(upload, "up") if upload is not None else {}).items():
        content[key] = record
    return content


def test_expected_upload_is_the_cohorts_groups_and_the_partitions_count(fed_and_algorithm):
    from pfl_algorithms.flower.validate import expected_upload

    fed, _ = fed_and_algorithm
    cohort = fed.cohort_of(2)
    expected = expected_upload(fed, 2, senders=3)
    assert set(expected.tensors) == {*cohort.groups.order, "buffers"} and expected.senders == 3
    groups = [shape[0] for name, (shape, _) in expected.tensors.items() if name != "buffers"]
    assert sum(groups) == cohort.params.data.shape[1]
    assert expected.num_examples == fed.clients[2].train.numel()


def test_train_and_eval_replies_are_read_by_the_servers_rules(fed_and_algorithm):
    from pfl_algorithms.flower.validate import eval_result, read_each, train_result

    fed, _ = fed_and_algorithm
    test = int(fed.clients[0].part("test").numel())
    diverged = reply({"loss": float("nan"), "samples": 40, "steps": 1, "finite": 0}, Message({"evil": torch.ones(1)}))
    assert train_result(fed, 0, diverged, 3).upload is None  # not finite: skipped, whatever it sent
    good = train_result(fed, 0, reply({"loss": 0.5, "samples": 40, "steps": 1, "finite": 1}), 3)
    assert good.finite and good.upload is None and good.local.loss == 0.5
    read, refused = read_each({0: reply({"loss": float("nan"), "samples": 40, "steps": 1, "finite": 1}),
                               1: reply({"loss": 0.5, "samples": -1, "steps": 1, "finite": 1}),
                               2: RecordDict({"pfl.train": ConfigRecord({"loss": 0.5})})},
                              lambda c, content: train_result(fed, c, content, 3))
    assert read == {} and refused == {0: "pfl.train: loss nan where finite = 1",
                                      1: "pfl.train: finite 1, samples -1, steps 1: expected finite 0 or 1 and "
                                         "counts >= 0",
                                      2: "pfl.train: missing, or not a MetricRecord"}
    scored = eval_result(fed, 0, reply({"accuracy": 0.25, "loss": 1.5, "samples": test}, name="pfl.eval"))
    assert (scored.accuracy, scored.loss, scored.samples) == (0.25, 1.5, test)
    unscored = eval_result(fed, 0, reply({"accuracy": float("nan"), "loss": float("inf"), "samples": test},
                                         name="pfl.eval"))
    assert unscored.accuracy != unscored.accuracy  # a diverged model: not scored, not a failure
    for metrics in ({"accuracy": 1e9, "loss": 1.0, "samples": test}, {"accuracy": 0.5, "loss": float("inf"),
                                                                       "samples": test},
                    {"accuracy": 0.5, "loss": 1.0, "samples": test + 1}, {"accuracy": 0.5, "loss": 1.0}):
        with pytest.raises(RecordError, match=r"^pfl\.eval: "):
            eval_result(fed, 0, reply(metrics, name="pfl.eval"))


@pytest.mark.parametrize("aggregate", ["raises", "non-finite"])
def test_an_aggregate_that_raises_or_is_not_finite_is_undone_and_its_senders_failed(aggregate, fed_and_algorithm,
                                                                                     monkeypatch):
    import copy

    from pfl_algorithms.engine.rounds import start_round, train_on_executor
    from pfl_algorithms.flower.validate import finish_round_checked

    from ..state_checks import assert_same

    fed, algorithm = fed_and_algorithm
    state, ledger = copy.deepcopy(algorithm.state_dict()), copy.deepcopy(fed.comm.state_dict())
    start = start_round(fed, algorithm, fed.round)
    results = train_on_executor(fed, algorithm, start.tasks)
    original = type(algorithm).aggregate

    def hostile(self, round_, uploads):
        if len(uploads) and aggregate == "raises":
            raise IndexError("index 1000000000 is out of bounds")
        original(self, round_, uploads)
        if len(uploads):
            self.global_model = {name: torch.full_like(t, float("inf")) for name, t in self.global_model.items()}

    monkeypatch.setattr(type(algorithm), "aggregate", hostile)
    record = finish_round_checked(fed, algorithm, start, results, {})
    reason = ("the round's aggregate raised IndexError: index 1000000000 is out of bounds" if aggregate == "raises"
              else "the round's aggregate made state.global_model.")
    assert sorted(record.failed) == [0, 1, 2] and all(r.startswith(reason) for r in record.failed.values())
    assert record.bits_up == 0 and record.train_loss == {}
    assert_same(algorithm.state_dict(), state)
    assert fed.comm.total("up") == sum(b for d, _, b in ledger["by_group"] if d == "up")
