"""FedGen (Zhu, Hong and Zhou, ICML 2021, "Data-Free Knowledge Distillation for Heterogeneous
Federated Learning"), in the limited-sharing form Fed-CMA's Table 2 compares against: only the
classifier (the ``head`` group, Linear(d, C)) and the generator travel; every feature extractor
(``body``) stays with its client, so clients may have different architectures.  This is the
released code's ``latent_layer_idx=-1`` path (github.com/zhuangdizhu/FedGen), where the generator
produces d-dimensional embeddings that are fed to the classifiers.

Generator (``FLAlgorithms/trainmodel/generator.py``, ``Generator`` with ``embedding=False``;
dims from ``utils/model_config.py`` GENERATORCONFIGS['mnist'] = hidden 256, noise 32):

    G(y, ε) = W₂ · ReLU(BN(W₁ · [ε, onehot(y)] + b₁)) + b₂,   ε ~ U[0, 1)^noise   (the code's
    ``torch.rand``), output d = the embedding size, inferred from the head: |head| = C·d + C.

It is kept as one flat parameter vector and its BatchNorm statistics (:func:`generate`), so
the server and the clients build it from the same few lines.

Server, after each round (``serverpFedGen.py``, ``FedGen.train`` then ``train_generator``):

* label weights (``get_label_weights``): for each label y and sender i of the round,
  w_yi = (n_iy + prior) / Σ_j (n_jy + prior).  The code counts the labels a client saw in this
  round's batches on top of 1 (``clean_up_counts``); the server here knows the clients'
  training label counts (``server.class_counts()``), and ``count_prior`` (default 1) is that 1.
  Labels are drawn only among those some sender holds (the code's ``qualified_labels``).
* ``generator_steps`` (50: ``ensemble_epochs`` 50 // ``n_teacher_iters`` 5 epochs of 5) Adam
  steps (lr ``ensemble_lr`` 3e-4 × 0.98^t, the code's ExponentialLR stepped once per round;
  L2 weight decay 1e-2) on batches of ``generator_batch_size`` labels drawn uniformly from
  those labels (32: the code uses the clients' batch size), minimizing

      α_e · Σ_i mean_b[ w_{y_b i} · CE(h_i(G(y_b)), y_b) ]        teacher (the senders' heads)
    − β_e · KL(softmax(Σ_i w_{y i} h_i(G(y))) ‖ softmax(h̄(G(y))))   student, the code's
                                                                   ``F.kl_div`` (element mean)
    + η_e · exp(−mean_{a,b} ‖ε_a − ε_b‖²/noise · ‖G_a − G_b‖₁/d)   diversity (``DiversityLoss``)

  with (α_e, β_e, η_e) = ``ensemble_alpha/beta/eta`` = (1, 0, 1) (RUNCONFIGS['mnist']).  With
  limited sharing the student is the averaged classifier h̄ (the code's ``self.model``, still
  the previous round's average when the generator trains: it aggregates afterwards); its term
  is off by default as in the code.  The paper writes the generator's objective with the
  clients' averaged prediction; Fed-CMA ran the official code, so the code's per-client,
  label-weighted cross-entropy is what is followed here.
* the head is averaged over the senders by n_i (``aggregate_parameters``; only the classifier
  is shared here).  The Adam moments are server state, checkpointed.

Client (``userpFedGen.py``, ``UserpFedGen.train``): the download's averaged head replaces the
client's; from round 1 on (the code's ``regularization = glob_iter > 0``), each batch (x, y)
adds to its cross-entropy

      gen_ratio · α(t) · mean CE(h(G(ŷ)), ŷ)        ŷ: ``gen_batch_size`` (32) labels drawn
                                                     uniformly from the available labels
    + β(t) · KL(softmax(h(G(y))) ‖ softmax(f(x)))    per batch ("batchmean"), target detached

with α(t) = max(1e-4, 10·0.98^t), β(t) the same from 10 (``exp_lr_scheduler`` of
``generative_alpha``/``generative_beta``), gen_ratio = gen_batch_size / |batch| (the code
divides by its batch size; its batches are all full).  The generator runs in eval mode (its
BatchNorm statistics as downloaded) and is not trained on the client.  The available labels
are, as in the code (``aggregate_user_data``'s unique labels), those some client of the
federation holds, sent as a C-bit mask; ``teacher_labels='own'`` draws from the client's own
training labels instead.  The code's ``early_stop`` (no regularization after 20 local epochs)
never binds at its 20 epochs of one batch and is not modelled.  Then the client uploads its
head, nothing else.

Evaluation: the code evaluates the global model on each client (``Server.evaluate`` after
``send_parameters``); with limited sharing that is the averaged head on the client's own
extractor (``evaluation='global'``); ``evaluation='own'`` takes the client's last trained head.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Optional

import torch
from torch.nn import functional as F

from ..api import (Adam, Algorithm, Capabilities, Message, NonNegativeFloat, OneOf, Phase, PositiveFloat,
                   PositiveInt, Range)

BN_MOMENTUM, BN_EPS = 0.1, 1e-5  # nn.BatchNorm1d's defaults, as the code's generator has them
MIN_REGULARIZER = 1e-4  # the floor of the code's exp_lr_scheduler
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8


@dataclass(frozen=True)
class FedGenSettings:
    hidden_dim: PositiveInt = 256  # the generator's hidden width (GENERATORCONFIGS['mnist'])
    noise_dim: PositiveInt = 32  # ε's width
    generator_lr: PositiveFloat = 3e-4  # ensemble_lr
    generator_lr_decay: Annotated[float, Range(gt=0, le=1)] = 0.98  # ExponentialLR gamma, per round
    weight_decay: NonNegativeFloat = 1e-2  # the generator's Adam (L2)
    generator_steps: PositiveInt = 50  # Adam steps per round (10 epochs x n_teacher_iters 5)
    generator_batch_size: PositiveInt = 32  # labels per generator step (the code's client batch size)
    ensemble_alpha: NonNegativeFloat = 1.0  # teacher loss weight (server)
    ensemble_beta: NonNegativeFloat = 0.0  # adversarial student loss weight (server)
    ensemble_eta: NonNegativeFloat = 1.0  # diversity loss weight (server)
    count_prior: NonNegativeFloat = 1.0  # added to every label count in the teacher weights
    generative_alpha: NonNegativeFloat = 10.0  # α(0), the client's teacher-loss weight
    generative_beta: NonNegativeFloat = 10.0  # β(0), the client's latent KL weight
    regularizer_decay: Annotated[float, Range(gt=0, le=1)] = 0.98  # α(t), β(t) decay per round
    gen_batch_size: PositiveInt = 32  # generated samples per client batch
    teacher_labels: Annotated[str, OneOf(("federation", "own"))] = "federation"  # where ŷ is drawn
    evaluation: Annotated[str, OneOf(("global", "own"))] = "global"  # the head a client is evaluated with


# ---------------------------------------------------------------- the generator

def embedding_size(head_numel: int, classes: int) -> int:
    """d of a head Linear(d, C) flattened weight-then-bias (C·d + C values).

    Raises:
        ValueError: no integer d >= 1 fits (the head is not one Linear layer onto the classes).
    """
    d, rest = divmod(int(head_numel), int(classes))
    if rest or d < 2:
        raise ValueError(f"fedgen needs the head to be one Linear(d, C) with C = {classes} classes; its "
                         f"{head_numel} values are not C·d + C for any d >= 1")
    return d - 1


def generator_shapes(noise_dim: int, classes: int, hidden_dim: int, embedding_dim: int) -> dict[str, tuple]:
    """The generator's parameters, in the order of its flat vector: Linear(noise + C, hidden),
    BatchNorm1d(hidden)'s weight and bias, Linear(hidden, d)."""
    return {"fc.weight": (hidden_dim, noise_dim + classes), "fc.bias": (hidden_dim,), "bn.weight": (hidden_dim,),
            "bn.bias": (hidden_dim,), "out.weight": (embedding_dim, hidden_dim), "out.bias": (embedding_dim,)}


