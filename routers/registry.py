"""Name -> router class registry (:func:`register_router`), and the public builder. The built-in routers and
those of any installed package's entry-point group ``dirmoe_bench.routers`` are imported on the first lookup, so
a package adds a router without editing this repository (docs/routers.md, "Adding a router").
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import warnings
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import TypeVar

from routers.base import Router

R = TypeVar("R", bound=type[Router])

_REGISTRY: dict[str, type[Router]] = {}
_BUILTIN_MODULES = ("routers.dirmoe", "baselines")  # imported lazily: baselines import routers.base (a cycle otherwise)
ENTRY_POINT_GROUP = "dirmoe_bench.routers"


def register_router(name: str) -> Callable[[R], R]:
    """Class decorator: register a :class:`Router` subclass under ``name`` and set ``cls.name``."""

    def decorate(cls: R) -> R:
        if not (isinstance(cls, type) and issubclass(cls, Router)):
            raise TypeError(f"register_router('{name}') needs a Router subclass, got {cls!r}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not cls and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"router name '{name}' is already registered by {existing.__module__}.{existing.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


@contextlib.contextmanager
def quiet_megatron_import() -> Iterator[None]:
    """Silence megatron-core's import-time notices that TransformerEngine and Apex are absent (expected on CPU)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="(Transformer Engine and Apex are|Apex is) not installed", category=UserWarning
        )
        yield


@functools.cache
def _load_builtins() -> None:
    """Import the built-in routers and every :data:`ENTRY_POINT_GROUP` entry point, once per process."""
    with quiet_megatron_import():
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()
        except Exception as exc:  # noqa: BLE001 - any import failure of a plug-in is reported the same way
            raise ImportError(
                f"router entry point '{entry.name} = {entry.value}' ({ENTRY_POINT_GROUP}) failed to import: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


def available_routers() -> list[str]:
    """Names of all registered routers, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def router_class(name: str) -> type[Router]:
    """The class registered under ``name``; ``ValueError`` listing the valid names otherwise."""
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ";"
        raise ValueError(f"unknown router '{name}'{hint} available: {', '.join(sorted(_REGISTRY))}") from None


def build_router(name: str, *, hidden_size: int, num_experts: int, top_k: int = 1, **options) -> Router:
    """Build router ``name`` with D, E, k and ``options`` (fields of its ``Config``). ``ValueError`` for an
    unknown name or option (listing the valid ones) or an invalid value."""
    cls = router_class(name)
    valid = cls.Config.option_names()
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for router '{name}'; valid: {', '.join(valid) or '(none)'}"
        )
    config = cls.Config(hidden_size=hidden_size, num_experts=num_experts, top_k=top_k, **options)
    return cls(config)

