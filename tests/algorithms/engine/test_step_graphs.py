"""Plain training steps as static steps (``captured_steps``), the code a CUDA graph captures.

On a CPU the same code runs uncaptured: the sequential executor's static steps must give
bitwise its host steps' results under SGD (the default optimizer of every algorithm here; the
algorithms whose phases have hooks keep their host steps for those phases) and agree to float
rounding under Adam, whose bias corrections become device tensors.  The batched executor always
runs its whole-chunk plain steps as static steps, so test_batched.py checks them against the
sequential executor; here, that they ran, and how they mix with its general steps.  On CUDA
(``scripts/gpu_check.sh``), captured and uncaptured runs must agree, and the graphs must replay."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from pfl_algorithms.algorithms import ALGORITHMS, make_algorithm
from pfl_algorithms.data.partition import ClientSplit
from pfl_algorithms.engine.federation import EngineSettings
from pfl_algorithms.engine.local import LocalSchedule
from pfl_algorithms.engine.optim import OptimizerSettings
from pfl_algorithms.algorithms.fedavg import FedAvg
from pfl_algorithms.engine.plan import Phase, capturable_hook
from pfl_algorithms.engine.rounds import federation_for, run_round
from pfl_algorithms.engine.step_graphs import LIMIT, WARMUP, StaticStep, StepGraphs, capturable
from pfl_algorithms.models import build_model

from ..algorithms.federation_cases import BatchNormNet, TinyNet, make_federation
from ..state_checks import ADAM_TOL, assert_close_state, assert_same
from .host_reads import HostReadsCounted, HostReadsRefused

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run(name, *, static: bool, executor="sequential", optimizer="sgd", settings=None, models=None,
        sizes=(30, 41, 50)):
    """Two rounds of ``name`` (kept optimizer state, two epochs, a short last batch), with the
    sequential executor's static steps on or off; (round records, federation state, step counts)."""
    algo = make_algorithm(name)
    fed = make_federation(algo, rounds=2, epochs=2, executor=executor, sizes=sizes, optimizer=optimizer,
                          optimizer_settings=settings or {"lr": 0.1, "momentum": 0.9}, optimizer_state="keep",
                          models=models)
    fed.step_graphs.static = static
    records = [run_round(fed, algo, r).as_dict() for r in range(2)]
    for r in records:
        r.pop("wall_s")
    return (records, fed.state_dict(), algo.state_dict()), dict(fed.step_graphs.counts)


PLAIN = ["fedavg", "fedrep", "pfedmb", "fedper", "local", "pfedpara", "factorized-fl-beta", "simfed", "pfedhn",
         "pfedhn-pc"]


@pytest.mark.parametrize("name", PLAIN)
def test_static_sequential_steps_are_bitwise_the_host_steps_under_sgd(name):
    """Phases over some groups only (FedRep's head then body), per-parameter rates (pFedMB's
    lr_scales), factorized and multi-branch models, capturable L1 terms (Factorized-FL's and
    SimFed's), kept momentum."""
    host, host_counts = run(name, static=False)
    static, counts = run(name, static=True)
    assert host_counts["eager"] == 0 and counts["eager"] > 0
    assert_same(static, host)


def test_static_sequential_steps_under_bf16_autocast_are_bitwise_the_host_steps():
    """A step captured under autocast must not keep autocast's cast cache (cache=False): the
    values are the same."""
    runs = []
    for static in (False, True):
        algo = make_algorithm("fedavg")
        fed = make_federation(algo, rounds=2, epochs=2, executor="sequential", sizes=(30, 41, 50),
                              dtype=torch.float32, models=TinyNet(), optimizer_state="keep")
        fed.settings = dataclasses.replace(fed.settings, autocast="bf16")
        fed.step_graphs.static = static
        for r in range(2):
            run_round(fed, algo, r)
        runs.append(fed.state_dict())
        assert fed.step_graphs.counts["eager"] == (28 if static else 0)  # (2 + 2 + 3) steps x 2 epochs x 2 rounds
    assert_same(runs[1], runs[0])


