"""The timer service at runtime: the timer core (arm, release, the expiry
loop), the process watch, the reaper, the observers of ended timers (the
timeline, the scope recorder), the queries, the FIFO front, the socket
``Session`` (sans-IO) and its transport, persistence, the event log, the GPU
status cache, stats, metrics and health.

The rule: **nothing blocks the event loop.** It fires every deadline on the
node, so a call that can wait — a console or file write, NVML, fsync, DNS, a
subprocess wait, a disk that may be a network filesystem — runs in a worker
thread with a bound, or is non-blocking with a bounded buffer, never inline
in a callback or a task. What runs on the loop is request handling (bounded
per callback: one read of at most 64 KiB of FIFO or socket bytes), the
expiry loop and signals through pidfds. Every in-process daemon test fails
when the loop stalled for more than 50 ms (``tests/conftest.py``).

The parts get narrow ports (``core.ports``, and the Protocols here), never
the daemon; ``service`` never imports ``groups``, ``cli`` or ``daemon``.
"""
