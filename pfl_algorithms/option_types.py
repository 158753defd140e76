"""The declared type of a setting, and the one check every setting goes through.

A setting is declared by a type hint: a ``RunConfig`` field, a field of an algorithm's
``Settings`` dataclass, or a keyword-only option of a dataset loader, a scenario or a model.
``Annotated`` markers give its range: ``Annotated[float, Range(gt=0)]``,
``Annotated[str, OneOf(("sgd", "adam"))]``.  ``check_value`` accepts a value only if it has
that type and lies in that range, and otherwise raises a ValueError of one line that names
the key and what was expected::

    scenario.alpha must be a finite number > 0, got nan

What each type admits (values come from TOML, JSON, ``--set`` or Python):

- ``bool``: True or False only (not 0, 1 or "maybe");
- ``int``: an int, never a bool or a float (1.5 and 2.0 are refused);
- ``float``: an int or a float, finite (an int becomes a float);
- ``str``: a string;  ``None`` (from ``Optional``): None;  ``Any``: anything;
- ``Sequence[T]``, ``tuple[T, ...]``, ``tuple[A, B, C]``: a list or tuple (never a string)
  whose items are of those types;
- ``dict``: a table (a dict with string keys);
- ``Union[...]``: one of its members.  A value is matched against the members of its own
  kind first, so in ``Union[float, int]`` an int is checked as an int (``sample``: 1 is one
  client, 1.0 all of them).
"""
from __future__ import annotations

import collections.abc
import inspect
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Annotated, Union

_NOT_ACCEPTED = object()  # what _normalize returns for a value the type does not admit


@dataclass(frozen=True)
class Range:
    """Bounds of a number: ``ge``/``gt`` below, ``le``/``lt`` above (None: unbounded)."""

    ge: Any = None
    gt: Any = None
    le: Any = None
    lt: Any = None

    def admits(self, value) -> bool:
        """Whether ``value`` lies within the bounds."""
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def __str__(self) -> str:
        low = (f"[{self.ge}" if self.ge is not None else f"({self.gt}") if (self.ge, self.gt) != (None, None) else None
        high = (f"{self.le}]" if self.le is not None else f"{self.lt})") if (self.le, self.lt) != (None, None) else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f">= {self.ge}" if self.ge is not None else f"> {self.gt}"
        return f"<= {self.le}" if self.le is not None else f"< {self.lt}"


@dataclass(frozen=True)
class OneOf:
    """A value from a fixed set of choices (names of a registry, modes)."""

    choices: tuple

    def admits(self, value) -> bool:
        """Whether ``value`` is one of the choices (compared with its type, so True is not 1)."""
        return any(type(value) is type(choice) and value == choice for choice in self.choices)

    def __str__(self) -> str:
        return "one of " + ", ".join(repr(choice) for choice in self.choices)


# The ranges most settings use.
PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]
Fraction = Annotated[float, Range(ge=0, le=1)]
SplitFractions = tuple[Fraction, Fraction, Fraction]  # (train, val, test); the sum is checked apart


def check_value(key: str, value, hint):
    """``value`` if it is of the declared type ``hint`` (ints declared float become floats).

    Raises:
        ValueError: ``"<key> must be <what hint admits>, got <value>"``, on one line.
    """
    normalized = _normalize(hint, value)
    if normalized is _NOT_ACCEPTED:
        raise ValueError(f"{key} must be {describe(hint)}, got {_shown(value)}")
    return normalized


def describe(hint) -> str:
    """What ``hint`` admits, in words: ``"an integer >= 1"``, ``"none or a finite number > 0"``."""
    base, markers = _unannotated(hint)
    if markers:
        constraint = " and ".join(str(m) for m in markers)
        if any(isinstance(m, OneOf) for m in markers):
            return constraint
        return f"{describe(base)} {constraint}"
    origin, args = typing.get_origin(base), typing.get_args(base)
    if origin is Union or origin is types.UnionType:
        members = " or ".join(describe(a) for a in args if a is not type(None))
        return f"{members}, or none" if type(None) in args else members
    if origin in (tuple, list, collections.abc.Sequence):
        if origin is tuple and args and args[-1] is not Ellipsis:
            kinds = {describe(a) for a in args}
            item = kinds.pop() if len(kinds) == 1 else "values"
            return f"a list of {len(args)} {_plural(item)}"
        return f"a list of {_plural(describe(args[0]))}" if args else "a list"
    if origin is dict or base is dict:
        return "a table (key = value)"
    return _NAMES.get(base, getattr(base, "__name__", str(base)))


