"""Per-client architectures (Fed-CMA's model heterogeneity): parse the scenario's
``architectures`` entries and build one model per distinct entry, checking that they all end
in the same embedding size (only the classifier and the class-mean embeddings are shared).

Their embeddings are bounded to [0, 1] by default, as Fed-CMA's analysis assumes (its
Assumption 2): every model with an ``embedding_activation`` option gets 'sigmoid' unless the
entry or the run's model options say otherwise (``--set model.embedding_activation=relu``).
The registry's models all have it except ``resnet9``, whose embedding is a max-pool of ReLUs.

An entry is a registered model name, optionally with options in call syntax:
``"fedgen-cnn"``, ``"mlp(hidden=(128, 32))"``, ``"digits-cnn(embedding_dim=32)"``.
"""
from __future__ import annotations

import ast
from typing import Optional, Sequence

from torch import nn

from .registry import MODELS, build_model


def parse_architecture(entry: str) -> tuple[str, dict]:
    """(model name, options) of one ``architectures`` entry.

    Raises:
        ValueError: not a string, an unknown model, or options that are not literals.
    """
    if not isinstance(entry, str) or not entry.strip():
        raise ValueError(f"an architectures entry must be a model name such as 'mlp(hidden=(64,))', got {entry!r}")
    text = entry.strip()
    name = text.split("(", 1)[0].strip()
    if name not in MODELS:
        raise ValueError(f"architectures entry {entry!r}: unknown model {name!r}; valid models: {sorted(MODELS)}")
    if name == text:
        return name, {}
    try:
        call = ast.parse(text.replace(name, "f", 1), mode="eval").body
        if not isinstance(call, ast.Call) or call.args:
            raise ValueError("only keyword options are allowed")
        options = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"architectures entry {entry!r}: options must be written name(key=literal, ...): "
                         f"{error}") from error
    return name, options


EMBEDDING_BOUND = "sigmoid"  # the embedding activation of a mixed federation's models by default


def build_client_models(architectures: Sequence[str], *, input_shape: Sequence[int], num_classes: int,
                        options: Optional[dict] = None) -> dict[str, nn.Module]:
    """One freshly initialized model per distinct entry of ``architectures``.

    ``options`` (the run's model options) are passed to every architecture that accepts
    them; an entry's own options override them; an ``embedding_activation`` neither gives is
    :data:`EMBEDDING_BOUND` (module docstring).

    Raises:
        ValueError: an entry that does not parse or build, or models whose embedding sizes
            differ (the message lists each architecture's size).
    """
    models: dict[str, nn.Module] = {}
    for entry in dict.fromkeys(architectures):
        name, own = parse_architecture(entry)
        accepted = MODELS[name].defaults
        bound = {"embedding_activation": EMBEDDING_BOUND} if "embedding_activation" in accepted else {}
        merged = {**bound, **{k: v for k, v in (options or {}).items() if k in accepted}, **own}
        models[entry] = build_model(name, input_shape=input_shape, num_classes=num_classes, **merged)
    sizes = {entry: int(model.embedding_dim) for entry, model in models.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the architectures must end in the same embedding size; got {sizes} "
                         "(set embedding_dim or hidden widths so they agree)")
    return models
