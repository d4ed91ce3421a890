"""Faults on demand, as an operator writes them: ``hang:rank=1:after=30``. Pure.

``KIND[:VALUE][:KEY=VALUE...]``: ``hang``, ``sigstop``, ``kill``,
``exit[:CODE]`` and ``slow[:FACTOR]``, with ``rank=`` (a global rank,
required) and ``after=`` (seconds, default 0). The value is checked by
:class:`~watchdogd_client.groups.Fault`; every error names the part that
is wrong.
"""

from __future__ import annotations

import msgspec

from watchdogd_client.groups import Fault

__all__ = ["parse_fault"]

_VALUE_OF = {"exit": "code", "slow": "factor"}


def parse_fault(text: str) -> Fault:
    """The :class:`Fault` ``text`` names; ValueError saying what is wrong."""
    kind, *parts = text.split(":")
    fields: dict[str, str] = {"kind": kind}
    for index, part in enumerate(parts):
        key, equals, value = part.partition("=")
        if not equals:
            if index or kind not in _VALUE_OF:
                raise ValueError(f"{text!r}: {part!r} is not KEY=VALUE")
            key, value = _VALUE_OF[kind], part
        if key in fields:
            raise ValueError(f"{text!r}: {key} is given twice")
        fields[key] = value
    if "rank" not in fields:
        raise ValueError(f"{text!r}: which rank? add :rank=N")
    try:
        return msgspec.convert(fields, Fault, strict=False)  # "30" is 30
    except msgspec.ValidationError as e:
        raise ValueError(f"{text!r}: {e}") from None
