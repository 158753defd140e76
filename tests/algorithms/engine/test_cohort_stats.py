"""Post-training statistics (a class-mean request) in uploads, answered per cohort at once by
every executor: the same as each client computing class_means of its own extractor's
embeddings alone, counted once answered."""
from __future__ import annotations

import pytest
import torch

from pfl_algorithms.api import Algorithm, ClassMeans, Message
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
