"""Typed records read from another process: each field's type and bounds, checked on receipt.

Everything the control plane reads from a socket (and everything a session's configuration holds)
is a JSON object that another process wrote, so it is untrusted input: a `Record` names the fields
such an object may have, the type and range of each, and which are required, and `Record.check`
accepts an object only if it has exactly those (no unknown field, nothing of the wrong type, no
number out of range, no string or list longer than its bound). A record that fails raises
`BadRecord`, whose message names the record, the field and what was expected: the control plane
drops the connection that sent it (`lightning_prague.core.plane.server`), a configuration is
refused to the rank that sent it.

The checks are plain functions of a value (`Check`), so one mechanism serves the wire's records
(`lightning_prague.core.protocol`) and the grouping policies' specs
(`lightning_prague.core.grouping.policies.policy_from_spec`). Nothing here is decoded into code:
the values stay JSON (numbers, strings, booleans, lists and objects of them).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: the largest integer a field may hold unless it says otherwise (JSON numbers are exact up to here)
MAX_INT = (1 << 53) - 1


class BadRecord(ValueError):
    """An object read from another process is not the record it should be."""


@dataclass(frozen=True)
class Check:
    """One field's rule: `accepts(value)` and, for errors, `what` it must be."""

    accepts: Callable[[Any], bool]
    what: str

    def __call__(self, value: Any) -> bool:
        return self.accepts(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(low: int = 0, high: int = MAX_INT) -> Check:
    return Check(lambda v: _is_int(v) and low <= v <= high, f"an integer from {low} to {high}")


def number(low: float = 0.0, high: float = float(MAX_INT)) -> Check:
    """A finite number (an integer counts) in [low, high]."""
    return Check(
        lambda v: (_is_int(v) or isinstance(v, float)) and math.isfinite(v) and low <= v <= high,
        f"a finite number from {low:g} to {high:g}",
    )


BOOLEAN = Check(lambda v: isinstance(v, bool), "true or false")


def text(max_length: int = 256) -> Check:
    return Check(lambda v: isinstance(v, str) and len(v) <= max_length, f"a string of at most {max_length} characters")


def hex_digest(length: int = 64) -> Check:
    digits = frozenset("0123456789abcdef")
    return Check(
        lambda v: isinstance(v, str) and len(v) == length and set(v) <= digits,
        f"{length} lower-case hexadecimal digits",
    )


def one_of(*values: str) -> Check:
    return Check(lambda v: isinstance(v, str) and v in values, f"one of {', '.join(map(repr, values))}")


def list_of(item: Check, max_items: int) -> Check:
    return Check(
        lambda v: isinstance(v, list) and len(v) <= max_items and all(item(x) for x in v),
        f"a list of at most {max_items} items, each {item.what}",
    )


def pair_of(item: Check) -> Check:
    """A list of exactly two items, each `item`."""
    return Check(lambda v: isinstance(v, list) and len(v) == 2 and all(item(x) for x in v), f"a pair of {item.what}")


def optional(check: Check) -> Check:
    """`check`'s values, or null."""
    return Check(lambda v: v is None or check(v), f"{check.what}, or null")


def json_object(max_keys: int = 64) -> Check:
    """A JSON object (checked further by whoever reads it, e.g. a nested `Record`)."""
    return Check(lambda v: isinstance(v, dict) and len(v) <= max_keys, f"an object of at most {max_keys} fields")


@dataclass(frozen=True)
class Record:
    """A kind of object: the fields it must have (`required`) and may have (`optional`), each with its `Check`."""

    name: str
    required: Mapping[str, Check]
    optional: Mapping[str, Check] = field(default_factory=dict)

    def check(self, obj: Any) -> dict[str, Any]:
        """`obj` itself if it is this record; raises `BadRecord` naming what is wrong."""
        if not isinstance(obj, dict):
            raise BadRecord(f"{self.name}: expected a JSON object, got {type(obj).__name__}")
        for key, rule in self.required.items():
            if key not in obj:
                raise BadRecord(f"{self.name}: field {key!r} is missing (it must be {rule.what})")
        for key, value in obj.items():
            rule = self.required.get(key) or self.optional.get(key)
            if rule is None:
                raise BadRecord(f"{self.name}: unknown field {str(key)[:40]!r}")
            if not rule(value):
                raise BadRecord(f"{self.name}: field {key!r} is {_shown(value)}, but it must be {rule.what}")
        return obj


def _shown(value: Any) -> str:
    text_ = repr(value)
    return text_ if len(text_) <= 60 else text_[:57] + "..."


def environment_number(name: str, kind: type[int] | type[float], low: float, high: float, must_be: str) -> Any:
    """The number environment variable `name` holds (a `kind`), `None` where it is unset or empty;
    `ConfigurationError` naming it (`must_be`: what it must be) for anything else or out of `low`-`high`."""
    from lightning_prague.core.errors import ConfigurationError

    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise ConfigurationError(f"{name}={text!r} is invalid: it must be {must_be}")
    return value
