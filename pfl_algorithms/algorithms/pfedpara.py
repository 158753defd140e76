"""pFedPara (Hyeon-Woo, Ye-Bin and Oh, ICLR 2022, Sec. 3.3): every Linear and Conv2d weight is

    W = W1 ⊙ (W2 + 1),   W1 = X1 Y1ᵀ,  W2 = X2 Y2ᵀ   (convolutions: the tensor form of
                                                       Proposition 3, W_i = T_i ×₁ X_i ×₂ Y_i)

W1's factors (group ``w1``) are global: clients train from the server's, and the server
averages them weighted by data size as FedAvg does; W2's factors (group ``w2``) never leave
their client.  Biases and BatchNorm parameters travel with ``w1`` (group ``body``), as in a
FedAvg of everything but W2.  The classifier is converted too (the paper factorizes every
layer): its X1, Y1 and bias form the model's ``head`` group (shared, or local where the
scenario keeps the head local), its X2, Y2 are in ``w2``.

The rank comes from the paper's ratio γ (``ratio``, ``pfl_kernels.nn.fedpara``):
γ = 0.5 is the ratio of the Flower baseline's pFedPara config, which replicates the paper's
personalization experiment (the paper's text we have does not state γ for it).  What
travels is W1 with the biases and BatchNorm parameters: on our ResNet-9 at γ = 0.5 that is
18.7 % of FedAvg's parameters per message (0.48 M of 2.57 M); Factorized-FL's Table 1 reports
pFedPara at 7.4 against FedAvg's 20.39 (36.3 %), which our count matches within 2 % at γ = 0.8
(35.8 %; tests/algorithms/algorithms/test_pfedpara_afl.py).
Clients are evaluated with the global W1 (and shared groups) and their own W2.
``init`` draws the factors: 'variance' (ours: W1, W2 with the replaced weight's variance) or
'he' (the authors' He-normal per factor; ``pfl_kernels.nn.fedpara``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from ..api import FEDPARA_LAYERS, Fraction, GroupRule, OneOf, fedpara
from .fedavg import FedAvg


@dataclass(frozen=True)
class PFedParaSettings:
    ratio: Fraction = 0.5  # γ: the rank between r_min (0) and the parameter-count bound r_max (1)
    init: Annotated[str, OneOf(("variance", "he"))] = "variance"  # the factors' draw (module docstring)


class PFedPara(FedAvg):
    """FedAvg of the low-rank Hadamard factors W1; the W2 factors stay with each client."""

    name = "pfedpara"
    description = "W = W1 ⊙ (W2 + 1) with low-rank W1, W2; W1 is averaged (FedAvg), W2 stays local"
    Settings = PFedParaSettings

    def prepare_model(self, model):
        return fedpara(model, self.settings.ratio, self.settings.init)

    def group_rules(self):
        return (GroupRule("w1", modules=FEDPARA_LAYERS, attributes=("x1", "y1", "t1"), outside_head=True),
                GroupRule("w2", modules=FEDPARA_LAYERS, attributes=("x2", "y2", "t2")))

    def local_groups(self, *, keep_head_local):
        return {"w2"} | super().local_groups(keep_head_local=keep_head_local)
