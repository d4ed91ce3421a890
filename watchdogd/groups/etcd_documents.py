"""The keys of one etcd rendezvous, their codecs, and the job-wide documents' updates.

Every key of a run lives under ``/watchdogd/rdzv/<run id>/`` (:func:`run_prefix`):

- ``nodes/<node>``: one key per live node, on a lease kept alive from the
  event loop, holding what the node asks for
  (:class:`~watchdogd.core.rdzv_state.NodeRecord`); when a node dies or is
  cut off, etcd deletes it after the TTL;
- ``leader``: the node that decides the rounds, on its lease (the first to
  create the key; when its lease ends, the members of the last round try
  in rank order, 10 ms apart, and the first one takes it);
- ``state``: the round document (:class:`~watchdogd.core.rdzv_state.RoundState`),
  written by the leader by compare-and-swap; the rules are in
  :mod:`watchdogd.core.rdzv_state`;
- ``restarts``: the job's restart count, one per failed round;
- ``stragglers/<node>``: the node's straggler summary
  (:class:`~watchdogd.core.job_stragglers.NodeSummary`), rewritten once per
  ``straggler_publish_interval`` on the node's lease, so a dead node's
  disappears with it.

Any node may close the run or count a failed round: both are
compare-and-swap loops on one document (:func:`close_run`,
:func:`count_failure`), which end when the document already says so.
"""

from __future__ import annotations

import msgspec

from watchdogd.core.rdzv_state import (
    NodeRecord,
    Record,
    RestartCount,
    RoundState,
    count_restart,
)
from watchdogd.groups.etcd_store import EtcdStore, KeyValue, Mirror

__all__ = [
    "LEADER",
    "NODES",
    "RESTARTS",
    "STATE",
    "STRAGGLERS",
    "close_run",
    "count_failure",
    "encode",
    "read_records",
    "record_of",
    "restarts_of",
    "run_closed",
    "run_prefix",
    "state_of",
    "summaries_of",
    "update_records",
]

NODES = "nodes/"
STATE = "state"
LEADER = "leader"
RESTARTS = "restarts"
STRAGGLERS = "stragglers/"

encode = msgspec.json.Encoder().encode
_state_decoder = msgspec.json.Decoder(RoundState)
_record_decoder = msgspec.json.Decoder(NodeRecord)
_restarts_decoder = msgspec.json.Decoder(RestartCount)


def run_prefix(run_id: str) -> str:
    return f"/watchdogd/rdzv/{run_id}/"


def state_of(found: KeyValue | None) -> RoundState:
    return _state_decoder.decode(found.value) if found else RoundState()


def restarts_of(found: KeyValue | None) -> RestartCount:
    return _restarts_decoder.decode(found.value) if found else RestartCount()


def record_of(found: KeyValue) -> Record:
    return Record(_record_decoder.decode(found.value), found.mod_revision)


def update_records(records: dict[str, Record], mirror: Mirror) -> None:
    """Apply the node keys the mirror saw change since the last call, and forget them.

    Each record is decoded once per change, not once per decision.
    """
    for name in mirror.changed:
        node = name.removeprefix(NODES)
        if node == name:
            continue
        kv = mirror.values.get(name)
        if kv is None:
            records.pop(node, None)
        else:
            records[node] = record_of(kv)
    mirror.changed.clear()


def summaries_of(mirror: Mirror, node_id: str) -> dict[str, bytes]:
    """The straggler summaries a mirror of ``stragglers/`` holds, by node id, but this node's."""
    mine = STRAGGLERS + node_id
    return {
        name.removeprefix(STRAGGLERS): kv.value
        for name, kv in mirror.values.items()
        if name != mine
    }


async def read_records(store: EtcdStore, *, deadline: float) -> dict[str, Record]:
    """Every node's record, read once (for messages: decisions use the leader's watch)."""
    listing = await store.read_all(NODES, deadline=deadline)
    return {name.removeprefix(NODES): record_of(kv) for name, kv in listing.values.items()}


async def close_run(store: EtcdStore, *, deadline: float) -> bool:
    """Mark the round document closed; False when it already was."""
    while True:
        found = await store.get(STATE, deadline=deadline)
        state = state_of(found)
        if state.closed:
            return False
        closed = encode(msgspec.structs.replace(state, closed=True))
        revision = found.mod_revision if found else 0
        if await store.cas(STATE, revision, closed, deadline=deadline):
            return True


async def run_closed(store: EtcdStore, *, deadline: float) -> bool:
    return state_of(await store.get(STATE, deadline=deadline)).closed


async def count_failure(store: EtcdStore, round: int, *, deadline: float) -> int:
    """Count the failure of ``round`` once for the whole job; the job's count after it."""
    while True:
        found = await store.get(RESTARTS, deadline=deadline)
        counter = restarts_of(found)
        counted = count_restart(counter, round)
        if counted == counter:
            return counted.count
        revision = found.mod_revision if found else 0
        if await store.cas(RESTARTS, revision, encode(counted), deadline=deadline):
            return counted.count
