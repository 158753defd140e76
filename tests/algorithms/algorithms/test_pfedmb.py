"""pFedMB: Eq. 5 / Eq. 6 against float64 references, the two phases, α on the simplex, what
travels, and digits through the CLI with stop / --resume."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from pfl_algorithms.algorithms.pfedmb import ALPHA, PFedMB
from pfl_algorithms.api import Message, Uploads
from pfl_algorithms.engine.rounds import run_round
from pfl_kernels.nn import multibranch_layers
from tests.algorithms.test_kill_resume import assert_resume_bitwise

from .federation_cases import make_federation

pytestmark = pytest.mark.heavy(seconds=25)  # scheduled first under xdist (tests/conftest.py)

TOL = dict(rtol=1e-12, atol=1e-12)
B = 3


def federation(**settings):
    algo = PFedMB(branches=B, **settings)
    return algo, make_federation(algo)


def test_each_branched_tensor_is_weighed_by_its_layers_alpha():
    """The α row of every branched tensor, from where the engine put each α tensor."""
    for shared in (False, True):
        algo, fed = federation(shared_alpha=shared)
        cohort = fed.cohorts[0]
        # TinyNet: body Linear and head Linear, both branched; α one per layer, or one shared.
        assert cohort.groups.members[ALPHA] == (("body.0.alpha_param",) if shared else
                                                 ("body.0.alpha_param", "head.alpha_param"))
        assert algo._alpha_slots(cohort.segments(ALPHA)) == {
            "body.0.branch_weight": 0, "body.0.branch_bias": 0,
            "head.branch_weight": 0 if shared else 1, "head.branch_bias": 0 if shared else 1}
        assert algo._weight_groups == ("branches", "head")


def random_uploads(algo, fed, senders=(0, 2), *, zero_branch=None, gen_seed=1):
    """Uploads with random (non-zero) rows for every group the clients send, α on the simplex."""
    gen = torch.Generator().manual_seed(gen_seed)
    cohort = fed.cohorts[0]
    messages = []
    for k in senders:
        tensors = {g: torch.randn(cohort.span(g).stop - cohort.span(g).start, generator=gen, dtype=torch.float64)
                   for g in ("branches", "head", ALPHA)}
        if zero_branch is not None:  # α as projection keeps it: branch `zero_branch` weighted 0 by everyone
            alpha = torch.rand(len(tensors[ALPHA]) // B, B, generator=gen, dtype=torch.float64)
            alpha[:, zero_branch] = 0
            tensors[ALPHA] = (alpha / alpha.sum(1, keepdim=True)).reshape(-1)
        messages.append(Message(tensors, {}, 10 + 7 * k))
    return Uploads(list(senders), messages)


def reference(fed, uploads, alpha_of, group):
    """Eq. 5 per layer, parameter and branch, in float64, from the model's own parameter list."""
    cohort = fed.cohorts[0]
    start = cohort.span(group).start
    n = uploads.num_examples
    out = []
    for name in cohort.groups.members[group]:
        entry = cohort.layout.by_name[name]
        lo, size = entry.offset - start, math.prod(entry.shape)
        layer = name.rsplit(".", 1)[0]
        w = uploads.stack(group)[:, lo:lo + size].reshape(len(n), B, -1)  # [M, B, P]
        a = torch.stack([alpha_of(m, layer) for m in uploads.messages])  # [M, B]
        weight = n[:, None] * a
        out.append(((weight[:, :, None] * w).sum(0) / weight.sum(0)[:, None]).reshape(-1))
    return torch.cat(out)


def alpha_reader(fed, softmax: bool):
    cohort = fed.cohorts[0]
    names = cohort.groups.members[ALPHA]

    def alpha_of(message, layer):
        name = f"{layer}.alpha_param" if f"{layer}.alpha_param" in names else names[0]  # shared: the first
        lo = names.index(name) * B
        a = message.tensors[ALPHA][lo:lo + B]
        return torch.softmax(a, 0) if softmax else a

    return alpha_of


@pytest.mark.parametrize("shared", [False, True])
def test_eq5_weights_each_branch_by_n_times_alpha(shared):
    algo, fed = federation(shared_alpha=shared)
    uploads = random_uploads(algo, fed)
    algo.aggregate(0, uploads)
    for group in ("branches", "head"):
        torch.testing.assert_close(algo.global_model[group], reference(fed, uploads, alpha_reader(fed, True), group),
                                   **TOL)


