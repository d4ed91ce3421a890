"""Code that configuration names: ``module:attribute`` references and entry points.

Loading either imports someone's module and so runs their code; whatever
goes wrong there is a :class:`PluginError` that names what was asked for,
never a traceback out of the daemon.
"""

from __future__ import annotations

import importlib
from importlib import metadata

__all__ = [
    "LOGS_SPECS_GROUP",
    "PluginError",
    "has_entry_point",
    "load_entry_point",
    "load_reference",
    "not_found",
]

LOGS_SPECS_GROUP = "torchrun.logs_specs"  # torchrun's: where it finds --logs-specs NAME


class PluginError(Exception):
    """Named code that cannot be found or imported; the message says which and why."""


def load_reference(reference: str) -> object:
    """The object ``package.module:attribute`` names."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise PluginError(f"{reference!r} is not a 'module:attribute' reference")
    try:
        target: object = importlib.import_module(module_name)
        for part in attribute.split("."):
            target = getattr(target, part)
    except Exception as e:  # their module's code: anything may fail in it
        raise PluginError(f"cannot load {reference!r}: {type(e).__name__}: {e}") from None
    return target


def has_entry_point(group: str, name: str) -> bool:
    """Whether a distribution offers entry point ``name`` of ``group`` (nothing is imported)."""
    return bool(metadata.entry_points(group=group, name=name))


def not_found(group: str, name: str) -> str:
    """What is said of a missing entry point, in torchrun's words."""
    return f"Could not find entrypoint under '{group}[{name}]' key"


def load_entry_point(group: str, name: str) -> object | None:
    """The object behind entry point ``name`` of ``group`` (None: no distribution offers it)."""
    found = metadata.entry_points(group=group, name=name)
    if not found:
        return None
    entry = next(iter(found))
    try:
        loaded: object = entry.load()
    except Exception as e:  # their module's code: anything may fail in it
        raise PluginError(
            f"cannot load entry point {group}[{name}] = {entry.value!r}: {type(e).__name__}: {e}"
        ) from None
    return loaded
