"""Post-training statistics (a class-mean request) in uploads, answered per sender by every
executor: the same as each client computing class_means of its own extractor's embeddings
alone, counted once answered, and bitwise the same however the senders are grouped."""
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


def test_requests_are_answered_as_each_client_alone_would():
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
    sender's features over ``inputs``, one ``Senders.features`` call per sender."""

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
def test_an_algorithms_own_statistic_is_answered_per_sender_by_every_executor(executor):
    torch.manual_seed(0)
    algo = AskingOwn()
    SampleCount.calls.clear()
    fed = make_federation(algo, clients=4, sizes=(30, 40, 50, 36), models={"bn": BatchNormNet().double(),
                                                                           "deep": DeepBatchNormNet().double()},
                          architectures=["bn", "deep", "bn", "deep"], executor=executor, workers=2)
    run_round(fed, algo, 0)
    assert sorted(SampleCount.calls) == [[0], [1], [2], [3]]  # one call per sender
    for client, answer in algo.answers.items():
        torch.testing.assert_close(answer, algo.alone[client], rtol=1e-12, atol=1e-12)
    assert set(algo.answers) == set(range(4))


def test_an_answer_is_bitwise_the_same_however_the_senders_are_grouped():
    # What the distributed executor's ranks and Flower's nodes do: answer some of a cohort's
    # senders (one each here) where a sequential run answers them all.  With the digits CNN in
    # float32, one vmapped call over a cohort's padded batches once gave other last bits.
    import copy

    from pfl_algorithms.config import RunConfig, check
    from pfl_algorithms.engine.client import run_train_task
    from pfl_algorithms.engine.cohort_stats import answer_statistics
    from pfl_algorithms.engine.rounds import start_round
    from pfl_algorithms.runner import build

    architectures = ["digits-cnn(embedding_dim=32)", "mlp(hidden=(64, 32))", "fedgen-cnn"]
    config = check(RunConfig(algorithm="fedcma", scenario="dirichlet", clients=6, rounds=1, samples_per_client=40,
                             keep_head_local=False, executor="sequential",
                             scenario_options={"architectures": architectures}))
    fed, algorithm, _ = build(config)
    results = [run_train_task(fed, algorithm, task) for task in start_round(fed, algorithm, 0).tasks]
    assert [len(cohort.clients) for cohort in fed.cohorts] == [2, 2, 2]
    together, alone = [copy.copy(r) for r in results], [copy.copy(r) for r in results]
    answer_statistics(fed, together)
    for result in alone:
        answer_statistics(fed, [result])
    for a, b in zip(together, alone):
        (means_a, counts_a), (means_b, counts_b) = a.upload.extras["class_means"], b.upload.extras["class_means"]
        assert means_a.dtype == torch.float32 and torch.equal(counts_a, counts_b)
        assert torch.equal(means_a, means_b), f"client {a.client}"
