"""Post-training statistics (a class-mean request) in uploads, answered per cohort at once by
every executor: the same as each client computing class_means of its own extractor's
embeddings alone, counted once answered."""
from __future__ import annotations

import pytest
import torch

from pfl_algorithms.api import Algorithm, ClassMeans, Message, Statistic
from pfl_algorithms.engine.rounds import run_round
from pfl_kernels.ops import class_means

from ..algorithms.federation_cases import BatchNormNet, DeepBatchNormNet, TinyNet, make_federation


class Asking(Algorithm):
    """Trains alone; uploads the class means of a client-dependent number of its samples, and
    what the client computes of them itself, for comparison."""

    def local_groups(self, *, keep_head_local):
        return {"body", "head"}

    def __init__(self):
        super().__init__()
        self.alone, self.answers = {}, {}

    def upload(self, view):
        indices = view.indices("train")[: 5 + 3 * view.client]  # batches of different lengths
        x, y = view.examples(indices)
        self.alone[view.client] = class_means(view.embed(x), y, 3)
        return Message({}, {"means": ClassMeans(x, y, 3), "other": 1.0})

    def aggregate(self, round_, uploads):
        for client, message in zip(uploads.clients.tolist(), uploads.messages):
            self.answers[client] = message.extras["means"]


def test_requests_are_answered_per_cohort_as_each_client_alone_would():
    torch.manual_seed(0)
    algo = Asking()
    models = {"bn": BatchNormNet().double(), "deep": DeepBatchNormNet().double(), "tiny": TinyNet().double()}
    fed = make_federation(algo, clients=5, sizes=(30, 40, 50, 36, 44), models=models,
                          architectures=["bn", "deep", "bn", "tiny", "deep"], epochs=2)
    for round_ in range(2):
        record = run_round(fed, algo, round_)
    assert set(algo.answers) == set(range(5))
    for client, (means, counts) in algo.answers.items():
        want_means, want_counts = algo.alone[client]
        assert torch.equal(counts, want_counts) and counts.sum() == 5 + 3 * client
        torch.testing.assert_close(means, want_means, rtol=1e-12, atol=1e-12)
        assert means.shape == (3, 6) and means.dtype == torch.float64
    # counted once answered: per client 3 x 6 float64 means, 3 int64 counts and one scalar
    assert record.bits_up == 5 * (18 * 64 + 3 * 64 + 32)


def test_a_class_means_request_is_checked_when_made_and_refused_in_a_download():
    with pytest.raises(ValueError, match=r"labels \[N\] for inputs \[N, ...\]"):
        ClassMeans(torch.zeros(4, 2), torch.zeros(3, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="num_classes must be an int >= 1"):
        ClassMeans(torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64), 0)
    from pfl_algorithms.engine.comm import CommLedger

    message = Message({}, {"means": ClassMeans(torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64), 2)})
    with pytest.raises(TypeError):
        CommLedger().record("down", 0, message)


class SampleCount(Statistic):
    """A statistic of this test's own, to show the request is generic: the sum of each
    sender's features over ``inputs``, one ``Senders.features`` call per cohort."""

    calls: list = []

    def __init__(self, inputs):
        self.inputs = inputs

    @classmethod
    def compute(cls, senders, requests):
        cls.calls.append(list(senders.clients))
        features = senders.features(senders.pad([r.inputs for r in requests]))
        return [features[k, :r.inputs.shape[0]].sum(0) for k, r in enumerate(requests)]


class AskingOwn(Asking):
    def upload(self, view):
        x, _ = view.examples(view.indices("train")[:4 + view.client])
        self.alone[view.client] = view.embed(x).sum(0)
        return Message({}, {"sum": SampleCount(x)})

    def aggregate(self, round_, uploads):
        self.answers.update(zip(uploads.clients.tolist(), uploads.extras("sum")))


@pytest.mark.parametrize("executor", ["sequential", "threaded", "batched"])
def test_an_algorithms_own_statistic_is_answered_per_cohort_by_every_executor(executor):
    torch.manual_seed(0)
    algo = AskingOwn()
    SampleCount.calls.clear()
    fed = make_federation(algo, clients=4, sizes=(30, 40, 50, 36), models={"bn": BatchNormNet().double(),
                                                                           "deep": DeepBatchNormNet().double()},
                          architectures=["bn", "deep", "bn", "deep"], executor=executor, workers=2)
    run_round(fed, algo, 0)
    assert sorted(map(sorted, SampleCount.calls)) == [[0, 2], [1, 3]]  # one call per cohort
    for client, answer in algo.answers.items():
        torch.testing.assert_close(answer, algo.alone[client], rtol=1e-12, atol=1e-12)
    assert set(algo.answers) == set(range(4))
