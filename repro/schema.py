"""Typed loading of JSON into frozen dataclasses, with one-line errors that name the file and the field.

:func:`from_json` refuses a missing or unknown field or a mistyped value with a :class:`~repro.errors.ReproError`::

    results/runs/a/record.json: field 'efficiency.iter_time_ms' must be a number, got str ('fast')

Field types: ``str``, ``int``, ``float`` (ints accepted, bools not), ``bool``, ``Any``, ``dict[str, Any]`` (as
is), ``tuple[X, ...]`` (from a list), ``X | None``, nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from repro.errors import ReproError

D = TypeVar("D")

_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object"}


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} ({text})"


def _convert(value: Any, tp: Any, where: str, origin: str) -> Any:
    """``value`` checked against ``tp`` and converted (dataclasses built, lists to tuples)."""
    if tp is Any:
        return value
    args = typing.get_args(tp)
    kind = typing.get_origin(tp)
    if kind in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_null = [a for a in args if a is not type(None)]
        if len(non_null) != 1:
            raise TypeError(f"unsupported union {tp} at {where}")
        return _convert(value, non_null[0], where, origin)
    if value is None:
        raise ReproError(f"{origin}: field '{where}' must not be null")
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where, origin)
    if kind is tuple:
        if not isinstance(value, (list, tuple)):
            raise ReproError(f"{origin}: field '{where}' must be a list, got {_describe(value)}")
        return tuple(_convert(item, args[0], f"{where}[{i}]", origin) for i, item in enumerate(value))
    if kind is dict or tp is dict:
        if not isinstance(value, dict):
            raise ReproError(f"{origin}: field '{where}' must be an object, got {_describe(value)}")
        return value
    if tp in (str, int, float, bool):
        # an int is a number; a bool is neither
        valid = isinstance(value, (int, float) if tp is float else tp)
        if not valid or (tp in (int, float) and isinstance(value, bool)):
            raise ReproError(f"{origin}: field '{where}' must be {_TYPE_WORDS[tp]}, got {_describe(value)}")
        if tp is float and not math.isfinite(value):
            raise ReproError(f"{origin}: field '{where}' must be a finite number, got {value}")
        return float(value) if tp is float else value
    raise TypeError(f"unsupported field type {tp!r} at {where}")


def _build(cls: type[D], data: Any, where: str, origin: str) -> D:
    label = f"field '{where}'" if where else "the top level"
    if not isinstance(data, dict):
        raise ReproError(f"{origin}: {label} must be an object, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        name = f"{where}.{unknown[0]}" if where else unknown[0]
        raise ReproError(f"{origin}: unknown field '{name}' (valid: {', '.join(fields)})")
    kwargs = {}
    for name, field in fields.items():
        path = f"{where}.{name}" if where else name
        if name not in data:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                raise ReproError(f"{origin}: missing field '{path}'")
            continue
        kwargs[name] = _convert(data[name], hints[name], path, origin)
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a dataclass's own __post_init__ check
        raise ReproError(f"{origin}: {label}: {exc}") from None


def from_json(cls: type[D], data: Any, origin: str) -> D:
    """Build the frozen dataclass ``cls`` from parsed JSON, checking every field.

    Args:
        cls: a dataclass with the supported field types (module docstring).
        origin: name used in errors, usually the file path.

    Raises:
        ReproError: a missing or unknown field, or a value of the wrong type, named by its dotted path.
    """
    return _build(cls, data, "", origin)


def check_minimums(obj: Any, section: str = "", /, **minimums: float) -> None:
    """ValueError for the first attribute of ``obj`` below its minimum or not finite (None passes), named
    ``section.name`` when ``section`` is given."""
    for name, low in minimums.items():
        value, key = getattr(obj, name), f"{section}.{name}" if section else name
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} must be a finite number, got {value}")
        if value < low:
            raise ValueError(f"{key} must be >= {low:g}, got {value}")


def flatten(data: Mapping[str, Any], keep: tuple[str, ...] = (), prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"schedule.steps": 30, ...}``, in order; mappings under a key in ``keep`` stay whole."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and key not in keep:
            out.update(flatten(value, keep, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def to_json(obj: Any) -> Any:
    """The plain JSON form of a :func:`from_json` dataclass or any JSON-able value."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_json(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    return obj