def keyword_hints(fn) -> dict:
    """The declared types of the keyword-only parameters of ``fn`` (a function, or a class
    whose ``__init__`` takes them), unwrapping decorators; a parameter without a hint gets Any."""
    target = inspect.unwrap(fn.__init__ if inspect.isclass(fn) else fn)
    hints = typing.get_type_hints(target, include_extras=True)
    return {p.name: hints.get(p.name, Any) for p in inspect.signature(target).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def field_hints(cls) -> dict:
    """The declared types of a dataclass's fields."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {name: hints[name] for name in cls.__dataclass_fields__}


def check_options(prefix: str, options: dict, hints: dict) -> dict:
    """``options`` with every value checked against ``hints`` (keys named ``prefix.key``);
    the caller has already refused names that ``hints`` lacks."""
    return {name: check_value(f"{prefix}.{name}", value, hints[name]) for name, value in options.items()}


_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
          type(None): "none", Any: "any value"}


def _plural(text: str) -> str:
    """``"a finite number > 0"`` -> ``"finite numbers > 0"`` (the items of a list)."""
    for article in ("an ", "a "):
        if text.startswith(article):
            text = text[len(article):]
            for noun in ("integer", "number", "string", "list", "table"):
                if noun in text:
                    return text.replace(noun, noun + "s", 1)
            return text
    return f"values, each {text}"


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unannotated(hint) -> tuple:
    """(the type inside ``Annotated``, its Range/OneOf markers)."""
    if typing.get_origin(hint) is Annotated:
        return hint.__origin__, [m for m in hint.__metadata__ if isinstance(m, (Range, OneOf))]
    return hint, []


def _kind(hint):
    """The Python type a (possibly annotated) member of a Union is about, to match values of
    the same kind first."""
    base, _ = _unannotated(hint)
    origin = typing.get_origin(base)
    if origin in (tuple, list, collections.abc.Sequence):
        return (list, tuple)
    return origin or base


def _normalize(hint, value):
    """``value`` as ``hint`` admits it (ints declared float become floats, items of lists
    likewise), or _NOT_ACCEPTED."""
    base, markers = _unannotated(hint)
    origin, args = typing.get_origin(base), typing.get_args(base)
    if origin is Union or origin is types.UnionType:
        own = [a for a in args if _kind(a) is type(value) or (isinstance(_kind(a), tuple)
                                                              and isinstance(value, _kind(a)))]
        for member in own or args:
            result = _normalize(member, value)
            if result is not _NOT_ACCEPTED:
                return result
        return _NOT_ACCEPTED
    result = _normalize_plain(base, origin, args, value)
    if result is _NOT_ACCEPTED or not all(marker.admits(result) for marker in markers):
        return _NOT_ACCEPTED
    return result


def _normalize_plain(base, origin, args, value):
    if base is Any:
        return value
    if base is type(None):
        return value if value is None else _NOT_ACCEPTED
    if base is bool:
        return value if isinstance(value, bool) else _NOT_ACCEPTED
    if base is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else _NOT_ACCEPTED
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return _NOT_ACCEPTED
        return float(value)
    if base is str:
        return value if isinstance(value, str) else _NOT_ACCEPTED
    if base is dict or origin is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
        return value if ok else _NOT_ACCEPTED
    if origin in (tuple, list, collections.abc.Sequence) or base in (tuple, list):
        if not isinstance(value, (list, tuple)):
            return _NOT_ACCEPTED
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                return _NOT_ACCEPTED
            items = [_normalize(a, v) for a, v in zip(args, value)]
        else:
            item = args[0] if args else Any
            items = [_normalize(item, v) for v in value]
        if any(i is _NOT_ACCEPTED for i in items):
            return _NOT_ACCEPTED
        return type(value)(items)
    raise TypeError(f"option_types cannot check values of the declared type {base!r}")
