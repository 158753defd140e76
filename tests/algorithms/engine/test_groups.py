"""Parameter groups: a rule's ``outside_head`` leaves the model's classifier in ``head``."""
from __future__ import annotations

from torch import nn

from pfl_algorithms.engine.groups import GroupRule, declare_groups
from pfl_algorithms.models.base import head_parameter_names
from tests.algorithms.algorithms.federation_cases import TinyNet


def test_outside_head_leaves_the_classifier_in_head():
    model = TinyNet()
    head = head_parameter_names(model)
    weights = GroupRule("weights", modules=(nn.Linear,), attributes=("weight",), outside_head=True)
    groups = declare_groups(model, [weights], head=head, local=())
    assert groups.members["weights"] == ("body.0.weight",)
    assert groups.members["head"] == ("head.weight", "head.bias")
    everywhere = GroupRule("weights", modules=(nn.Linear,), attributes=("weight",))
    groups = declare_groups(model, [everywhere], head=head, local=())
    assert groups.members["weights"] == ("body.0.weight", "head.weight")
    assert groups.members["head"] == ("head.bias",)