def decay_term(lam: float):
    """(λ/2)‖head‖², a capturable gradient term whose key carries λ."""
    def decay(view):
        w = view.group("head")
        view.grad("head").add_(w, alpha=lam)
        return 0.5 * lam * w.square().sum()

    return capturable_hook(decay, key=("decay", lam))


def shrink_body(view):
    view.group("body").mul_(0.99)


class DecayingFedAvg(FedAvg):  # unnamed: not registered
    """Each client's term has a λ of its own that grows every round, and an after-step hook."""

    def plan(self, client):
        lam = 0.01 * (1 + client) * (1 + self.server.round)
        return (Phase(grad_terms=(decay_term(lam),), after_step=capturable_hook(shrink_body, key="shrink")),)


def test_capturable_hooks_run_in_static_steps_each_client_and_round_its_own():
    """A captured step runs the hooks of the task it was built for: its key carries their keys,
    so a client or round whose λ differs gets a step of its own (a stale λ would show)."""
    def decaying(executor, static):
        algo = DecayingFedAvg()
        fed = make_federation(algo, rounds=2, epochs=2, executor=executor, sizes=(46, 58, 69),
                              optimizer_settings={"lr": 0.1, "momentum": 0.9}, optimizer_state="keep")
        fed.step_graphs.static = static
        for r in range(2):
            run_round(fed, algo, r)
        return (fed.state_dict(), algo.state_dict()), fed.step_graphs

    host, _ = decaying("sequential", False)
    static, graphs = decaying("sequential", True)
    assert graphs.counts["eager"] > 0
    assert_same(static, host)
    batched, graphs = decaying("batched", False)
    assert graphs.counts["eager"] > 0 and len([k for k in graphs._steps if k[0] == "batched"]) == 2  # one per round
    assert_close_state(batched, host, rtol=1e-9, atol=1e-10)
    assert capturable(Phase(grad_terms=(decay_term(0.1),)))
    assert not capturable(Phase(grad_terms=(decay_term(0.1), lambda view: None)))


@pytest.mark.slow  # every algorithm, two runs each
@pytest.mark.parametrize("name", sorted(set(ALGORITHMS) - set(PLAIN)))
def test_every_algorithm_static_or_host_steps_give_bitwise_the_same_run(name):
    """Algorithms with loss terms, gradient terms or custom gradients keep their host steps for
    those phases (``capturable``); their plain phases (fine-tuning, FedDAF's target, ...) run static."""
    host, _ = run(name, static=False)
    static, _ = run(name, static=True)
    assert_same(static, host)


@pytest.mark.parametrize("optimizer,settings", [("adam", {"lr": 0.01}),
                                                ("adamw", {"lr": 0.01, "weight_decay": 0.1})])
def test_static_sequential_adam_agrees_with_the_host_to_rounding(optimizer, settings):
    torch.manual_seed(0)
    host, _ = run("fedavg", static=False, optimizer=optimizer, settings=settings, models=BatchNormNet().double())
    torch.manual_seed(0)
    static, counts = run("fedavg", static=True, optimizer=optimizer, settings=settings,
                         models=BatchNormNet().double())
    assert counts["eager"] > 0
    assert_close_state(static, host, rtol=1e-9, atol=1e-10)


def test_the_batched_executor_mixes_static_and_general_steps():
    """Training sizes 32, 40 and 48 (70% of each client's samples) in batches of 16, two epochs:
    the whole chunk steps as one static step while every client has a full batch (steps 1, 2
    and 4 of a round), and through the general step where sizes differ (step 3: 16, 8, 16) or
    a client is done (step 5 on); the device step count is then taken from the host again
    (Adam, kept state: a stale count would show in the bias corrections)."""
    settings, sizes = {"lr": 0.01}, (46, 58, 69)
    torch.manual_seed(0)
    sequential, _ = run("fedavg", static=False, optimizer="adam", settings=settings, models=BatchNormNet().double(),
                        sizes=sizes)
    torch.manual_seed(0)
    batched, counts = run("fedavg", static=False, executor="batched", optimizer="adam", settings=settings,
                          models=BatchNormNet().double(), sizes=sizes)
    assert counts["eager"] == 2 * 3  # two rounds
    assert_close_state(batched, sequential, **ADAM_TOL)


