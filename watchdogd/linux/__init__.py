"""Thin wrappers over the OS: pidfds and ``/proc``, endpoints and their locks,
sd_notify and ``LISTEN_FDS``, snapshot files, stack capture, NVML, the config
file, log output, and the loop's ``add_reader`` (``aio``, the only raw-asyncio
module).

The rule: each wrapper does one OS thing and decides nothing; it may use
``core`` (its data types), never ``service``, ``groups``, ``cli`` or ``daemon``.
A call that can block (a disk, NVML) is documented as such, and its callers
run it off the event loop.
"""
