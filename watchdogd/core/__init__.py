"""Pure logic: the timer table, admission and policy, the group state machine,
D-state detection, rendezvous rounds, worker environments, config Structs, the
options of a run in the foreground (``run_options``), and
the ports (``typing.Protocol`` s) the other layers meet through.

The rule: no I/O. Time, identities and facts come in as arguments; decisions
and actions go out as values. Nothing here imports anyio, asyncio, uvloop,
socket, subprocess, aetcd, grpc or prometheus_client, nor anything from
``linux``, ``service``, ``groups``, ``cli`` or ``daemon`` (import contracts in
``pyproject.toml``). Test it with direct calls and no sleeps.
"""