@pytest.mark.parametrize("maps", [None, "some"], ids=["no-label-maps", "label-maps"])
def test_a_whole_chunks_batches_gathered_at_once_are_each_clients_own(maps):
    """Without augmentation the static step gathers every client's batch in one go (inputs,
    labels, the label maps of the clients that have one): bitwise what the clients' own batches
    give, so the batched run equals the sequential one as closely as ever."""
    label_maps = None if maps is None else [torch.tensor([2, 0, 1]), None, torch.tensor([1, 2, 0])]
    runs = {}
    for executor in ("sequential", "batched"):
        algo = make_algorithm("local")
        fed = make_federation(algo, rounds=2, epochs=2, executor=executor, sizes=(46, 58, 69), label_maps=label_maps,
                              optimizer_settings={"lr": 0.1, "momentum": 0.9})
        records = [run_round(fed, algo, r).as_dict() for r in range(2)]
        for r in records:
            r.pop("wall_s")
        runs[executor] = (records, fed.state_dict())
        if executor == "batched":
            assert fed.step_graphs.counts["eager"] == 6
    assert_close_state(runs["batched"], runs["sequential"], rtol=1e-9, atol=1e-10)


def test_chunks_of_any_size_share_their_cohorts_persistent_rows():
    """Chunks of 2 and 1 clients (chunk=2, 3 clients) both work in the rows of one capacity-2
    set of persistent tensors, the same ones every round (a captured step stays valid)."""
    algo = make_algorithm("fedavg")
    fed = make_federation(algo, rounds=2, executor="batched", sizes=(46, 46, 46))
    fed.executor.chunk = 2
    run_round(fed, algo, 0)
    held = dict(fed.step_graphs._tensors)
    run_round(fed, algo, 1)
    assert list(held) == [("chunk", fed.cohorts[0].name, 2)] and fed.step_graphs._tensors == held
    assert held[("chunk", fed.cohorts[0].name, 2)].params.shape[0] == 2


def test_plans_with_hooks_are_not_captured():
    plain = Phase()
    assert capturable(plain)
    assert not capturable(Phase(loss_terms=(lambda batch: 0.0,)))
    assert not capturable(Phase(grad_terms=(lambda view: None,)))
    assert not capturable(Phase(after_step=lambda view: None))
    assert not capturable(Phase(gradient=lambda view, batches: None, batches_per_step=2))


def test_step_graphs_keep_at_most_limit_steps_and_persistent_tensors_once():
    graphs = StepGraphs(torch.device("cpu"), capture=True)
    assert not graphs.capture and not graphs.static  # nothing to capture on a CPU
    calls = []
    for k in range(LIMIT + 3):
        graphs.run(graphs.step(k, lambda k=k: StaticStep(lambda: calls.append(k), {})))
    assert calls == list(range(LIMIT + 3)) and graphs.counts["eager"] == LIMIT + 3
    assert len(graphs._steps) == LIMIT and 0 not in graphs._steps
    made = graphs.tensors("chunk", lambda: torch.zeros(3))
    assert graphs.tensors("chunk", lambda: torch.ones(3)) is made


class _Stream:
    def wait_stream(self, other):
        pass


class _Graph:
    """A capture of ``fn``: ``StepGraphs.run`` replays it right after capturing, which the
    capture's own run of ``fn`` stands for (``pretend_capture``), so that first replay does nothing."""

    def __init__(self, fn):
        self.fn, self.captured_run_pending = fn, True

    def replay(self):
        if self.captured_run_pending:
            self.captured_run_pending = False
            return
        self.fn()


def pretend_capture(self, step):
    """``StepGraphs._capture`` on a CPU: runs the step as a capture would see it, refusing any
    read of values on the host (``HostReadsRefused``: a real capture fails on those), and
    returns a graph that replays it."""
    with HostReadsRefused():
        step.fn()
    self.counts["captured"] += 1
    return _Graph(step.fn)