def init_generator(shapes: dict, generator: torch.Generator, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat parameters, flat BatchNorm statistics [running mean, running var]) as torch's layers
    initialize them (Linear: weight and bias ~ U(−1/√fan_in, 1/√fan_in); BatchNorm: 1 and 0,
    statistics 0 and 1), drawn from ``generator``."""
    parts = []
    for name, shape in shapes.items():
        if name.startswith("bn."):
            parts.append(torch.full(shape, 1.0 if name == "bn.weight" else 0.0, dtype=dtype))
            continue
        fan_in = shapes[name.replace("bias", "weight")][1]
        bound = 1.0 / math.sqrt(fan_in)
        parts.append((torch.rand(shape, generator=generator, dtype=dtype) * 2 - 1) * bound)
    hidden = shapes["bn.weight"][0]
    stats = torch.cat([torch.zeros(hidden, dtype=dtype), torch.ones(hidden, dtype=dtype)])
    return torch.cat([p.reshape(-1) for p in parts]), stats


def generate(params: torch.Tensor, stats: torch.Tensor, shapes: dict, labels: torch.Tensor, noise: torch.Tensor,
             *, training: bool) -> torch.Tensor:
    """G(y, ε): [B, d] embeddings for ``labels`` [B] and ``noise`` [B, noise_dim] (module
    docstring).  ``training``: BatchNorm on the batch's statistics, updating ``stats`` in place
    (the server); else on ``stats`` (the clients)."""
    views, start = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape)
        views[name] = params[start:start + size].view(shape)
        start += size
    hidden = shapes["bn.weight"][0]
    classes = shapes["fc.weight"][1] - noise.shape[1]
    x = torch.cat([noise, F.one_hot(labels, classes).to(noise.dtype)], dim=1)
    h = F.linear(x, views["fc.weight"], views["fc.bias"])
    h = F.batch_norm(h, stats[:hidden], stats[hidden:], views["bn.weight"], views["bn.bias"], training,
                     BN_MOMENTUM, BN_EPS)
    return F.linear(F.relu(h), views["out.weight"], views["out.bias"])


def diversity_loss(noise: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """exp(−mean_{a,b} D_ε(a, b)·D_G(a, b)), D_ε the mean squared and D_G the mean absolute
    difference between rows a and b (the code's ``DiversityLoss(metric='l1')``): small when
    different noises give different embeddings."""
    noise_dist = (noise[:, None, :] - noise[None, :, :]).square().mean(2)
    output_dist = (output[:, None, :] - output[None, :, :]).abs().mean(2)
    return torch.exp(-(noise_dist * output_dist).mean())


def head_logits(heads: torch.Tensor, embeddings: torch.Tensor, classes: int) -> torch.Tensor:
    """[M, B, C] logits of M flat heads [M, C·d + C] (weight then bias) on embeddings [B, d]."""
    d = embeddings.shape[1]
    weight = heads[:, :classes * d].reshape(-1, classes, d)
    return torch.einsum("bd,mcd->mbc", embeddings, weight) + heads[:, None, classes * d:]


def label_weights(counts: torch.Tensor, prior: float) -> tuple[torch.Tensor, torch.Tensor]:
    """([C, M] w_yi = (n_iy + prior) / Σ_j (n_jy + prior), [L] the labels some sender holds) from
    the senders' label counts [M, C] (the code's ``get_label_weights``); a label nobody holds
    gets weight 0."""
    smoothed = counts.T.double() + prior
    total = smoothed.sum(1, keepdim=True)
    weights = torch.where(total > 0, smoothed / total.clamp_min(1e-300), torch.zeros_like(smoothed))
    return weights, torch.nonzero(counts.sum(0) > 0).flatten()


def generator_loss(heads: torch.Tensor, average_head: torch.Tensor, weights: torch.Tensor, labels: torch.Tensor,
                   noise: torch.Tensor, output: torch.Tensor, settings) -> tuple[torch.Tensor, dict]:
    """The server's generator objective on one batch (module docstring): α_e·teacher − β_e·student
    + η_e·diversity, and its three parts.  ``heads`` [M, P_h] the senders' heads, ``weights``
    [C, M] :func:`label_weights`, ``output`` = G(labels, noise) [B, d]."""
    classes = weights.shape[0]
    logits = head_logits(heads, output, classes)  # [M, B, C]
    w = weights[labels].T.to(output.dtype)  # [M, B]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.repeat(len(heads)), reduction="none").view(len(heads), -1)
    teacher = (ce * w).mean(1).sum()
    diversity = diversity_loss(noise, output)
    loss = settings.ensemble_alpha * teacher + settings.ensemble_eta * diversity
    student = torch.zeros((), dtype=output.dtype)
    if settings.ensemble_beta > 0:
        teacher_logits = (logits * w[:, :, None]).sum(0)
        student_logits = head_logits(average_head[None], output, classes)[0]
        # the code's F.kl_div default reduction, the mean over all B·C terms (spelled out: torch
        # warns that 'mean' will become 'batchmean')
        student = F.kl_div(F.log_softmax(student_logits, 1), F.softmax(teacher_logits, 1), reduction="sum")
        student = student / teacher_logits.numel()
        loss = loss - settings.ensemble_beta * student
    return loss, {"teacher": teacher.detach(), "student": student.detach(), "diversity": diversity.detach()}


def generator_optimizer(settings, round_: int) -> Adam:
    """The generator's optimizer in round ``round_``: torch's Adam (L2 weight decay, bias-corrected
    moments; the engine's, stepping the flat generator) at ``generator_lr`` × decay^round."""
    return Adam(lr=settings.generator_lr * settings.generator_lr_decay ** round_, betas=ADAM_BETAS, eps=ADAM_EPS,
                weight_decay=settings.weight_decay)


def decayed(initial: float, round_: int, decay: float) -> float:
    """The code's ``exp_lr_scheduler``: max(1e-4, initial · decay^round) (α(t) and β(t))."""
    return max(MIN_REGULARIZER, initial * decay ** round_)


# ---------------------------------------------------------------- the client's regularizer

class GenerativeRegularizer:
    """One client's FedGen terms for one round: ``begin`` reads the downloaded generator, and the
    object, as a loss term, adds gen_ratio·α(t)·teacher + β(t)·latent KL to each batch."""

    def __init__(self, settings: FedGenSettings):
        self.settings = settings
        self.active = False

    def begin(self, view) -> None:
        """Rebuild G from the download (no generator in it: no regularization this round)."""
        extras = {} if view.download is None else view.download.extras
        self.active = "generator" in extras
        if not self.active:
            return
        s = self.settings
        mask = extras["labels"]
        classes = int(mask.numel())
        d = embedding_size(view.group("head").numel(), classes)
        self.shapes = generator_shapes(s.noise_dim, classes, s.hidden_dim, d)
        self.params, self.stats = extras["generator"]["params"], extras["generator"]["stats"]
        if s.teacher_labels == "own":
            mask = torch.zeros_like(mask)
            mask[view.labels_of(view.indices("train")).unique()] = True
        self.labels = torch.nonzero(mask.cpu()).flatten()
        self.random = view.generator()
        self.alpha = decayed(s.generative_alpha, view.round, s.regularizer_decay)
        self.beta = decayed(s.generative_beta, view.round, s.regularizer_decay)

    def sample(self, labels: torch.Tensor) -> torch.Tensor:
        """G(labels, ε) without gradient, ε drawn from the client's stream."""
        noise = torch.rand(len(labels), self.settings.noise_dim, generator=self.random, dtype=self.params.dtype)
        with torch.no_grad():
            return generate(self.params, self.stats, self.shapes, labels.to(self.params.device),
                            noise.to(self.params.device), training=False)

    def __call__(self, batch) -> torch.Tensor:
        if not self.active or not self.labels.numel():
            return batch.logits.new_zeros(())
        head = batch.module.head
        target = F.softmax(head(self.sample(batch.labels)), dim=1).detach()
        latent = F.kl_div(F.log_softmax(batch.logits, dim=1), target, reduction="batchmean")
        drawn = self.labels[torch.randint(len(self.labels), (self.settings.gen_batch_size,), generator=self.random)]
        drawn = drawn.to(batch.labels.device)
        teacher = F.cross_entropy(head(self.sample(drawn)), drawn)
        gen_ratio = self.settings.gen_batch_size / batch.labels.numel()
        return gen_ratio * self.alpha * teacher + self.beta * latent


# ---------------------------------------------------------------- the algorithm

class FedGen(Algorithm):
    """Shared classifier + a server-trained generator of embeddings that regularizes each client."""

    name = "fedgen"
    description = ("FedGen, limited sharing: heads averaged, a server generator of embeddings fitted to the heads, "
                   "its samples regularize each client's head; bodies stay local")
    Settings = FedGenSettings
    capabilities = Capabilities(mixed_architectures=True, head="shared")

    def local_groups(self, *, keep_head_local):
        return {"body"}

    def setup(self, server) -> None:
        s = self.settings
        self.head = server.initial_model(["head"])["head"]
        counts = server.class_counts()
        classes = counts.shape[1]
        self.available = counts.sum(0) > 0  # the code's available_labels, as a mask
        self.shapes = generator_shapes(s.noise_dim, classes, s.hidden_dim, embedding_size(self.head.numel(), classes))
        params, stats = init_generator(self.shapes, server.generator(-1), self.head.dtype)
        self.params, self.stats = params.to(self.head.device), stats.to(self.head.device)
        self.adam = {"exp_avg": torch.zeros_like(self.params), "exp_avg_sq": torch.zeros_like(self.params), "steps": 0}
        self.losses: dict = {}

    def configure(self, round_, clients):
        extras = {}
        if round_ > 0:  # the code regularizes from the second round on, once G has trained
            extras = {"generator": {"params": self.params.clone(), "stats": self.stats.clone()},
                      "labels": self.available.clone()}
        return Message({"head": self.head.clone()}, extras)

    def plan(self, client):
        regularizer = GenerativeRegularizer(self.settings)
        return (Phase(begin=regularizer.begin, loss_terms=(regularizer,)),)

    def upload(self, view):
        return view.message(["head"])

    def aggregate(self, round_, uploads):
        self.losses = {}
        if not uploads:
            return
        heads = uploads.stack("head").to(self.head.dtype)
        counts = self.server.class_counts()[uploads.clients]
        self.train_generator(round_, heads, counts)
        self.head = uploads.weighted_mean(["head"])["head"].to(self.head.dtype)

    def train_generator(self, round_: int, heads: torch.Tensor, counts: torch.Tensor) -> None:
        """``generator_steps`` Adam steps on :func:`generator_loss` against the senders' ``heads``
        [M, P_h] with label counts [M, C]; draws from the server's stream of ``round_``."""
        s = self.settings
        weights, labels = label_weights(counts, s.count_prior)
        if not labels.numel():
            return
        random = self.server.generator(round_)
        optimizer = generator_optimizer(s, round_)
        # The parts' running means stay on the device (float64, as the Python floats they
        # replace) and are read once after the loop: a read per step was a device sync per
        # step, 3 × generator_steps a round, which kept the host from queueing the next step.
        names = ("teacher", "student", "diversity")
        totals = torch.zeros(len(names), dtype=torch.float64, device=self.params.device)
        for _ in range(s.generator_steps):
            y = labels[torch.randint(len(labels), (s.generator_batch_size,), generator=random)].to(self.params.device)
            noise = torch.rand(s.generator_batch_size, s.noise_dim, generator=random, dtype=self.params.dtype)
            noise = noise.to(self.params.device)
            params = self.params.detach().requires_grad_(True)
            output = generate(params, self.stats, self.shapes, y, noise, training=True)
            loss, parts = generator_loss(heads, self.head, weights.to(self.params.device), y, noise, output, s)
            (grad,) = torch.autograd.grad(loss, params)
            optimizer.step(self.params, grad, self.adam)
            totals += torch.stack([parts[key].detach() for key in names]).double() / s.generator_steps
        self.losses = dict(zip(names, totals.tolist()))

    def round_metrics(self, round_):
        """The generator's mean teacher, student and diversity losses of the round."""
        return {f"generator_{key}": value for key, value in self.losses.items()}

    def evaluation(self, client) -> Optional[Message]:
        """The averaged head on the client's own body (the code's global evaluation), or, with
        ``evaluation='own'``, the client's own model."""
        return Message({"head": self.head.clone()}) if self.settings.evaluation == "global" else None

    def state_dict(self) -> dict:
        return {"head": self.head, "generator": self.params, "generator_stats": self.stats,
                "adam": dict(self.adam), "losses": dict(self.losses)}

    def load_state_dict(self, state: dict) -> None:
        self.head = state["head"].clone()
        self.params = state["generator"].clone()
        self.stats = state["generator_stats"].clone()
        adam = state["adam"]
        steps = adam["steps"] if "steps" in adam else adam["step"]  # "step": checkpoints before the engine's Adam
        self.adam = {"exp_avg": adam["exp_avg"].clone(), "exp_avg_sq": adam["exp_avg_sq"].clone(), "steps": int(steps)}
        self.losses = dict(state["losses"])
