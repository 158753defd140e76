"""The contract's server draws (``Server.generator``, ``Server.input_shape``) and client
embeddings (``ClientView.embed``)."""
from __future__ import annotations

import torch

from pfl_algorithms.api import Algorithm
from pfl_algorithms.engine.client import ClientView
from pfl_algorithms.engine.rounds import run_round
from pfl_algorithms.engine.seeds import stream_generator

from ..algorithms.federation_cases import make_federation
from .test_messages import BatchNormNet  # a body with BatchNorm (statistics that train mode would move)


def test_server_generator_is_the_runs_server_stream_and_input_shape_one_example():
    algo = Algorithm()
    make_federation(algo, seed=3)
    server = algo.server
    assert server.input_shape == (4,)
    a = torch.randn(5, generator=server.generator())
    assert torch.equal(a, torch.randn(5, generator=stream_generator(3, "server", -1)))
    assert torch.equal(torch.randn(5, generator=server.generator(2)),
                       torch.randn(5, generator=stream_generator(3, "server", 2)))
    other = Algorithm()
    make_federation(other, seed=4)
    assert not torch.equal(a, torch.randn(5, generator=other.server.generator()))
    assert not torch.equal(a, torch.randn(5, generator=stream_generator(3, "train", -1)))  # a stream of its own


class Embedder(Algorithm):
    """Uploads nothing; keeps each client's embedding of a fixed input and the state around it."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def upload(self, view: ClientView):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0), dtype=view.params.dtype)
        before = (view.buffers.clone(), view.module.training)
        z = view.embed(x)
        after = (view.buffers.clone(), view.module.training)
        module = view.module
        module.eval()
        with torch.no_grad():
            want = module.body(x)
        module.train()
        self.seen[view.client] = (z, want, before, after)
        return None


def test_embed_is_the_bodys_output_in_eval_mode_and_leaves_the_state_alone():
    algo = Embedder()
    fed = make_federation(algo, models=BatchNormNet().double())
    run_round(fed, algo, 0)
    assert sorted(algo.seen) == [0, 1, 2]
    for z, want, (buffers, training), (buffers_after, training_after) in algo.seen.values():
        assert z.shape == (5, 6) and not z.requires_grad
        assert torch.equal(z, want)
        assert torch.equal(buffers, buffers_after) and training and training_after


def test_class_counts_are_each_clients_training_labels_after_its_label_map():
    perm = torch.tensor([2, 0, 1])
    algo = Algorithm()
    fed = make_federation(algo, label_maps=[None, perm, None])
    counts = algo.server.class_counts()
    assert counts.dtype == torch.float64 and counts.shape == (3, 3)
    for k, split in enumerate(fed.clients):
        labels = fed.labels[split.train]
        if k == 1:
            labels = perm[labels]
        want = torch.tensor([float((labels == c).sum()) for c in range(3)], dtype=torch.float64)
        assert torch.equal(counts[k], want)
    counts.zero_()  # a copy: the server's view is not changed through it
    assert algo.server.class_counts().sum() == sum(c.train.numel() for c in fed.clients)


class Drawer(Algorithm):
    """Records each client's draws from its own stream, its training labels and examples."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def upload(self, view: ClientView):
        indices = view.indices("train")
        x, y = view.examples(indices[:3])
        self.seen[(view.round, view.client)] = (torch.rand(2, generator=view.generator()),
                                                torch.rand(2, generator=view.generator(-1)), x, y, indices)
        return None


def test_client_generator_is_the_runs_client_stream_and_examples_are_the_clients_samples():
    perm = torch.tensor([2, 0, 1])
    algo = Drawer()
    fed = make_federation(algo, seed=5, label_maps=[None, perm, None])
    for round_ in range(2):
        run_round(fed, algo, round_)
    for (round_, client), (this_round, whole_run, x, y, indices) in algo.seen.items():
        assert torch.equal(this_round, torch.rand(2, generator=stream_generator(5, "client", round_, client)))
        assert torch.equal(whole_run, torch.rand(2, generator=stream_generator(5, "client", -1, client)))
        assert torch.equal(indices, fed.clients[client].train)
        assert torch.equal(x, fed.inputs[indices[:3]])
        labels = fed.labels[indices[:3]]
        assert torch.equal(y, perm[labels] if client == 1 else labels)
    assert not torch.equal(algo.seen[(0, 0)][0], algo.seen[(1, 0)][0])  # a new stream each round
    assert torch.equal(algo.seen[(0, 0)][1], algo.seen[(1, 0)][1])  # the run's stream is the same
    assert not torch.equal(algo.seen[(0, 0)][1], algo.seen[(0, 1)][1])  # and its own per client
