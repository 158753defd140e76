"""Payload mapping: pfl Messages through Flower records and back, bits kept."""
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402

from pfl_algorithms.api import ClassMeans  # noqa: E402
from pfl_algorithms.engine.messages import Message, Sparse  # noqa: E402
from pfl_algorithms.flower.records import decode, encode  # noqa: E402


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
    tensor = torch.tensor([0.0, 0.2, -0.7, 0.0, 1.5, -0.5])
    message = Message({"mu": Sparse(tensor, threshold, index_bits)})
    records = encode(message, "down")
    kept = Sparse(tensor, threshold).kept()
    assert records["down.tensor.mu"]["values"].numpy().tolist() == tensor[kept].tolist()
    assert records["down.tensor.mu"]["indices"].numpy().tolist() == torch.nonzero(kept).flatten().tolist()
    back = decode(RecordDict(records), "down")
    sent = back.tensors["mu"]
    assert isinstance(sent, Sparse) and (sent.threshold, sent.index_bits) == (threshold, index_bits)
    assert torch.equal(back.dense("mu"), message.dense("mu"))
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


def test_no_message_under_a_prefix_decodes_to_none():
    assert decode(RecordDict(), "down") is None