@pytest.fixture
def pretend_cuda(monkeypatch):
    """StepGraphs' capture path on a CPU: streams that do nothing, captures that run the step
    with host reads refused, replays that run it again."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(StepGraphs, "_capture", pretend_capture)


def test_each_step_runs_once_warmed_up_then_captured_then_replayed(pretend_cuda, monkeypatch, capsys):
    """A key's first WARMUP steps run eagerly, the next is captured (recorded, not run) and
    replayed, every later one replayed: every call does its step exactly once.  A key whose
    capture fails says so in one line and runs uncaptured from then on."""
    graphs = StepGraphs(torch.device("cpu"), capture=False)
    graphs.capture = True
    done = []
    for _ in range(WARMUP + 3):
        graphs.run(graphs.step("a", lambda: StaticStep(lambda: done.append("a"), {})))
    assert done == ["a"] * (WARMUP + 3)
    assert graphs.counts == {"eager": WARMUP, "captured": 1, "replayed": 3}

    def refuse(self, step):
        raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(StepGraphs, "_capture", refuse)
    for _ in range(WARMUP + 2):
        graphs.run(graphs.step("b", lambda: StaticStep(lambda: done.append("b"), {})))
    assert done.count("b") == WARMUP + 2 and graphs._steps["b"].refused
    err = capsys.readouterr().err
    assert err.count("could not be captured") == 1 and "not permitted when stream is capturing)" in err


def test_a_federation_whose_steps_are_replayed_trains_as_one_run_eagerly(pretend_cuda):
    """Both executors, with the capture path taken (replays of recorded steps): bitwise the
    uncaptured run, so the executors fill the static inputs before every replay."""
    for executor in ("sequential", "batched"):
        results = []
        for capture in (False, True):
            algo = make_algorithm("fedavg")
            fed = make_federation(algo, rounds=2, epochs=2, executor=executor, sizes=(46, 58, 69),
                                  optimizer_settings={"lr": 0.1, "momentum": 0.9}, optimizer_state="keep")
            fed.step_graphs.capture = fed.step_graphs.static = capture
            for r in range(2):
                run_round(fed, algo, r)
            results.append(fed.state_dict())
            if capture:
                assert fed.step_graphs.counts["replayed"] > 0
        assert_same(results[1], results[0])


def captured_against_uncaptured(make, capsys, *, rtol: float, atol: float) -> None:
    """Two rounds of ``make()`` (a fresh (federation, algorithm)) uncaptured, then captured the
    pretend way: each step a capture takes (run with host reads refused, as a CUDA graph
    capture fails on them) is captured, none is refused, and the runs agree."""
    runs = []
    for capture in (False, True):
        torch.manual_seed(0)
        fed, algo = make()
        fed.step_graphs.capture = fed.step_graphs.static = capture
        for r in range(2):
            run_round(fed, algo, r)
        runs.append((fed.state_dict(), algo.state_dict()))
    refused = [key for key, step in fed.step_graphs._steps.items() if step.refused]
    assert "could not be captured" not in capsys.readouterr().err and not refused
    assert fed.step_graphs.counts["captured"] > 0 and fed.step_graphs.counts["replayed"] > 0
    assert_close_state(runs[1], runs[0], rtol=rtol, atol=atol)


# Every algorithm with a phase that ``capturable`` accepts, pFedMB's projected α (its after-step
# hook is declared capturable: no value may be read back in it) and pFedHN's clipping where it
# clips (its default norm 50 is never reached here).
CAPTURED = [(name, {}) for name in PLAIN] + [("pfedmb", {"simplex": "projection"}), ("pfedhn", {"client_clip": 0.05})]


def _ids(cases) -> list[str]:
    return [name + "".join(f"-{v}" for v in settings.values()) for name, settings in cases]


@pytest.mark.parametrize("executor", ["sequential", "batched"])
@pytest.mark.parametrize("name,settings", CAPTURED, ids=_ids(CAPTURED))
def test_every_captured_step_reads_no_value_on_the_host(pretend_cuda, capsys, executor, name, settings):
    def make():
        algo = make_algorithm(name, **settings)
        return make_federation(algo, rounds=2, epochs=2, executor=executor, sizes=(46, 58, 69),
                               optimizer_settings={"lr": 0.1, "momentum": 0.9}, optimizer_state="keep"), algo

    captured_against_uncaptured(make, capsys, rtol=1e-12, atol=1e-12)


CNN_CAPTURED = [("fedavg", {}), ("factorized-fl-beta", {}), ("simfed", {}), ("pfedmb", {}),
                ("pfedmb", {"simplex": "projection"})]


@pytest.mark.parametrize("executor", ["sequential", "batched"])
@pytest.mark.parametrize("name,settings", CNN_CAPTURED, ids=_ids(CNN_CAPTURED))
def test_captured_cnn_steps_read_no_value_on_the_host(pretend_cuda, capsys, executor, name, settings):
    """The same for LeNet-5 (the GPU benchmark's model): its convolutions and pools made
    factorized or multi-branch by the algorithm, on CIFAR-shaped images."""
    gen = torch.Generator().manual_seed(0)
    sizes = (24, 24, 30)
    inputs = torch.randn(sum(sizes), 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (sum(sizes),), generator=gen)
    empty = torch.empty(0, dtype=torch.int64)
    splits = [ClientSplit(train=torch.arange(sum(sizes[:k]), sum(sizes[:k + 1])), val=empty, test=empty)
              for k in range(len(sizes))]

    def make():
        algo = make_algorithm(name, **settings)
        engine = EngineSettings(rounds=2, eval_every=10 ** 6, optimizer=OptimizerSettings(lr=0.05, momentum=0.9),
                                schedule=LocalSchedule(batch_size=8, epochs=1), executor=executor,
                                optimizer_state="keep")
        model = build_model("lenet5", input_shape=(3, 32, 32), num_classes=10)
        return federation_for(algo, model, inputs, labels, splits, engine), algo

    captured_against_uncaptured(make, capsys, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("executor", ["sequential", "batched"])
@pytest.mark.parametrize("name", PLAIN)
def test_host_reads_a_round_do_not_grow_with_its_steps(executor, name):
    """Around its static steps a round reads values on the host (each a device sync on a GPU) a
    fixed number of times, for the checks of its results: three times as many local epochs,
    the same reads, so no step syncs.  The batched executor's clients have equal sizes here, so
    that every step is a whole chunk's static one (its general steps read the host-side step
    counts of the rows they step)."""
    reads = []
    sizes = (46, 58, 69) if executor == "sequential" else (46, 46, 46)
    for epochs in (1, 3):
        algo = make_algorithm(name)
        fed = make_federation(algo, rounds=2, epochs=epochs, executor=executor, sizes=sizes,
                              optimizer_settings={"lr": 0.1, "momentum": 0.9}, optimizer_state="keep")
        fed.step_graphs.static = True
        run_round(fed, algo, 0)
        with HostReadsCounted() as counted:
            run_round(fed, algo, 1)
        reads.append(counted.count)
    assert reads[0] == reads[1], f"{reads[0]} host reads a round with 1 epoch, {reads[1]} with 3"


def test_a_capture_refuses_reads_of_values_on_the_host():
    """The stand-in for a capture refuses what a CUDA capture fails on, and nothing else."""
    x = torch.tensor([1.0, -2.0, 3.0])
    reads = [lambda: x.sum().item(), lambda: bool(x.sum() > 0), lambda: float(x[0]), lambda: x.tolist(),
             lambda: x[x > 0], lambda: torch.nonzero(x), lambda: str(x), lambda: int(x[0]),
             lambda: torch.equal(x, x), lambda: x.unique()]
    for read in reads:
        with HostReadsRefused(), pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            read()
    with HostReadsRefused():  # device work only
        y = torch.where(x > 0, x, x.abs()).sum() + x[torch.tensor([0, 2])].mean()
        x.clone().masked_fill_(x < 0, 0.0)
    assert y.item() == pytest.approx(8.0)


def test_cuda_graphs_is_a_checked_setting():
    with pytest.raises(ValueError, match="cuda_graphs must be True or False"):
        EngineSettings(cuda_graphs="yes")


# ------------------------------------------------------------------------------------ on CUDA

class ConvBatchNormNet(torch.nn.Module):
    """body: Conv2d(1, 4, 3) + BatchNorm2d + ReLU + mean pool; head: Linear(4, 4)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.body(x))