def test_eq6_is_plain_sample_weighted_averaging():
    algo, fed = federation(weighting="uniform")
    uploads = random_uploads(algo, fed)
    algo.aggregate(0, uploads)
    for group in ("branches", "head"):
        want = (uploads.weights()[:, None] * uploads.stack(group)).sum(0)
        torch.testing.assert_close(algo.global_model[group], want, **TOL)


def test_projection_alpha_and_a_branch_nobody_weights_keeps_the_plain_average():
    algo, fed = federation(simplex="projection")
    uploads = random_uploads(algo, fed, zero_branch=1)
    algo.aggregate(0, uploads)
    for group in ("branches", "head"):
        got = algo.global_model[group]
        want = reference(fed, uploads, alpha_reader(fed, False), group)
        plain = uploads.stack(group).mean(0)  # branch 1: Σ n α = 0, the unweighted mean (the op's rule)
        start = fed.cohorts[0].span(group).start
        for name in fed.cohorts[0].groups.members[group]:
            entry = fed.cohorts[0].layout.by_name[name]
            lo, size = entry.offset - start, math.prod(entry.shape)
            per_branch = size // B
            b1 = slice(lo + per_branch, lo + 2 * per_branch)
            torch.testing.assert_close(got[b1], plain[b1], **TOL)
            for b in (0, 2):
                part = slice(lo + b * per_branch, lo + (b + 1) * per_branch)
                torch.testing.assert_close(got[part], want[part], **TOL)


def test_the_two_phases_touch_only_their_own_parameters_with_their_own_state():
    algo, fed = federation()
    plan = algo.plan(0)
    assert [p.groups for p in plan] == [(ALPHA,), ("branches", "head")] and [p.state for p in plan] == ["alpha", "weights"]
    cohort = fed.cohorts[0]
    alpha, weights = cohort.span(ALPHA), [cohort.span(g) for g in ("branches", "head")]
    for only in (0, 1):
        algo_one, fed_one = federation()
        algo_one.plan = lambda client, only=only: (algo.plan(client)[only],)
        before = fed_one.cohorts[0].params.data.clone()
        run_round(fed_one, algo_one, 0)
        after = fed_one.cohorts[0].params.data
        assert torch.equal(after[:, alpha], before[:, alpha]) == (only == 1)
        for span in weights:
            assert torch.equal(after[:, span], before[:, span]) == (only == 0)
    # Kept momentum: each phase's state lives in its own bank and only over its own groups.
    algo, fed = PFedMB(branches=B), None
    fed = make_federation(algo, optimizer_settings={"lr": 0.1, "momentum": 0.9}, optimizer_state="keep")
    run_round(fed, algo, 0)
    cohort = fed.cohorts[0]
    momentum = {s: next(iter(banks.values())).data for s, banks in cohort.optimizer_state.items()}
    assert set(momentum) == {"alpha", "weights"}
    assert momentum["alpha"][:, alpha].abs().sum() > 0 and momentum["weights"][:, alpha].abs().sum() == 0
    for span in weights:
        assert momentum["weights"][:, span].abs().sum() > 0 and momentum["alpha"][:, span].abs().sum() == 0


def test_projection_keeps_alpha_on_the_simplex_after_every_step():
    algo, fed = federation(simplex="projection", alpha_lr=5.0)  # big steps would leave the simplex
    for round_ in range(2):
        run_round(fed, algo, round_)
    rows = fed.cohorts[0].params.data[:, fed.cohorts[0].span(ALPHA)].reshape(-1, B)
    assert (rows >= 0).all()
    torch.testing.assert_close(rows.sum(1), torch.ones(len(rows), dtype=rows.dtype), **TOL)
    assert not torch.allclose(rows, torch.full_like(rows, 1 / B))  # α did move


def test_alpha_goes_up_only_under_eq5_and_never_down():
    for weighting, sent in (("alpha", True), ("uniform", False)):
        algo, fed = federation(weighting=weighting)
        run_round(fed, algo, 0)
        assert ALPHA not in algo.configure(1, torch.tensor([0])).tensors
        assert ALPHA not in algo.global_model
        captured = []
        aggregate = algo.aggregate
        algo.aggregate = lambda r, uploads: (captured.append(uploads), aggregate(r, uploads))
        run_round(fed, algo, 1)
        assert (ALPHA in captured[0].names()) == sent


