"""Faults on demand, in the worker: what ``watchdogd run --inject`` asks of a rank.

A worker group whose daemon enables ``fault_injection`` hands each worker
:data:`FAULT_SIGNAL_ENV` (a real-time signal) and :data:`FAULT_FILE_ENV` (a
file only the daemon writes). The first timer client made in the main
thread installs a handler for that signal; the daemon writes the fault
into the file and sends the signal, and the handler carries it out:

- ``exit``: ``os._exit(code)``, at once, wherever the worker is;
- ``hang``: the next release (of any timer client, so the end of the next
  :class:`~watchdogd_client.expires` block) never comes, so its timer
  expires as a real hang's would (stack dump, kill, restart);
- ``slow``: every ``expires`` block takes ``factor`` times as long (the
  rest is slept before its release).

``sigstop`` and ``kill`` need no help from the worker: the daemon sends
them. Without the environment nothing is installed, and the hot path pays
one attribute check. A fault file that cannot be read is ignored: a drill
never crashes the trainer by itself. A forked child starts without the
fault.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import msgspec

__all__ = [
    "FAULT_FILE_ENV",
    "FAULT_SIGNAL_ENV",
    "active",
    "hang_if_injected",
    "install",
    "slow_down",
]

FAULT_SIGNAL_ENV = "WATCHDOGD_FAULT_SIGNAL"
FAULT_FILE_ENV = "WATCHDOGD_FAULT_FILE"


class Injected(msgspec.Struct, frozen=True):
    """What the daemon writes into the fault file before it sends the signal."""

    kind: str
    code: int = 1
    factor: float = 2.0


active: Injected | None = None
"""The fault ``expires`` blocks act on now (``hang`` or ``slow``); None: none."""
_installed = False
_decoder = msgspec.json.Decoder(Injected)


def install() -> None:
    """Take the fault signal, if the daemon offers injection (the main thread only, once)."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    number = os.environ.get(FAULT_SIGNAL_ENV)
    if not number or FAULT_FILE_ENV not in os.environ:
        return
    signal.signal(int(number), _on_fault)
    _installed = True


def _on_fault(signum: int, frame: object) -> None:
    global active
    try:
        with open(os.environ[FAULT_FILE_ENV], "rb") as file:
            fault = _decoder.decode(file.read())
    except (OSError, KeyError, msgspec.DecodeError):
        return  # not the daemon's doing: nothing to act on
    if fault.kind == "exit":
        os._exit(fault.code)
    active = fault


def hang_if_injected() -> None:
    """Before a release: an injected hang never lets it go out."""
    if active is not None and active.kind == "hang":
        while True:  # as a hung collective: the timer is never released
            time.sleep(3600)


def slow_down(entered: float | None) -> None:
    """At the end of an ``expires`` block entered at ``entered``: an injected slowdown."""
    if active is not None and active.kind == "slow" and entered is not None:
        time.sleep((active.factor - 1) * (time.monotonic() - entered))


def _forget_after_fork() -> None:
    global active
    active = None  # the daemon injected it into the parent, not into this child


os.register_at_fork(after_in_child=_forget_after_fork)
