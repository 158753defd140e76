"""Named parameter groups: which parameters form ``body``, ``head``, ``u``, ``alpha``, ... and
which groups never leave their client.

Groups are declared, never found by name in several places: the model contributes ``body``
and ``head`` (the head is found once, by ``models.base.head_parameter_names``), an algorithm
may declare more (Factorized-FL's ``u``, ``v``, ``mu``; pFedMB's ``alpha``, ``branches``) as
:class:`GroupRule` s that claim parameters before the model's groups do.  Every parameter
belongs to exactly one group: the first rule (algorithm rules first, then ``head``, then
``body``) that selects it.

A client's flat parameter vector is ordered by group: shared groups first, then local ones,
each in the order of its first parameter in the model.  Each group is then one contiguous range of a bank row, and so is
everything a client may send.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

from torch import nn

# select(qualified parameter name, the module owning it, the parameter's attribute name)
Selector = Callable[[str, nn.Module, str], bool]

# The floating buffers (BatchNorm running statistics) travel as this pseudo-group.
BUFFERS = "buffers"


@dataclass(frozen=True)
class GroupRule:
    """A group an algorithm declares: the parameters ``select`` accepts (that no earlier rule took).

    ``modules``: optional module types the owner must be an instance of (e.g. the factorized
    layers), checked before ``select``; ``attributes``: optional parameter attribute names
    (e.g. ``("u",)``).  A rule with neither and no ``select`` is refused.  ``outside_head``:
    the rule never takes the model's head (the classifier, found once by the model), which then
    stays in the ``head`` group.
    """

    name: str
    modules: tuple[type, ...] = ()
    attributes: tuple[str, ...] = ()
    select: Optional[Selector] = None
    outside_head: bool = False

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str) or self.name == BUFFERS:
            raise ValueError(f"a group name must be a non-empty string other than {BUFFERS!r}, got {self.name!r}")
        if not (self.modules or self.attributes or self.select):
            raise ValueError(f"group {self.name!r} selects nothing: give modules, attributes or select")

    def takes(self, name: str, owner: nn.Module, attribute: str) -> bool:
        """Whether this rule selects the parameter ``name`` (attribute ``attribute`` of ``owner``)."""
        if self.modules and not isinstance(owner, self.modules):
            return False
        if self.attributes and attribute not in self.attributes:
            return False
        return self.select is None or bool(self.select(name, owner, attribute))


@dataclass(frozen=True)
class Groups:
    """The groups of one architecture: each group's parameter names and which groups are local.

    Attributes:
        order: group names, shared ones first, then local ones (each part in model order).
        members: group name -> qualified parameter names (model order within a group).
        local: names of the groups that never leave a client.
    """

    order: tuple[str, ...]
    members: Mapping[str, tuple[str, ...]]
    local: frozenset

    @property
    def shared(self) -> tuple[str, ...]:
        """The groups a client may send, in layout order."""
        return tuple(g for g in self.order if g not in self.local)

    def group_of(self, parameter: str) -> str:
        """The group holding ``parameter``."""
        for group, names in self.members.items():
            if parameter in names:
                return group
        raise KeyError(f"{parameter!r} is in no group")

    def layout_key(self, parameter: str) -> int:
        """Sort key of ``parameter`` in the flat vector: its group's position in :attr:`order`."""
        return self.order.index(self.group_of(parameter))


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def declare_groups(model: nn.Module, rules: Sequence[GroupRule], *, head: Iterable[str],
                   local: Iterable[str]) -> Groups:
    """Assign every parameter of ``model`` to a group: ``rules`` first, then ``head``, then ``body``.

    Args:
        model: the architecture (its ``named_parameters`` order is kept within a group).
        rules: the algorithm's groups, in priority order.
        head: the qualified names of the classifier's parameters (the model's ``head`` group).
        local: names of the groups that never leave a client.  A name that is no group of
            this model is ignored (e.g. ``head`` for a model whose head a rule took).

    Groups that end up empty are dropped; the others are ordered by their first parameter in
    ``model``'s order (for the registry's models: ``body`` before ``head``, as before groups).

    Raises:
        ValueError: two rules with one name, or a rule named ``head``/``body``.
    """
    names = [r.name for r in rules]
    clash = sorted({n for n in names if names.count(n) > 1} | ({"head", "body"} & set(names)))
    if clash:
        raise ValueError(f"group names must be distinct and not 'head' or 'body' (the model's own): {clash}")
    head = set(head)
    members: dict[str, list[str]] = {name: [] for name in [*names, "head", "body"]}
    for name, _ in model.named_parameters():
        owner, attribute = _owner(model, name)
        chosen = next((r.name for r in rules if not (r.outside_head and name in head)
                       and r.takes(name, owner, attribute)), None)
        members[chosen or ("head" if name in head else "body")].append(name)
    position = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    declared = sorted((g for g in members if members[g]), key=lambda g: position[members[g][0]])
    local = frozenset(local) & set(declared)
    order = tuple([g for g in declared if g not in local] + [g for g in declared if g in local])
    return Groups(order=order, members={g: tuple(members[g]) for g in order}, local=local)
