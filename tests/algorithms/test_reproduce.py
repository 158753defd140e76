"""``pfl reproduce``: the plan of every paper at both scales, a small comparison run end to end
(report.md with the table, claims and plots; every run kept), resumability, paper-scale data
read from a data root with the paper's numbers beside ours, and one-line errors."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pfl_algorithms import runner
from pfl_algorithms.cli import main
from pfl_algorithms.reproduce import PAPERS, reproduce
from pfl_algorithms.reproduce import papers as papers_module
from pfl_algorithms.reproduce.campaign import plan, slug
from pfl_algorithms.reproduce.papers import Claim, Method, Paper, Setting
from tests.algorithms.fake_files import write_cifar
from tests.algorithms.state_checks import file_tree

pytestmark = pytest.mark.heavy(seconds=60)  # scheduled first under xdist (tests/conftest.py)

TINY_BASE = dict(dataset="digits", model="mlp", clients=4, rounds=2, local_epochs=1, batch_size=16, lr=0.05,
                 workers=1)


def tiny_paper(**changes) -> Paper:
    paper = Paper(
        name="tiny", title="A tiny paper", table="Table 1",
        methods=(Method("Stand-Alone", "local"), Method("FedAvg", "fedavg"),
                 Method("FedProx", "fedprox", {"mu": 0.1})),
        base={"cpu": TINY_BASE, "paper": dict(TINY_BASE, dataset="cifar10")},
        settings={"cpu": (Setting("IID", {"scenario": "iid"}),
                          Setting("Permuted IID", {"scenario": "permuted-iid"}, {"fedprox": {"mu": 0.5}})),
                  "paper": (Setting("CIFAR-10 IID", {"scenario": "iid"}),)},
        claims=(Claim("FedAvg", "<", "Stand-Alone", "Permuted"), Claim("FedProx", ">", "FedAvg", "Nowhere")),
        paper_numbers={("FedAvg", "CIFAR-10 IID"): (70.28, 0.5), ("Stand-Alone", "CIFAR-10 IID"): (64.31, None)},
        paper_costs={("FedAvg", "CIFAR-10 IID"): 20.39},
        notes=("a note",))
    return dataclasses.replace(paper, **changes)


@pytest.fixture
def tiny(monkeypatch):
    paper = tiny_paper()
    monkeypatch.setitem(papers_module.PAPERS, "tiny", paper)
    return paper


@pytest.mark.parametrize("scale", ["cpu", "paper"])
@pytest.mark.parametrize("name", sorted(PAPERS))
def test_every_paper_plans_every_run(name, scale, tmp_path):
    """Every method × setting × seed of each paper has a valid config at both scales (no
    training, no data read): a typo in a spec, or a method not registered, fails here."""
    paper = PAPERS[name]
    runs = plan(paper, scale, 2, tmp_path)
    cells = sum(setting.runs(method) for setting in paper.settings[scale] for method in paper.methods)
    assert len(runs) == cells * 2 and cells >= len(paper.settings[scale])
    assert len({r.out for r in runs}) == len(runs)
    # Every row with a cell at this scale runs (Fed-CMA's pFedHN rows: Table 3, paper scale only).
    assert {r.config.algorithm for r in runs} == {m.algorithm for m in paper.methods
                                                  if any(s.runs(m) for s in paper.settings[scale])}
    assert all(any(s.runs(m) for s in paper.settings["paper"]) for m in paper.methods)
    text = reproduce(name, scale=scale, seeds=2, out=tmp_path, dry_run=True)
    assert f"{len(runs)} runs" in text and not any(tmp_path.iterdir())


def test_paper_numbers_name_real_rows_and_columns():
    for paper in PAPERS.values():
        labels = {s.label for s in paper.settings["paper"]}
        methods = {m.label for m in paper.methods}
        for method, setting in [*paper.paper_numbers, *paper.paper_costs]:
            assert method in methods and setting in labels, (paper.name, method, setting)
        for claim in paper.claims:
            assert {claim.method, claim.other} <= methods
            assert any(claim.setting_contains in s.label for scale in paper.settings for s in paper.settings[scale])


def test_settings_reach_the_run_config(tiny, tmp_path):
    runs = {(r.method.label, r.setting.label, r.seed): r for r in plan(tiny, "cpu", 2, tmp_path)}
    permuted = runs[("FedProx", "Permuted IID", 1)]
    assert permuted.config.algorithm_settings == {"mu": 0.5} and permuted.config.seed == 1
    assert runs[("FedProx", "IID", 0)].config.algorithm_settings == {"mu": 0.1}
    assert permuted.config.scenario == "permuted-iid" and permuted.config.clients == 4
    assert permuted.out == tmp_path / "permuted-iid" / "fedprox" / "seed1"
    assert slug("CIFAR-10 Standard Non-IID") == "cifar-10-standard-non-iid"


def test_cpu_comparison_end_to_end_writes_report_md_and_json_then_resumes_without_training(tiny, tmp_path,
                                                                                           monkeypatch, capsys):
    out = tmp_path / "rep"
    assert main(["reproduce", "tiny", "--seeds", "2", "--out", str(out), "--quiet"]) == 0
    report = (out / "report.md").read_text()
    runs = plan(tiny, "cpu", 2, out)
    for run in runs:  # every run directory is kept, finished
        assert json.loads((run.out / "summary.json").read_text())["rounds"] == 2
    # The table as the paper lays it out: one row per method, one column per setting, mean ± std.
    assert "| Method | IID | Permuted IID |" in report
    summaries = [json.loads((r.out / "summary.json").read_text()) for r in runs
                 if r.method.label == "FedAvg" and r.setting.label == "IID"]
    accuracies = [100 * s["final_mean_accuracy"] for s in summaries]
    mean, std = np.mean(accuracies), np.std(accuracies, ddof=1)
    row = next(line for line in report.splitlines() if line.startswith("| FedAvg |"))
    assert row.split(" | ")[1] == f"{mean:.2f} ± {std:.2f}"
    # Communication in GB (the papers' unit): the ledger's gigabits / 8, mean over seeds.
    gigabytes = [(s["comm_gb"]["up"] + s["comm_gb"]["down"]) / 8 for s in summaries]
    comm_row = [line for line in report.splitlines() if line.startswith("| FedAvg |")][1]
    assert comm_row.split(" | ")[1] == f"{np.mean(gigabytes):.4f} ± {np.std(gigabytes, ddof=1):.4f}"
    assert "## Communication (GB" in report and "(70.28" not in report  # the paper's numbers only at paper scale
    # Claims: checked where a setting names them, with our numbers.
    assert "- Permuted IID: FedAvg is below Stand-Alone: " in report and "Nowhere" not in report
    assert "- a note" in report
    plots = sorted(p.name for p in (out / "plots").glob("*.png"))
    assert plots == sorted(f"{s}_{k}.png" for s in ("iid", "permuted-iid")
                           for k in ("accuracy_vs_round", "accuracy_vs_bits"))
    # report.json: the cells per seed and each claim's verdict with its interval
    document = json.loads((out / "report.json").read_text())
    assert document["seeds"] == [0, 1] and document["budget"]
    cell = next(c for c in document["cells"] if (c["method"], c["setting"]) == ("FedAvg", "IID"))
    assert set(cell["accuracy_per_seed"]) == {"0", "1"}
    claim = next(c for c in document["claims"] if c["setting"] == "Permuted IID")
    assert claim["verdict"] in ("holds", "does not hold", "inconclusive") and claim["seeds"] == [0, 1]
    assert claim["interval_method"].startswith("paired Student-t")
    assert f"**{claim['verdict']}**" in report and "## Budget" in report

    # A second call trains nothing: every run is finished.
    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(runner, "run", no_training)
    before = report
    assert main(["reproduce", "tiny", "--seeds", "2", "--out", str(out), "--quiet"]) == 0
    assert (out / "report.md").read_text() == before


def test_a_stopped_comparison_resumes(tiny, tmp_path):
    out = tmp_path / "rep"
    runs = plan(tiny, "cpu", 1, out)
    runner.run(runs[0].config, runs[0].out, progress=False, stop_after=1)  # killed after one round
    reproduce("tiny", seeds=1, out=out, progress=False)
    history = (runs[0].out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in history] == [0, 1]


def test_paper_scale_reads_the_data_root_and_sets_the_papers_numbers_beside_ours(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("PFL_NO_TORCHVISION", "1")
    write_cifar(tmp_path / "data", "cifar10", (16, 16), np.random.default_rng(0))
    out = tmp_path / "rep"
    report = reproduce("tiny", scale="paper", seeds=1, out=out, data_root=str(tmp_path / "data"),
                       progress=False).read_text()
    assert "| Method | CIFAR-10 IID |" in report
    fedavg = next(line for line in report.splitlines() if line.startswith("| FedAvg |"))
    assert "(70.28 ± 0.50)" in fedavg
    stand_alone = next(line for line in report.splitlines() if line.startswith("| Stand-Alone |"))
    assert "(64.31)" in stand_alone
    assert "(20.39)" in report
    config = json.loads((out / "cifar-10-iid" / "fedavg" / "seed0" / "config.json").read_text())
    assert config["dataset"] == "cifar10" and config["data_root"] == str(tmp_path / "data")


def test_missing_paper_data_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PFL_NO_TORCHVISION", "1")
    code = main(["reproduce", "tiny", "--scale", "paper", "--seeds", "1", "--out", str(tmp_path / "r"),
                 "--data-root", str(tmp_path / "nothing"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("pfl: error:") and "cifar" in err[0].lower()


@pytest.mark.parametrize("argv, needle", [
    (["reproduce", "no-such-paper"], "paper"),
    (["reproduce", "simfed", "--seeds", "0"], "--seeds"),
    (["reproduce", "simfed", "--scale", "huge"], "--scale"),
])
def test_bad_arguments_are_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


def test_finished_runs_with_other_settings_are_refused(tiny, tmp_path, capsys, monkeypatch):
    out = tmp_path / "rep"
    reproduce("tiny", seeds=1, out=out, progress=False)
    monkeypatch.setitem(papers_module.PAPERS, "tiny", tiny_paper(base={"cpu": dict(TINY_BASE, lr=0.1),
                                                                       "paper": TINY_BASE}))
    assert main(["reproduce", "tiny", "--seeds", "1", "--out", str(out), "--quiet"]) == 2
    assert "other settings: lr (now 0.1, then 0.05)" in capsys.readouterr().err
    # More rounds than the finished runs have: they go on, as if started with them.
    monkeypatch.setitem(papers_module.PAPERS, "tiny", tiny_paper(base={"cpu": dict(TINY_BASE, rounds=3),
                                                                       "paper": TINY_BASE}))
    assert main(["reproduce", "tiny", "--seeds", "1", "--out", str(out), "--quiet"]) == 0
    assert {json.loads(p.read_text())["rounds"] for p in out.rglob("summary.json")} == {3}


def test_pfedmb_tables_run_their_own_rows_with_fine_tuning(tmp_path):
    """Table 1's column runs its four rows (α shared by all layers), Table 2's columns their nine;
    pFedMB with and without α-weighting get their own folders; every run fine-tunes E epochs."""
    paper = PAPERS["pfedmb"]
    for scale in ("cpu", "paper"):
        runs = plan(paper, scale, 1, tmp_path)
        by_setting = {}
        for run in runs:
            by_setting.setdefault(run.setting.label, []).append(run)
            # The paper's E fine-tuning epochs; one at CPU scale (a budget in steps there).
            assert run.config.finetune() == (run.config.local_epochs if scale == "paper" else 1)
        paired = by_setting.pop("Paired, 10 clients")
        assert [r.method.label for r in paired] == ["Local", "FedAvg", "pFedMB w/o α-weighting", "pFedMB"]
        assert {r.out.parent.name for r in paired} == {"local", "fedavg", "pfedmb-weighting-uniform", "pfedmb"}
        assert all(r.config.algorithm_settings.get("shared_alpha") for r in paired if r.config.algorithm == "pfedmb")
        assert paired[2].config.algorithm_settings["weighting"] == "uniform" and paired[0].config.clients == 10
        # The CPU scale runs only the Dirichlet 15-client column of Table 2 (its claim's; cost).
        assert len(by_setting) == (4 if scale == "paper" else 1) and all(len(rows) == 9 for rows in by_setting.values())
        if scale == "paper":
            fifty = by_setting["Dirichlet, 50 clients"][0].config
            assert (fifty.clients, fifty.clients_per_round, fifty.scenario) == (50, 10, "dirichlet")
            assert by_setting["Random 2 classes, 15 clients"][0].config.scenario_options["layout"] == "random"
    paper_runs = plan(paper, "paper", 1, tmp_path)
    assert {(r.config.dataset, r.config.model, r.config.local_epochs, r.config.batch_size) for r in paper_runs} == {
        ("cifar10", "lenet5", 5, 64)}



def test_feddaf_grid_k_sweep_and_the_targets_metric(tmp_path):
    """Table 1's nine scarcity × noise columns run its six rows; the scarcity-0.05 columns also
    run the k sweep (Table 3); the domain columns exist at paper scale only; cells report the
    target's best accuracy, and the plots its accuracy per round."""
    from pfl_algorithms.reproduce.report import _history, cell_results

    paper = PAPERS["feddaf"]
    assert paper.metric == "target_best_accuracy"
    cpu = plan(paper, "cpu", 1, tmp_path)
    labels = {r.setting.label for r in cpu}
    # CPU scale (cost): scarcities 0.05 and 0.25 at noise 0.6 on MNIST, Table 3's k at 1 and 10, no cap
    # on the target's share; only the target is evaluated (its accuracy is the table's).
    assert labels == {f"Scarcity {s}, noise 0.6" for s in (0.05, 0.25)}
    assert all(r.config.scenario == "fda" and r.config.dataset == "mnist" and r.config.samples_per_client is None
               and r.config.eval_role == "target" for r in cpu)
    k_runs = [r for r in cpu if r.method.label.startswith("FedDAF k=")]
    assert {r.setting.label for r in k_runs} == {"Scarcity 0.05, noise 0.6"}
    assert sorted({r.config.algorithm_settings["k"] for r in k_runs}) == [1.0, 10.0]
    full_k = [r for r in plan(paper, "paper", 1, tmp_path) if r.method.label.startswith("FedDAF k=")]
    assert sorted({r.config.algorithm_settings["k"] for r in full_k}) == [0.5, 1.0, 2.0, 3.0, 4.0, 10.0]
    daf = next(r for r in cpu if r.method.label == "FedDAF" and r.setting.label == "Scarcity 0.25, noise 0.6")
    assert daf.config.scenario_options["target_fraction"] == 0.25 and daf.config.scenario_options["noise"] == 0.6
    # Every method that trains the target trains it alike: one epoch at the run's lr and batch.
    for run in cpu:
        if run.config.algorithm in ("feddaf", "fedgp", "feddwa", "target-only"):
            assert {k: run.config.algorithm_settings[k] for k in ("target_lr", "target_batch_size",
                                                                   "target_epochs")} == {
                "target_lr": 0.05, "target_batch_size": 32, "target_epochs": 1}
    paper_labels = {r.setting.label for r in plan(paper, "paper", 1, tmp_path)}
    assert {"PACS P", "VLCS S", "Office-Caltech-10 W"} <= paper_labels and len(paper_labels) == 9 + 12
    run = next(r for r in plan(paper, "paper", 1, tmp_path)
               if r.method.label == "FedDAF" and r.setting.label == "Scarcity 0.5, noise 0.9")
    run.out.mkdir(parents=True)
    (run.out / "summary.json").write_text(json.dumps({"target_client": 10, "target_best_accuracy": 0.5,
                                                       "final_mean_accuracy": 0.9, "comm_gb": {"up": 8, "down": 8}}))
    lines = [{"round": r, "comm_gb": {"up": r, "down": r}, "eval": {"mean_accuracy": 0.9, "accuracy": {"10": a}}}
             for r, a in ((0, 0.25), (1, 0.5))]
    (run.out / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    cells = cell_results([run], paper.metric)
    assert cells[("FedDAF", "Scarcity 0.5, noise 0.9")]["accuracy"] == (50.0, None)  # one seed: no spread
    assert [h[1] for h in _history(run, paper.metric)] == [25.0, 50.0]


def test_fedcma_table2_toy_and_table3(tmp_path):
    """Table 2's Dirichlet columns run Local, FedAvg on the classifier, FedGen and Fed-CMA over
    three extractors; the toy is the paper's 2-2-4 network with a sigmoid latent on 4 clients;
    at paper scale FEMNIST and Table 3 (CIFAR-10 against pFedHN) join, with the paper's numbers."""
    paper = PAPERS["fedcma"]
    cpu = plan(paper, "cpu", 1, tmp_path)
    by_setting = {}
    for run in cpu:
        by_setting.setdefault(run.setting.label, []).append(run)
    # CPU scale: MNIST (the paper's data) at α 0.02, the column of the paper's largest gain (cost).
    assert set(by_setting) == {"MNIST α=0.02", "Gaussian mixture, 4 clients"}
    for label, runs in by_setting.items():
        assert {r.config.algorithm for r in runs} == {"local", "fedavg-classifier", "fedgen", "fedcma"}
    alpha = by_setting["MNIST α=0.02"][0].config
    assert alpha.scenario == "dirichlet" and alpha.scenario_options["alpha"] == 0.02 and alpha.clients == 20
    assert alpha.dataset == "mnist"
    assert len(set(alpha.scenario_options["architectures"])) == 3
    toy = by_setting["Gaussian mixture, 4 clients"][0].config
    assert (toy.dataset, toy.clients, toy.model) == ("gaussian-mixture", 4, "mlp")
    assert toy.model_options == {"hidden": (2, 2), "activation": None, "embedding_activation": "sigmoid"}
    assert "architectures" not in toy.scenario_options
    full = plan(paper, "paper", 1, tmp_path)
    cifar = [r for r in full if r.setting.label.startswith("CIFAR-10")]
    assert {r.config.algorithm for r in cifar} == {"pfedhn", "pfedhn-pc", "fedcma"}
    assert {r.config.clients for r in cifar} == {10, 50, 100}
    assert {(r.config.model, r.config.scenario_options["layout"]) for r in cifar} == {("pfedhn-cnn", "pfedhn")}
    femnist = [r for r in full if r.setting.label == "FEMNIST"]
    assert {r.config.algorithm for r in femnist} == {"local", "fedavg-classifier", "fedcma"}
    assert femnist[0].config.sample == 0.5 and femnist[0].config.scenario == "natural"
    emnist = next(r for r in full if r.setting.label == "EMNIST α=0.1")
    assert emnist.config.dataset == "emnist" and emnist.config.dataset_options == {"split": "letters"}
    assert paper.paper_numbers[("FedCMA", "MNIST α=0.02")] == (79.22, 0.74)
    assert paper.paper_numbers[("pFedHN-PC", "CIFAR-10, 100 workers")] == (80.81, None)
    assert [(c.method, c.other, c.setting_contains) for c in paper.claims] == [
        ("FedCMA", "Local", "MNIST"), ("FedCMA", "FedAvg", "MNIST"), ("FedCMA", "FedGen", "MNIST")]


def test_fedcma_claims_cover_every_table2_column():
    """§6: "Fed-CMA outperforms all the baselines" on Table 2: every MNIST and EMNIST α and FEMNIST
    (the filter "α=0.0" left out α=0.1 and FEMNIST, where the paper's EMNIST α=0.1 row contradicts
    it); not Table 3 (two of three, the paper says) nor the toy (figures only)."""
    paper = PAPERS["fedcma"]
    table2 = {setting for _, setting in paper.paper_numbers if not setting.startswith("CIFAR-10")}
    assert len(table2) == 9
    for other in ("Local", "FedAvg"):
        claim = next(c for c in paper.claims if c.other == other)
        for scale in ("cpu", "paper"):
            covered = {s.label for s in paper.settings[scale] if claim.setting_contains in s.label}
            assert covered == {s.label for s in paper.settings[scale] if "MNIST" in s.label}
        assert {s for s in table2 if claim.setting_contains in s} == table2
        assert "EMNIST α=0.1" in claim.note and claim.report_note in paper.notes


def _claim_cells(paper):
    """(claim, setting, paper's own cell, other's cell) wherever the paper has both cells."""
    for claim in paper.claims:
        for setting in paper.settings["paper"]:
            if claim.setting_contains not in setting.label:
                continue
            a = paper.paper_numbers.get((claim.method, setting.label))
            b = paper.paper_numbers.get((claim.other, setting.label))
            if a is not None and b is not None:
                yield claim, setting.label, a[0], b[0]


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_every_claim_agrees_with_the_papers_own_numbers_or_says_it_does_not(name):
    """On every column a claim covers where the paper's table has both cells, the paper's own
    numbers satisfy the claim, or the claim carries a note naming that column, reported in the
    report's notes; and a note is never on a claim the paper's numbers do not contradict."""
    paper = PAPERS[name]
    contradicted = {}
    for claim, label, mine, other in _claim_cells(paper):
        if not claim.holds(mine, other):
            contradicted.setdefault(claim, []).append(label)
    for claim, labels in contradicted.items():
        assert claim.note, (name, claim, labels)
        assert all(label in claim.note for label in labels), (claim.note, labels)
        assert claim.report_note in paper.notes
    assert all(claim in contradicted for claim in paper.claims if claim.note)
    # The note reaches the report (its notes), even where a paper is built with notes of its own.
    noted = dataclasses.replace(tiny_paper(), claims=(Claim("FedAvg", "<", "Stand-Alone", "Permuted", note="n"),))
    assert noted.notes == ("a note", noted.claims[0].report_note)
    assert dataclasses.replace(noted).notes == noted.notes


def test_simfed_multi_domain_splits_each_domain_as_the_paper(tmp_path):
    """§5.1: each multi-domain client's 3,000 images split 2,400/150/450 (80/5/15), not 80/10/10."""
    from pfl_algorithms.data.scenarios import split_sizes

    runs = [r for r in plan(PAPERS["simfed"], "paper", 1, tmp_path)
            if r.setting.label == "CIFAR-100 Multi-domain"]
    assert runs and {tuple(r.config.scenario_options["split"]) for r in runs} == {(0.8, 0.05, 0.15)}
    assert split_sizes(3000, runs[0].config.scenario_options["split"]) == (2400, 150, 450)


def test_fedcma_notes_say_what_runs(tmp_path):
    """Table 3's note names the one difference between its networks (Fed-CMA's sigmoid
    embeddings, the others' ReLU), and the Table 2 note says the paper is ambiguous about one
    network or three."""
    paper = PAPERS["fedcma"]
    activations = {r.method.label: r.config.model_options.get("embedding_activation", "relu")
                   for r in plan(paper, "paper", 1, tmp_path)
                   if r.setting.label == "CIFAR-10, 10 workers"}
    assert activations == {"pFedHN": "relu", "pFedHN-PC": "relu", "FedCMA": "sigmoid"}
    table3 = next(n for n in paper.notes if "Table 3 follows" in n)
    assert "sigmoid" in table3 and "ReLU" in table3 and "ReLU embeddings) for all three" not in table3
    assert any("ambiguous" in n and "Zhu et al." in n for n in paper.notes)


# ---------------------------------------------------------------- honest statistics and budgets


@pytest.mark.parametrize("relation, differences, verdict", [
    (">", [2.0, 3.0, 2.5, 3.5, 2.2], "holds"),            # every seed above: the interval lies above 0
    (">", [-2.0, -3.0, -2.5, -3.5, -2.2], "does not hold"),  # every seed below
    (">", [2.0, -3.0, 1.0, -1.0, 0.5], "inconclusive"),   # straddles 0
    (">", [5.0], "inconclusive"),                          # one seed pair: no interval
    ("<", [-1.0, -1.2, -0.8], "holds"),
    ("<", [1.0, 1.2, 0.8], "does not hold"),
    (">=", [0.0, 0.0, 0.0], "holds"),                      # equal on every seed: at or above
    (">=", [-1.0, -1.2, -0.8], "does not hold"),
    (">=", [1.0, -1.2, 0.8], "inconclusive"),
])
def test_claim_verdict_on_hand_made_numbers(relation, differences, verdict):
    from pfl_algorithms.reproduce.report import judge

    claim = Claim("A", relation, "B", "X")
    other = {seed: 50.0 + seed for seed in range(len(differences))}
    mine = {seed: other[seed] + d for seed, d in enumerate(differences)}
    mine[99] = 100.0  # a seed only one side finished is not paired
    result = judge(claim, mine, other)
    assert result["verdict"] == verdict and result["seeds"] == list(range(len(differences)))
    assert result["differences"] == pytest.approx(differences)
    if len(differences) > 1:
        low, high = result["interval"]
        half = {5: 2.7764, 3: 4.3027}[len(differences)] * np.std(differences, ddof=1) / np.sqrt(len(differences))
        assert (low, high) == pytest.approx((np.mean(differences) - half, np.mean(differences) + half))
    else:
        assert result["interval"] is None


def test_t_quantile_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    from pfl_algorithms.reproduce.report import t_quantile_975

    for df in (1, 2, 4, 10, 30, 31, 50, 200):
        assert t_quantile_975(df) == pytest.approx(stats.t.ppf(0.975, df), abs=2e-3)


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_every_method_of_a_table_makes_the_same_optimizer_steps(name, tmp_path):
    """At CPU scale each setting's planned runs make one number of optimizer steps per client and
    round, whatever the method: pFedMB's two phases share the budget (half each), Per-FedAvg
    counts outer steps (its local_steps).  FedDAF's table has roles, whose budget is checked
    against the engine in ``test_feddaf_budget_line_gives_each_role_as_the_engine_trains_it``."""
    from pfl_algorithms.reproduce.campaign import ROLE_SCENARIOS, run_steps
    from pfl_algorithms.reproduce.papers import CPU_STEPS

    for quick in (False, True):
        runs = [r for r in plan(PAPERS[name], "cpu", 2, tmp_path, quick=quick)
                if r.config.scenario not in ROLE_SCENARIOS]
        for label in {r.setting.label for r in runs}:
            steps = {r.method.label: run_steps(r) for r in runs if r.setting.label == label}
            assert set(steps.values()) == {CPU_STEPS}, (name, label, steps)
        for run in runs:
            if run.config.algorithm == "pfedmb":
                assert run.config.local_steps == CPU_STEPS // 2
            elif run.config.algorithm == "per-fedavg":
                assert run.config.local_steps == CPU_STEPS


def test_feddaf_budget_line_gives_each_role_as_the_engine_trains_it(tmp_path):
    """The budget line said "10 optimizer steps per client and round for every method", but the
    target of FedDAF, FedGP, FedDWA and Target only trains one epoch (4 steps of 100 images at
    batch 32): the line gives a source's and the target's round apart, by method, and what it
    says is what the engine runs (on a small stand-in dataset with the same algorithm settings)."""
    import math
    import re

    from pfl_algorithms.config import check, config_from
    from pfl_algorithms.reproduce.campaign import budget_lines, describe

    paper = PAPERS["feddaf"]
    runs = plan(paper, "cpu", 1, tmp_path)
    lines = budget_lines(runs)
    assert len(lines) == 2 and not any("for every method" in line for line in lines)
    line = lines[0]
    assert line.startswith("Scarcity 0.05, noise 0.6: per round, a source trains 10 optimizer steps (FedAvg, ")
    assert "10 + 10 optimizer steps (FedDWA), nothing (Target only)" in line
    # Every method's target trains alike, FedAvg's too (the paper, §5.2.4): it made 10 steps.
    assert ("the target trains 1 epoch of its training data at batch 32 (FedAvg, FedAvg FT, FedGP, Target only, "
            "FedDAF, FedDAF k=1, FedDAF k=10)") in line
    assert "2 passes of 1 epoch of its training data at batch 32 (FedDWA)" in line
    assert all(f"budget: {b}" in describe(paper, "cpu", 1, tmp_path, runs) for b in lines)  # the dry run
    assert budget_lines(plan(paper, "cpu", 3, tmp_path)) == lines  # each method named once, whatever the seeds
    # The paper scale: epochs, the target's own batch and lr for the methods with target settings.
    paper_line = budget_lines(plan(paper, "paper", 1, tmp_path))[0]
    assert ("the target trains 1 epoch of its training data at batch 16, lr 0.001 (FedAvg, FedAvg FT, FedGP, "
            "Target only, FedDAF") in paper_line
    assert "2 passes of 1 epoch of its training data at batch 16, lr 0.001 (FedDWA)" in paper_line
    # What the engine runs: each row of the first column, on digits for MNIST (no real data read).
    import torch

    from pfl_algorithms.engine.client import phase_schedule
    from pfl_algorithms.engine.local import client_batches
    from pfl_algorithms.reproduce.campaign import role_plans, role_text

    for run in runs:
        if run.setting.label != "Scarcity 0.05, noise 0.6" or run.method.label.startswith("FedDAF k="):
            continue
        values = {**dataclasses.asdict(run.config), "dataset": "digits", "model": "mlp", "model_options": {},
                  "rounds": 1, "scenario_options": {**run.config.scenario_options, "target_fraction": 1.0}}
        config = check(config_from(values))
        fed, algorithm, _ = runner.build(config)
        target = int(fed.roles["target"][0])
        texts = {role: role_text(run, phases) for role, phases in role_plans(run).items()}
        for role, client in (("source", 0), ("target", target)):
            steps = sum(sum(1 for _ in client_batches(fed.clients[client].train,
                                                      phase_schedule(phase, fed.settings.schedule),
                                                      torch.Generator().manual_seed(0)))
                        for phase in algorithm.plan(client))
            n = len(fed.clients[client].train)
            text = texts[role]
            if text == "nothing":
                expected = 0
            elif m := re.fullmatch(r"([\d +]+) optimizer steps", text):
                expected = sum(int(x) for x in m.group(1).split("+"))
            else:
                m = re.fullmatch(r"(?:(\d+) passes of )?1 epoch of its training data at batch (\d+)", text)
                assert m, text
                expected = int(m.group(1) or 1) * math.ceil(n / int(m.group(2)))
            assert steps == expected, (run.method.label, role, text, steps)
            assert role == "source" or n > 32  # more than one batch: an epoch is not one step
    # The note's step counts of the target's epoch: 100 and 500 MNIST images at batch 32.
    assert "4 steps at scarcity 0.05, 16 steps at scarcity 0.25" in paper.notes[2]


def test_pfedmb_runs_the_schedule_in_two_phases():
    """The count behind pFedMB's split: both phases of its plan follow the run's schedule."""
    from pfl_algorithms.algorithms import ALGORITHMS

    for settings in ({}, {"shared_alpha": True}, {"weighting": "uniform"}):
        phases = ALGORITHMS["pfedmb"](**settings).plan(0)
        assert len(phases) == 2
        assert all(p.steps is None and p.epochs is None for p in phases)
    assert ALGORITHMS["pfedmb"].split_step_budget(10) == (5, {})
    with pytest.raises(ValueError, match="does not split over pfedmb's 2 phases"):
        ALGORITHMS["pfedmb"].split_step_budget(7)


@pytest.mark.parametrize("budget,head", [(2, 1), (3, 2), (10, 9), (11, 10), (30, 27)])
def test_fedrep_splits_a_budget_as_its_code_splits_epochs(budget, head):
    """FedRep's head takes round(10/11) of a budget, the body the rest (at least 1 each), and the
    plan then trains the head for those steps and the body for the run's schedule."""
    from pfl_algorithms.algorithms import ALGORITHMS
    from pfl_algorithms.reproduce.papers import optimizer_steps, split_budget

    local_steps, settings = split_budget("fedrep", budget)
    assert (local_steps, settings) == (budget - head, {"head_steps": head})
    assert optimizer_steps("fedrep", local_steps, settings) == budget
    assert optimizer_steps("fedrep", local_steps, {}) is None  # the head in epochs: not a step budget
    first, second = ALGORITHMS["fedrep"](**settings).plan(0)
    assert (first.groups, first.steps, first.epochs) == (("head",), head, None)
    assert (second.groups, second.steps, second.epochs) == (("body",), None, None)
    with pytest.raises(ValueError, match="does not split over fedrep's 2 phases"):
        split_budget("fedrep", 1)


def test_cpu_scale_settings_are_real_data_normalized_and_long_enough(tmp_path):
    """MNIST/Fashion-MNIST label settings, MNIST + Fashion-MNIST + digits domains, BatchNorm
    LeNet-5, hundreds of samples a client, 30 rounds, five seeds by default, both inits."""
    from pfl_algorithms.reproduce.papers import DEFAULT_SEEDS

    assert DEFAULT_SEEDS >= 5
    for name, paper in PAPERS.items():
        for run in plan(paper, "cpu", 1, tmp_path):
            config = run.config
            if config.dataset == "gaussian-mixture":
                continue
            assert config.dataset in ("mnist", "fashion-mnist", "mixed") and config.rounds >= 30, (name, run)
            if config.dataset == "mixed":
                assert config.dataset_options["datasets"] == ["mnist", "fashion-mnist", "digits"]
            if config.scenario == "fda":
                assert config.samples_per_client is None  # a cap would shrink the target's share
            else:
                assert config.samples_per_client >= 200
            if not config.scenario_options.get("architectures"):
                assert (config.model, config.model_options.get("norm")) == ("lenet5", "batch")
    for name, rows in (("factorized-fl", ("Factorized-FL α", "Factorized-FL β")), ("simfed", ("SimFed",))):
        labels = {m.label: m.settings.get("init") for m in PAPERS[name].methods}
        for row in rows:
            assert labels[row] == "paper" and labels[f"{row} (init=svd)"] == "svd"
        folders = {r.out.parent.name for r in plan(PAPERS[name], "cpu", 1, tmp_path)}
        assert any(f.endswith("init-svd") for f in folders) and any(f.endswith("init-paper") for f in folders)
    # The fda target's smallest share: MNIST's 10,000 test images, 20% to train, 5% of that.
    fda = plan(PAPERS["feddaf"], "cpu", 1, tmp_path)
    assert round(10_000 * 0.2 * min(r.config.scenario_options["target_fraction"] for r in fda)) >= 50


def test_quick_is_a_short_cpu_variant(tmp_path):
    for name, paper in PAPERS.items():
        quick = plan(paper, "cpu", 3, tmp_path, quick=True)
        assert {r.config.rounds for r in quick} == {10}
        assert len({r.setting.label for r in quick}) == 1
    text = reproduce("simfed", quick=True, out=tmp_path, dry_run=True)
    assert "3 seeds" in text and "budget:" in text
    assert "5 seeds" in reproduce("simfed", out=tmp_path, dry_run=True)
    with pytest.raises(ValueError, match="quick"):
        plan(PAPERS["simfed"], "paper", 1, tmp_path, quick=True)


def test_a_users_folder_is_refused_and_left_untouched(tiny, tmp_path, capsys, monkeypatch):
    """--out holding the user's report.md (issue 32 item 4): refused in one line naming the
    folder before any run starts; every file byte-equal and nothing added."""
    out = tmp_path / "mine"
    (out / "plots").mkdir(parents=True)
    (out / "report.md").write_text("# my own report\n")
    (out / "plots" / "iid_accuracy_vs_round.png").write_bytes(b"my plot")
    before = file_tree(out)

    def no_training(*args, **kwargs):
        raise AssertionError("a run started in the user's folder")

    monkeypatch.setattr(runner, "run", no_training)
    for extra in ([], ["--dry-run"]):
        assert main(["reproduce", "tiny", "--seeds", "1", "--out", str(out), "--quiet", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(out) in err[0] and "is not empty" in err[0] and "choose a new or empty --out" \
            in err[0], err
    assert file_tree(out) == before


def test_the_folder_of_another_reproduction_is_refused(tiny, tmp_path, capsys):
    from pfl_algorithms.reproduce.folder import claim_folder

    out = tmp_path / "rep"
    claim_folder(tiny, "cpu", out)
    assert json.loads((out / "reproduce.json").read_text())["paper"] == "tiny"
    assert main(["reproduce", "tiny", "--quick", "--seeds", "1", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"pfl: error: --out {out} is the folder of `pfl reproduce tiny --scale cpu`, not of "
                   f"`pfl reproduce tiny --scale cpu --quick`; choose another --out")
    assert sorted(p.name for p in out.iterdir()) == ["reproduce.json"]


def test_the_report_never_replaces_a_file_it_did_not_write(tiny, tmp_path):
    """A report.md the user put into our folder is refused by name, never replaced; a file the
    marker lists (written by us) may be replaced."""
    from pfl_algorithms.reproduce.folder import claim_files, claim_folder

    out = tmp_path / "rep"
    claim_folder(tiny, "cpu", out)
    (out / "report.md").write_text("the user's\n")
    with pytest.raises(ValueError, match=f"{out / 'report.md'} was not written by `pfl reproduce`; refusing"):
        claim_files(out, [out / "report.json", out / "report.md"])
    assert (out / "report.md").read_text() == "the user's\n" and not (out / "report.json").exists()
    assert json.loads((out / "reproduce.json").read_text())["written"] == []
    (out / "report.md").unlink()
    claim_files(out, [out / "report.md"])
    (out / "report.md").write_text("ours\n")
    claim_files(out, [out / "report.md"])  # ours: listed, so it may be replaced
    assert json.loads((out / "reproduce.json").read_text())["written"] == ["report.md"]


def test_a_killed_reproduction_resumes_its_own_folder(tiny, tmp_path, monkeypatch):
    """Killed during its first run (after the marker was written), a reproduction resumes its
    own folder: the stopped run continues, the others run, the report is written."""
    out = tmp_path / "rep"
    original = runner.run

    def killed(config, out_, **kwargs):
        original(config, out_, **{**kwargs, "stop_after": 1})
        raise KeyboardInterrupt  # as a kill -9 after round 1: the run directory holds a checkpoint

    monkeypatch.setattr(runner, "run", killed)
    with pytest.raises(KeyboardInterrupt):
        reproduce("tiny", seeds=1, out=out, progress=False)
    assert (out / "reproduce.json").is_file()
    monkeypatch.setattr(runner, "run", original)
    report = reproduce("tiny", seeds=1, out=out, progress=False)
    first = plan(tiny, "cpu", 1, out)[0]
    assert [json.loads(line)["round"] for line in (first.out / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert report.is_file() and sorted(json.loads((out / "reproduce.json").read_text())["written"])[:2] == [
        "plots/iid_accuracy_vs_bits.png", "plots/iid_accuracy_vs_round.png"]


def test_one_seed_has_no_spread_and_a_truncated_summary_is_named(tiny, tmp_path, capsys):
    """--seeds 1: the tables show the mean alone, never "± 0.00" (issue 32 item 7).  A
    summary.json cut short by a crash is one line naming the file and saying what to do, not
    json's "Expecting value: line 3 column 25"."""
    out = tmp_path / "rep"
    report = reproduce("tiny", seeds=1, out=out, progress=False).read_text()
    assert "± 0.00" not in report and "±" not in report.split("## Communication")[0].split("| Method |")[1]
    runs = plan(tiny, "cpu", 1, out)
    fedavg = json.loads((next(r for r in runs if r.method.label == "FedAvg").out / "summary.json").read_text())
    row = next(line for line in report.splitlines() if line.startswith("| FedAvg |"))
    assert row.split(" | ")[1] == f"{100 * fedavg['final_mean_accuracy']:.2f}"
    assert json.loads((out / "report.json").read_text())["cells"][0]["accuracy_std"] is None
    summary = runs[1].out / "summary.json"
    summary.write_text(summary.read_text()[:60])
    assert main(["reproduce", "tiny", "--seeds", "1", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pfl: error: {summary}: not readable (JSONDecodeError: "), err
    assert err[0].endswith(f"delete the run folder {runs[1].out} to run it again")


def test_a_folder_made_before_the_marker_is_adopted_only_if_it_is_ours(tiny, tmp_path):
    """A folder an older version made (its runs, a report whose report.json names this paper
    and scale) is adopted, its report files listed as ours; with another paper's report.json,
    or a stray file beside the runs, it is refused."""
    from pfl_algorithms.reproduce.folder import claim_folder

    out = tmp_path / "old"
    (out / "plots").mkdir(parents=True)
    (out / "iid" / "fedavg" / "seed0").mkdir(parents=True)
    (out / "iid" / "fedavg" / "seed0" / "run.lock").write_text("")
    (out / "report.md").write_text("old report\n")
    (out / "plots" / "iid_accuracy_vs_round.png").write_bytes(b"png")
    (out / "report.json").write_text(json.dumps({"paper": "other", "scale": "cpu", "quick": False}))
    with pytest.raises(ValueError, match="is not a folder of `pfl reproduce tiny --scale cpu`"):
        claim_folder(tiny, "cpu", out)
    (out / "report.json").write_text(json.dumps({"paper": "tiny", "scale": "cpu"}))
    (out / "iid" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"):
        claim_folder(tiny, "cpu", out)
    (out / "iid" / "notes.txt").unlink()
    claim_folder(tiny, "cpu", out)
    marker = json.loads((out / "reproduce.json").read_text())
    assert sorted(marker["written"]) == ["plots/iid_accuracy_vs_round.png", "report.json", "report.md"]
