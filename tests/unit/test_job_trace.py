"""The job timeline's Chrome trace, from events and timer spans, without a daemon."""

from __future__ import annotations

import msgspec

from watchdogd.core.job_trace import build_trace
from watchdogd_client.events import Event, EventSource
from watchdogd_client.protocol import TimerSpan

T0 = 1_700_000_000.0


def event(at: float, name: str, **metadata: str | int | None) -> Event:
    return Event(name, EventSource.AGENT, int((T0 + at) * 1000), metadata)


def span(pid: int, scope: str, armed: float, ended: float | None, outcome: str) -> TimerSpan:
    end = None if ended is None else T0 + ended
    return TimerSpan(pid=pid, scope_id=scope, armed=T0 + armed, ended=end, outcome=outcome, uid=0)  # type: ignore[arg-type]


def entries(trace: object) -> list[dict[str, object]]:
    decoded = msgspec.json.decode(msgspec.json.encode(trace))
    assert isinstance(decoded, dict)
    events = decoded["traceEvents"]
    assert isinstance(events, list)
    return events


def test_open_ends_close_at_the_end_and_others_get_tracks_of_their_own() -> None:
    events = [
        event(0, "group_state", group="g", old="INIT", state="HEALTHY", attempt=0),
        event(0.1, "rendezvous_round", group="g", waited_s=0.1, hostname="n1"),
        event(0.2, "worker_started", group="g", worker_id=41, global_rank=8, attempt=0),
        event(5.0, "rdzv_node_lost", group="g", message="lost n2"),
        event(6.0, "request_refused", pid=1, code="refused"),  # not on the timeline
    ]
    spans = [
        span(41, "step", 1.0, None, "armed"),  # still armed: ends with the trace
        span(77, "checkpoint", 2.0, 3.0, "released"),  # a process no group launched
    ]
    trace = entries(build_trace(events, spans, hostname="n1", end=T0 + 10))
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["name"] == "thread_name"}  # type: ignore[index]
    assert sorted(names.values()) == ["group g", "pid 77", "rank 8", "watchdogd"]
    assert [e["args"]["name"] for e in trace if e["name"] == "process_name"] == ["n1"]  # type: ignore[index]
    slices = {(names[e["pid"], e["tid"]], e["name"]): e for e in trace if e["ph"] == "X"}  # type: ignore[index]
    end_us = (T0 + 10) * 1e6
    step, attempt = slices["rank 8", "step"], slices["rank 8", "attempt 0"]
    assert step["ts"] + step["dur"] == attempt["ts"] + attempt["dur"] == end_us  # type: ignore[operator]
    assert slices["group g", "attempt 0"]["dur"] == end_us - T0 * 1e6
    assert slices["group g", "rendezvous"]["dur"] == 100_000
    assert slices["pid 77", "checkpoint"]["dur"] == 1_000_000
    instants = [(names[e["pid"], e["tid"]], e["name"]) for e in trace if e["ph"] == "i"]  # type: ignore[index]
    assert instants == [("group g", "node lost")]
    # Metadata first, then in time order: what the viewers read fastest.
    phases = [e["ph"] for e in trace]
    assert phases == sorted(phases, key=lambda ph: ph != "M")
