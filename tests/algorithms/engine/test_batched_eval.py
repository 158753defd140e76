"""The batched executor's evaluation (``batched_eval``) against each client scored alone
(``client.run_eval_task``), in float64: several batches per client of unequal sizes, label maps,
BatchNorm in eval mode, an evaluation download (the global model), an evaluation of another
bank (pFedMe's personal model), a client with nothing to score, a diverged client, and
evaluations that fine-tune first (threaded, so bitwise)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pfl_algorithms.algorithms import make_algorithm
from pfl_algorithms.engine.batched_eval import evaluate_chunk
from pfl_algorithms.engine.client import run_eval_task
from pfl_algorithms.engine.rounds import evaluation_tasks, run_round

from ..algorithms.federation_cases import BatchNormNet, make_federation
from .test_step_graphs import cuda, cuda_federation


def trained(name, *, sizes=(46, 81, 30), label_maps=None, models=None, executor="batched", finetune_epochs=0):
    algo = make_algorithm(name)
    fed = make_federation(algo, rounds=1, sizes=sizes, label_maps=label_maps, models=models, executor=executor,
                          finetune_epochs=finetune_epochs)
    run_round(fed, algo, 0)
    return fed, algo


def alone(fed, tasks):
    return [run_eval_task(fed, task) for task in tasks]


def assert_results_close(batched, reference):
    assert [r.client for r in batched] == [r.client for r in reference]
    for b, r in zip(batched, reference):
        assert b.samples == r.samples
        for got, want in ((b.accuracy, r.accuracy), (b.loss, r.loss)):
            assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("name", ["fedavg", "local", "pfedme", "fedper"])
def test_a_chunk_scores_each_client_as_it_is_scored_alone(name):
    """Batches of 5 (test sets of 14, 25 and 9 samples: 3, 5 and 2 batches, the short ones of
    different sizes), permuted labels, BatchNorm running statistics of each client's own."""
    maps = [torch.randperm(3, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    fed, algo = trained(name, label_maps=maps, models=BatchNormNet().double())
    tasks = evaluation_tasks(fed, algo)
    cohort = fed.cohorts[0]
    assert_results_close(evaluate_chunk(fed, cohort, tasks, batch_size=5), alone(fed, tasks))
    assert_results_close(evaluate_chunk(fed, cohort, tasks[1:], batch_size=512), alone(fed, tasks[1:]))


def test_an_evaluation_download_and_another_bank_are_used():
    fed, algo = trained("pfedme")
    tasks = evaluation_tasks(fed, algo)
    assert tasks[0].evaluation.params != "params"  # its personal model, an extra bank
    fed_avg, avg = trained("fedavg")
    avg_tasks = evaluation_tasks(fed_avg, avg)
    assert avg_tasks[0].evaluation.download is not None  # the global model
    assert_results_close(evaluate_chunk(fed, fed.cohorts[0], tasks, batch_size=4), alone(fed, tasks))
    assert_results_close(evaluate_chunk(fed_avg, fed_avg.cohorts[0], avg_tasks, batch_size=4),
                         alone(fed_avg, avg_tasks))


@pytest.mark.parametrize("name", ["ifca", "factorized-fl-alpha", "factorized-fl-beta"])
def test_begin_hooks_run_on_each_model_of_a_chunk(name):
    """An evaluation plan of begin hooks alone (IFCA chooses its cluster model, Factorized-FL
    zeroes its small μ) is scored in chunks, each client's model changed as when scored alone;
    with fine-tuning after them it goes to threads."""
    from pfl_algorithms.engine.batched_eval import batchable_evaluation

    fed, algo = trained(name)
    tasks = evaluation_tasks(fed, algo)
    assert all(t.evaluation.plan and batchable_evaluation(t) for t in tasks)
    cohort = fed.cohorts[0]
    before = cohort.params.data.clone()
    assert_results_close(evaluate_chunk(fed, cohort, tasks, batch_size=4), alone(fed, tasks))
    assert torch.equal(cohort.params.data, before)  # nothing stored
    fed.settings = dataclasses.replace(fed.settings, finetune_epochs=1)
    assert not any(batchable_evaluation(t) for t in evaluation_tasks(fed, algo))


def test_a_client_with_no_samples_and_a_diverged_client():
    fed, algo = trained("local")
    cohort = fed.cohorts[0]
    fed.clients[0].test = fed.clients[0].test[:0]
    cohort.params.data[cohort.row(2)] = float("inf")
    results = evaluate_chunk(fed, cohort, evaluation_tasks(fed, algo), batch_size=4)
    assert results[0].samples == 0 and math.isnan(results[0].accuracy) and math.isnan(results[0].loss)
    assert math.isnan(results[2].accuracy) and not math.isfinite(results[2].loss)
    assert_results_close(results[1:2], alone(fed, evaluation_tasks(fed, algo)[1:2]))


def test_the_batched_executor_scores_in_chunks_and_sends_fine_tuning_to_threads(monkeypatch):
    """On a CPU it scores on threads by default (slower in chunks there for convolutions)."""
    import pfl_algorithms.engine.batched as batched

    fed, algo = trained("fedavg")
    chunks = []
    monkeypatch.setattr(batched, "evaluate_chunk", lambda *a: chunks.append(len(a[2])) or evaluate_chunk(*a))
    fed.executor.run_eval(fed, evaluation_tasks(fed, algo), lambda t: run_eval_task(fed, t))
    assert chunks == []
    fed.executor.batched_eval = True
    fed.executor.chunk = 2
    tasks = evaluation_tasks(fed, algo)
    assert_results_close(fed.executor.run_eval(fed, tasks, lambda t: run_eval_task(fed, t)), alone(fed, tasks))
    assert chunks == [2, 1]
    ft, ft_algo = trained("fedavg-ft", finetune_epochs=1)
    ft.executor.batched_eval = True
    ft_tasks = evaluation_tasks(ft, ft_algo)
    assert all(t.evaluation.plan for t in ft_tasks)
    got = ft.executor.run_eval(ft, ft_tasks, lambda t: run_eval_task(ft, t))
    assert [(r.accuracy, r.loss) for r in got] == [(r.accuracy, r.loss) for r in alone(ft, ft_tasks)]


@cuda
def test_on_cuda_the_batched_executor_scores_in_chunks_as_each_client_alone():
    fed, algo = cuda_federation("batched", capture=True, optimizer="sgd", rounds=2)
    for r in range(2):
        run_round(fed, algo, r)
    tasks = evaluation_tasks(fed, algo)
    assert_results_close(fed.executor.run_eval(fed, tasks, lambda t: run_eval_task(fed, t)), alone(fed, tasks))