def test_layers_fc_leaves_convolutions_dense_and_bad_settings_name_the_setting():
    from pfl_algorithms.models import build_model
    model = PFedMB(branches=2, layers="fc").prepare_model(build_model("lenet5", input_shape=(3, 32, 32), num_classes=10))
    kinds = [type(m).__name__ for m in multibranch_layers(model)]
    assert kinds == ["MultiBranchLinear"] * 3
    assert all(type(m).__name__ == "Conv2d" for m in model.modules() if "Conv" in type(m).__name__)
    for bad, key in (({"branches": 0}, "branches"), ({"weighting": "alpha-ish"}, "weighting"),
                     ({"simplex": "clip"}, "simplex"), ({"alpha_lr": -1.0}, "alpha_lr"), ({"layers": "conv"}, "layers")):
        with pytest.raises(ValueError, match=key):
            PFedMB(**bad)


@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
def test_digits_loss_goes_down_and_stop_and_resume_is_bitwise(tmp_path):
    pytest.importorskip("sklearn")
    rounds = 4
    args = ["pfedmb", "--dataset", "digits", "--clients", "3", "--rounds", str(rounds), "--quiet",
            "--scenario", "pathological", "--optimizer-state", "keep"]
    reference, state = assert_resume_bitwise(tmp_path, args, rounds, stop_after=2)
    mean = [sum(m["train_loss"].values()) / len(m["train_loss"]) for m in reference]
    assert all(math.isfinite(v) for v in mean) and mean[-1] < mean[0]
    for tensor in state["algorithm"]["global_model"].values():
        assert torch.isfinite(tensor).all()



OPTIMIZERS = [("sgd", {}, torch.optim.SGD), ("sgd", {"momentum": 0.9}, torch.optim.SGD),
              ("adam", {}, torch.optim.Adam)]


@pytest.mark.parametrize("executor", ["threaded", "batched"])
@pytest.mark.parametrize("optimizer,settings,reference", OPTIMIZERS)
def test_branches_step_at_lr_over_alpha_norm_under_every_optimizer(optimizer, settings, reference, executor):
    """Default η_W: each layer's branches step at the run's lr / ‖α_l‖² (client 0's α of the
    round), the rest at the lr, as torch.optim's per-parameter rates: three steps of the W phase
    equal torch.optim with those parameter groups, under SGD, momentum and Adam (a scaled
    gradient, Adam would normalize away)."""
    from dataclasses import replace

    from pfl_algorithms.engine.client import phase_schedule
    from pfl_algorithms.engine.local import client_batches

    lr = 0.01 if optimizer == "adam" else 0.1
    algo = PFedMB(branches=B)
    fed = make_federation(algo, batch_size=8, optimizer=optimizer, optimizer_settings={"lr": lr, **settings},
                          executor=executor)
    weight_phase = replace(algo.plan(0)[1], steps=3)
    algo.plan = lambda client: (weight_phase,)
    cohort = fed.cohorts[0]
    logits = torch.tensor([[0.0, 1.0, -1.0], [2.0, 0.5, 0.5]], dtype=torch.float64)  # the two layers' α logits
    cohort.params.row(0)[cohort.span(ALPHA)] = logits.flatten()
    start = cohort.params.row(0).clone()
    for group, value in algo.configure(0, torch.tensor([0])).tensors.items():
        start[cohort.span(group)] = value
    twin = copy.deepcopy(cohort.module)
    for name, value in cohort.layout.views(start).items():
        dict(twin.named_parameters())[name].data.copy_(value)
    factor = (1.0 / torch.softmax(logits, -1).square().sum(-1)).tolist()
    layer_of = {"body.0.branch_weight": 0, "body.0.branch_bias": 0, "head.branch_weight": 1, "head.branch_bias": 1}
    groups = [{"params": [p], "lr": lr * (factor[layer_of[n]] if n in layer_of else 1.0)}
              for n, p in twin.named_parameters() if not n.endswith("alpha_param")]
    assert len(groups) == 4
    torch_optimizer = reference(groups, **settings)
    generator = fed.generator("train", 0, 0)
    for batch in client_batches(fed.clients[0].train, phase_schedule(weight_phase, fed.settings.schedule), generator):
        torch_optimizer.zero_grad()
        torch.nn.functional.cross_entropy(twin(fed.inputs[batch]), fed.labels[batch]).backward()
        torch_optimizer.step()
    run_round(fed, algo, 0)
    want = torch.cat([dict(twin.named_parameters())[e.name].detach().reshape(-1) for e in cohort.layout.entries])
    torch.testing.assert_close(cohort.params.row(0), want, **TOL)


