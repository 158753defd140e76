"""pFedMB (Mori, Yoshiyama, Furukawa and Teranishi, "Personalized Federated Learning with
Multi-branch Architecture", IJCNN 2023): every layer is a convex combination of B branches,

    W_l = Σ_b α_{l,b} W_{l,b},   α_l ≥ 0, Σ_b α_{l,b} = 1            (Eq. 1–2)

with the branches W shared by all clients and the branch weights α personal.

Local update (Algorithm 1, lines 18–20), a two-phase plan, each phase with its own optimizer
state (momentum and Adam moments of α never mix with those of W):

1. E epochs on α with W fixed, at η_α (``alpha_lr``; None: the run's lr, / L if shared)  (Eq. 3)
2. E epochs on W with α fixed, at η_W (``weight_lr``; None: per layer, lr / ‖α_l‖²) (Eq. 4)

The paper tunes η_α and η_W on validation data and does not report them.  A step on layer
l's branches moves its combined weight by Σ_b α_b ΔW_b = −η_W Σ_b α_b² g = −η_W ‖α_l‖² g
(g the gradient of the combined weight), so by default each layer's branches step at
η_W,l = lr / ‖α_l‖², with the client's α of this round: the combined weight then moves as
the dense layer's SGD at the run's lr does, whatever α is.  Under uniform α that is B × lr;
at the run's lr itself pFedMB learned B times slower and had not left the initial plateau
after 10 rounds on digits with B = 5.  A fixed B × lr instead (this file's first default)
became B times the dense step once α concentrated: in the paired experiment (seed 2) every
client diverged.  The per-layer rate is the optimizer's own rate for those tensors (a phase's
``lr_scales``), not a scaled gradient, so it holds under momentum and Adam too (Adam normalizes
a gradient's scale away).  ``weight_lr`` given: that one rate for every layer (Eq. 4 as written).
With ``shared_alpha`` the one α receives the sum of the L branched layers' gradients, so η_α
defaults to the run's lr / L (the per-layer α's step, averaged over layers): at the run's lr
it concentrated within two rounds of the paired experiment (10 clients, digits), the
branches' effective rate rose towards B × lr, and every client diverged (NaN) from round 4.

α stays on the simplex by a softmax over per-branch logits (``simplex='softmax'``, the
default: the paper does not say how) or by Euclidean projection after every step of phase 1
(``'projection'``).  Initial α is uniform (the paper's choice).  The paper does not say how
the branches start.  Each is drawn independently: branches that start equal get equal
gradients under uniform α and never part.  Each draw is the dense layer's initialization
scaled by √B, so that the combined weight Σ_b W_b / B has the dense layer's variance.
Unscaled, a 4-layer CNN with B = 5 starts with its signal shrunk about 25-fold and did not
leave the initial plateau in 10 rounds on digits.

Server (Eq. 5): each branch b of each layer l is averaged over the senders weighted by
n_i·α^i_{l,b},  W_{l,b} = Σ_i n_i α^i_{l,b} W^i_{l,b} / Σ_j n_j α^j_{l,b}, as one
``branch_aggregate`` per α over the round's uploads (with ``shared_alpha``, one for the whole
model).  A branch nobody weights keeps the plain average (the op's rule).  ``weighting=
'uniform'`` is the paper's ablation "without α-weighted averaging" (Eq. 6): plain n_i-weighted
averaging, as FedAvg does.

Communication: the branches go down and up.  α is never downloaded (nor averaged); under
Eq. 5 each client sends its α up with its branches (Algorithm 1, line 21: the server cannot
weight by α_i otherwise), B numbers per layer, counted; under Eq. 6 α is never sent.

Which layers branch (``layers``): the paper "extends each linear layer to a multi-branch
layer", and its CNN has two convolutions and three fully connected layers; a convolution is
a linear map too, and the paper's Eq. 2 writes W_l * x, a convolution, so ``'all'`` (the
default) branches every Conv2d and Linear, classifier included; ``'fc'`` branches only the
fully connected layers (the convolutions are then plain FedAvg-averaged weights).
``shared_alpha``: one α for all layers (Section 5.2, the paired experiment of Table 1).
The classifier stays with the client in the permuted and multi-domain scenarios, as for
every method; its α is personal as all α are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Annotated, Optional

import torch
from torch import nn

from pfl_kernels.nn import MultiBranchConv2d, MultiBranchLinear, multibranch, multibranch_layers
from pfl_kernels.ops import branch_aggregate

from ..api import GroupRule, OneOf, Phase, PositiveFloat, PositiveInt, capturable_hook, head_parameter_names
from .fedavg import FedAvg

MULTIBRANCH = (MultiBranchConv2d, MultiBranchLinear)
BRANCHED = ("branch_weight", "branch_bias")  # the attributes holding [B, ...] branch tensors
ALPHA = "alpha"


@dataclass(frozen=True)
class PFedMBSettings:
    branches: PositiveInt = 5  # B (the paper: B ≤ 10, 5 in its paired experiment)
    weighting: Annotated[str, OneOf(("alpha", "uniform"))] = "alpha"  # Eq. 5, or Eq. 6's plain averaging
    shared_alpha: bool = False  # one α for every layer (Section 5.2)
    simplex: Annotated[str, OneOf(("softmax", "projection"))] = "softmax"
    alpha_lr: Optional[PositiveFloat] = None  # η_α (tuned, not reported); None: the run's lr (/ L with shared_alpha)
    weight_lr: Optional[PositiveFloat] = None  # η_W; None: per layer lr / ‖α_l‖² (module docstring)
    layers: Annotated[str, OneOf(("all", "fc"))] = "all"  # which layers branch (module docstring)


class PFedMB(FedAvg):
    """Multi-branch layers: personal α trained first, then shared branches; α-weighted branch averaging."""

    name = "pfedmb"
    description = "multi-branch layers: personal branch weights alpha, branches averaged weighted by n_i*alpha_i"
    Settings = PFedMBSettings

    def __init__(self, **settings):
        super().__init__(**settings)
        self._alpha_of: Optional[dict[str, str]] = None  # branched parameter -> the α parameter weighing it
        self._weight_groups: tuple[str, ...] = ()
        self._layers = 1  # L, the multi-branch layers (sharing one α with shared_alpha)

    # ------------------------------------------------------------------ declarations

    def prepare_model(self, model: nn.Module) -> nn.Module:
        s = self.settings
        exclude = [] if s.layers == "all" else [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
        multibranch(model, branches=s.branches, simplex="softmax" if s.simplex == "softmax" else "project",
                    shared_alpha=s.shared_alpha, exclude=exclude)
        layers = multibranch_layers(model)
        if not layers:
            raise ValueError(f"{self.name}: the model has no layer to make multi-branch (layers={s.layers!r})")
        scale = math.sqrt(s.branches)
        for layer in layers:  # independent draws per branch: copies of one dense weight would stay equal forever
            layer.reset_parameters()
            with torch.no_grad():  # Σ_b W_b / B then has the dense layer's variance (module docstring)
                for p in (layer.branch_weight, layer.branch_bias):
                    if p is not None:
                        p.mul_(scale)
        self._layers = len(layers)
        alpha_of, groups = self._branches(model)
        if self._alpha_of is not None and alpha_of != self._alpha_of:
            raise ValueError(f"{self.name} needs every client on one architecture")
        self._alpha_of, self._weight_groups = alpha_of, groups
        return model

    @staticmethod
    def _branches(model: nn.Module) -> tuple[dict[str, str], tuple[str, ...]]:
        """Each branched parameter's α parameter (by name; a shared α under the name the model
        lists it by), and the groups phase 2 trains: every group but α (``group_rules``)."""
        names = {id(p): name for name, p in model.named_parameters()}
        alpha_of = {f"{path}.{attribute}" if path else attribute: names[id(module.alpha_param)]
                    for path, module in model.named_modules() if isinstance(module, MULTIBRANCH)
                    for attribute in BRANCHED if getattr(module, attribute, None) is not None}
        alphas, head = set(alpha_of.values()), set(head_parameter_names(model))
        groups = {"head" if name in head else "branches" if name in alpha_of else "body"
                  for name in names.values() if name not in alphas}
        return alpha_of, tuple(g for g in ("branches", "body", "head") if g in groups)

    def _alpha_slots(self, alpha_segments) -> dict[str, int]:
        """Each branched parameter's row in the [S, B] α of a client (``sender_alpha``), from
        where the engine put each α tensor in the ``alpha`` group."""
        slot = {entry.name: entry.offset // self.settings.branches for entry in alpha_segments}
        return {name: slot[alpha] for name, alpha in self._alpha_of.items()}

    def group_rules(self):
        return (GroupRule(ALPHA, modules=MULTIBRANCH, attributes=("alpha_param",)),
                GroupRule("branches", modules=MULTIBRANCH, attributes=BRANCHED, outside_head=True))

    def local_groups(self, *, keep_head_local):
        return {ALPHA} | super().local_groups(keep_head_local=keep_head_local)

    # ------------------------------------------------------------------ server side

    def aggregate(self, round_, uploads):
        """Eq. 5 (or Eq. 6) for the branched parameters, n_i-weighted averaging for the rest."""
        if not uploads:
            return
        alpha = self.sender_alpha(uploads.stack(ALPHA)) if self.settings.weighting == "alpha" else None
        counts = uploads.num_examples
        slots = self._alpha_slots(self.server.segments(ALPHA))
        model = dict(self.global_model)
        for group in uploads.names():
            if group == ALPHA:
                continue
            segments = self.server.segments(group) if group in self.server.shared else ()
            if any(entry.name in slots for entry in segments):
                model[group] = self.branch_mean(uploads.stack(group), segments, slots, alpha, counts,
                                                self.settings.branches)
            else:
                model[group] = uploads.weighted_mean([group])[group]
        self.global_model = model

    def sender_alpha(self, rows: torch.Tensor) -> torch.Tensor:
        """[M, S, B] α of every sender (S: the model's α, one per layer or one shared) from
        their alpha rows (softmax logits, or α itself under projection)."""
        alpha = rows.reshape(len(rows), -1, self.settings.branches)
        return torch.softmax(alpha, dim=-1) if self.settings.simplex == "softmax" else alpha

    @staticmethod
    def branch_mean(rows: torch.Tensor, segments, slots: dict[str, int], alpha: Optional[torch.Tensor],
                    counts: torch.Tensor, branches: int) -> torch.Tensor:
        """One group's aggregate from its senders' rows [M, P]: for each α slot, every branch
        tensor it weighs (``segments``: the group's tensors, ``slots``: parameter -> α slot)
        side by side in one [M, B, P'] bank, reduced by one ``branch_aggregate`` (Eq. 5; uniform
        α: Eq. 6); tensors that do not branch are averaged with weights n_i / Σ n."""
        out = torch.empty_like(rows[0])
        by_slot: dict[int, list] = {}
        for entry in segments:
            if entry.name in slots:
                by_slot.setdefault(slots[entry.name], []).append(entry)
            else:
                out[entry.offset:entry.stop] = ((counts / counts.sum()).to(rows.dtype)
                                                @ rows[:, entry.offset:entry.stop].contiguous())
        for slot, entries in by_slot.items():
            bank = torch.cat([rows[:, e.offset:e.stop].reshape(len(rows), branches, -1) for e in entries], dim=2)
            weights = torch.ones(len(rows), branches, dtype=torch.float64) if alpha is None else alpha[:, slot]
            mean = branch_aggregate(bank, weights, counts)  # [B, P']: branch-major across the slot's tensors
            start = 0
            for e in entries:
                width = e.numel // branches
                out[e.offset:e.stop] = mean[:, start:start + width].reshape(-1)
                start += width
        return out

    # ------------------------------------------------------------------ client side

    @classmethod
    def split_step_budget(cls, budget: int) -> tuple[int, dict]:
        """Both phases (α, then the weights) run the schedule: half the budget each."""
        if budget % 2:
            raise ValueError(f"a budget of {budget} local steps does not split over pfedmb's 2 phases")
        return budget // 2, {}

    @classmethod
    def optimizer_steps(cls, local_steps: int, settings) -> int:
        return 2 * local_steps

    def plan(self, client):
        s = self.settings
        project = self._projection()
        alpha_scale = self._alpha_scale() if s.alpha_lr is None else 1.0
        dense_equivalent = self._dense_equivalent_rates if s.weight_lr is None else None
        return (Phase(groups=(ALPHA,), lr=s.alpha_lr, lr_scale=alpha_scale, state="alpha", after_step=project),
                Phase(groups=self._weight_groups, state="weights", lr=s.weight_lr, lr_scales=dense_equivalent))

    def finetune_phase(self, client, epochs):
        """The run's fine-tuning before evaluation (the paper's tables: every method fine-tunes
        for E local epochs), the engine's protocol for every method (each parameter at the
        run's lr, from fresh state), with α kept on the simplex under projection: without the
        projection after each step a fine-tuned α left the simplex.

        pFedMB's own per-layer rates (lr / ‖α_l‖² for the branches) are this file's choice for
        its training (the paper does not report η_W), not part of the protocol the paper applies
        to every method alike; with them in a joint phase pFedMB's Dirichlet column fell from
        85.6% to 75.6% (reproductions/README.md)."""
        return replace(super().finetune_phase(client, epochs), after_step=self._projection())

    def _alpha_scale(self) -> float:
        """η_α as a multiple of the run's lr where ``alpha_lr`` is None: 1 / L with a shared α."""
        return 1.0 / self._layers if self.settings.shared_alpha else 1.0

    def _dense_equivalent_rates(self, view) -> dict[str, float]:
        """The default η_W (module docstring): each branched tensor steps at the run's lr times
        1/‖α_l‖² of its layer's α (fixed during this phase), so the run's lr moves the combined
        weight as a dense layer's step; the optimizer's own per-parameter rate, so it holds
        under momentum and Adam too."""
        s = self.settings
        alpha = view.group(ALPHA).view(-1, s.branches)
        alpha = torch.softmax(alpha, dim=-1) if s.simplex == "softmax" else alpha
        factor = (1.0 / alpha.square().sum(-1)).tolist()
        return {name: factor[slot] for name, slot in self._alpha_slots(view.segments(ALPHA)).items()}

    def _projection(self):
        """The after-step hook that keeps α on the simplex (``simplex='projection'``), else None."""
        if self.settings.simplex != "projection":
            return None
        return capturable_hook(self._project_alpha, key=("pfedmb-project", self.settings.branches))

    def _project_alpha(self, view) -> None:
        """α ← its projection onto the simplex, row by row, after each phase-1 step.

        The op itself, not the ``project_simplex_`` wrapper: the wrapper reads α back to the
        host to refuse NaN/Inf, which a CUDA graph capture of the step cannot do (the hook is
        declared capturable) and which stopped a diverging run with an error about an ``x``
        the user never passed.  The op makes a row holding NaN or Inf all NaN, so a diverged
        client's result is non-finite and the engine reports it as diverged, as for any
        other algorithm."""
        with torch.no_grad():
            torch.ops.pfl.project_simplex_(view.group(ALPHA).view(-1, self.settings.branches))

    def upload(self, view):
        extra = [ALPHA] if self.settings.weighting == "alpha" else []
        return view.message([*view.received(), *extra])