def cuda_federation(executor: str, *, capture: bool, optimizer: str, autocast=None, dtype=torch.float64,
                    rounds=3):
    """FedAvg on CUDA: a BatchNorm CNN, unequal clients, kept optimizer state; (fed, algorithm)."""
    gen = torch.Generator().manual_seed(0)
    sizes = (64, 64, 75)
    inputs = torch.randn(sum(sizes), 1, 12, 12, generator=gen, dtype=dtype)
    labels = torch.randint(0, 4, (sum(sizes),), generator=gen)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    empty = torch.empty(0, dtype=torch.int64)
    splits = [ClientSplit(train=torch.arange(s, s + n - 20), val=empty, test=torch.arange(s + n - 20, s + n))
              for s, n in zip(starts, sizes)]
    settings = {"lr": 0.01} if optimizer == "adam" else {"lr": 0.05, "momentum": 0.9}
    engine = EngineSettings(rounds=rounds, eval_every=10 ** 6, optimizer=OptimizerSettings(optimizer, **settings),
                            schedule=LocalSchedule(batch_size=16, epochs=2), executor=executor,
                            optimizer_state="keep", autocast=autocast, cuda_graphs=capture)
    torch.manual_seed(0)
    algo = make_algorithm("fedavg")
    return federation_for(algo, ConvBatchNormNet().to(dtype), inputs, labels, splits, engine, device="cuda"), algo