def test_weight_lr_is_one_plain_rate_for_every_layer():
    from pfl_algorithms.engine.client import phase_optimizer
    algo, fed = federation()
    _, weight_phase = algo.plan(0)
    assert phase_optimizer(weight_phase, fed.settings).lr == pytest.approx(0.1) and weight_phase.lr_scales
    algo, fed = federation(weight_lr=0.02)
    _, weight_phase = algo.plan(0)
    assert phase_optimizer(weight_phase, fed.settings).lr == pytest.approx(0.02) and weight_phase.lr_scales is None


def test_a_shared_alpha_steps_at_the_run_lr_over_the_layers_sharing_it_unless_alpha_lr_is_given():
    from pfl_algorithms.engine.client import phase_optimizer
    for settings, want in (({"shared_alpha": True}, 0.1 / 2), ({"shared_alpha": True, "alpha_lr": 0.03}, 0.03),
                           ({}, 0.1)):
        algo, fed = federation(**settings)
        assert algo._layers == 2  # the tiny net's two Linear layers branch
        assert phase_optimizer(algo.plan(0)[0], fed.settings).lr == pytest.approx(want)


def test_paired_digits_with_a_shared_alpha_stays_finite(tmp_path):
    """The paired experiment's setting (10 clients, 5 pairs, one α for all layers): at the
    run's lr on the shared α every client diverged from round 4 (the default is now lr / L)."""
    from pfl_algorithms.config import RunConfig, check
    from pfl_algorithms.runner import run

    pytest.importorskip("sklearn")
    for weighting in ("alpha", "uniform"):
        out = tmp_path / weighting
        config = check(RunConfig(algorithm="pfedmb", dataset="digits", scenario="pathological", clients=10, rounds=6,
                                 local_epochs=2, batch_size=16, lr=0.05, eval_every=6,
                                 algorithm_settings={"shared_alpha": True, "weighting": weighting}))
        run(config, out, progress=False)
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert all(not m["skipped_non_finite"] for m in lines)


def test_finetuning_is_the_engines_protocol_with_alpha_kept_on_the_simplex():
    """The run's fine-tuning is every method's protocol (each parameter at the run's lr, fresh
    state: plan.finetune_phase), α and the weights together; pFedMB adds only its projection."""
    from pfl_algorithms.engine.plan import finetune_phase

    for simplex, projects in (("softmax", False), ("projection", True)):
        algo, fed = federation(simplex=simplex)
        phase = algo.finetune_phase(0, 1)
        plain = finetune_phase(algo, 0, 1)
        assert (phase.epochs, phase.groups, phase.lr, phase.lr_scale, phase.lr_scales) == \
            (plain.epochs, plain.groups, plain.lr, plain.lr_scale, plain.lr_scales)
        assert set(phase.groups) == {ALPHA, *algo._weight_groups} and (phase.after_step is not None) == projects


def test_finetuning_under_projection_keeps_alpha_on_the_simplex(monkeypatch):
    import pfl_algorithms.engine.client as engine_client
    from pfl_algorithms.engine.rounds import evaluate_all

    algo = PFedMB(branches=B, simplex="projection", alpha_lr=5.0)  # big steps would leave the simplex
    fed = make_federation(algo, finetune_epochs=1)
    run_round(fed, algo, 0)
    scored = []
    original = engine_client.evaluate
    monkeypatch.setattr(engine_client, "evaluate", lambda module, *args, **kwargs: (
        scored.append(torch.cat([layer.alpha_param.detach().reshape(-1, B) for layer in multibranch_layers(module)])),
        original(module, *args, **kwargs))[1])
    evaluate_all(fed, algo)
    assert len(scored) == 3
    for rows in scored:
        assert (rows >= 0).all()
        torch.testing.assert_close(rows.sum(1), torch.ones(len(rows), dtype=rows.dtype), **TOL)
