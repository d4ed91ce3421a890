"""watchdogd: a per-node watchdog daemon for GPU training nodes.

The daemon holds deadline timers armed by local processes (over a torch
compatible FIFO and a Unix socket) and kills the processes whose timers
expire. Trainers use the thin client, :mod:`watchdogd_client`.

Layers, arrows pointing down only (import-linter contracts in the tests
keep it so)::

    cli -> daemon -> groups, service -> linux, core

``core`` is pure logic, ``linux`` thin OS wrappers, ``service`` the timer
service at runtime, ``groups`` worker groups, ``daemon`` the composition
root, ``cli`` the commands. Importing this package imports nothing else.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