def cuda_run(executor: str, *, capture: bool, optimizer: str, autocast=None, dtype=torch.float64, rounds=3):
    """``rounds`` rounds of ``cuda_federation``; (federation state, step counts)."""
    fed, algo = cuda_federation(executor, capture=capture, optimizer=optimizer, autocast=autocast, dtype=dtype,
                                rounds=rounds)
    for r in range(rounds):
        run_round(fed, algo, r)
    return fed.state_dict(), dict(fed.step_graphs.counts)


@cuda
@pytest.mark.parametrize("executor", ["sequential", "batched"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_captured_steps_replay_and_agree_with_uncaptured_ones_on_cuda(executor, optimizer):
    captured, counts = cuda_run(executor, capture=True, optimizer=optimizer)
    plain, _ = cuda_run(executor, capture=False, optimizer=optimizer)
    assert counts["captured"] > 0 and counts["replayed"] > counts["captured"]
    assert_close_state(captured, plain, rtol=1e-9, atol=1e-10)


@cuda
def test_captured_bf16_steps_run_on_cuda():
    captured, counts = cuda_run("batched", capture=True, optimizer="sgd", autocast="bf16", dtype=torch.float32)
    plain, _ = cuda_run("batched", capture=False, optimizer="sgd", autocast="bf16", dtype=torch.float32)
    assert counts["replayed"] > 0
    assert_close_state(captured, plain, rtol=1e-3, atol=1e-4)


@cuda
def test_batched_and_sequential_keep_the_same_state_on_cuda():
    """The batched executor stores each client's rows only where its upload's check holds, on
    the device, and its host step counts after reading every check at once: the state (with
    Adam's moments and step counts kept) equals the sequential executor's."""
    batched, _ = cuda_run("batched", capture=False, optimizer="adam")
    sequential, _ = cuda_run("sequential", capture=False, optimizer="adam")
    steps = batched["cohorts"]["model"]["optimizer_steps"]
    assert steps and all(int(counts.min()) > 0 for counts in steps.values())
    assert_close_state(batched, sequential, rtol=1e-9, atol=1e-10)  # step counts exactly
