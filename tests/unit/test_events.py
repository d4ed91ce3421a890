"""Events have torch's JSON shape, and recording to ``null`` does no work."""

from __future__ import annotations

import dataclasses
import json
import logging

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from watchdogd_client import events
from watchdogd_client import protocol as p
from watchdogd_client.events import Event, EventSource, NodeState, RdzvEvent


def test_event_round_trip() -> None:
    event = Event("timer_expired", EventSource.AGENT, 1700000000000, {"pid": 5, "ok": True})
    assert Event.deserialize(event.serialize()) == event
    assert json.loads(str(event)) == {
        "name": "timer_expired",
        "source": "AGENT",
        "timestamp": 1700000000000,
        "metadata": {"pid": 5, "ok": True},
    }


def test_torch_serialized_events_read_back_and_ours_read_in_torch() -> None:
    torch_events = pytest.importorskip("torch.distributed.elastic.events.api")
    theirs = torch_events.Event("x", torch_events.EventSource.WORKER, 12, {"a": 1.5, "b": None})
    ours = Event.deserialize(theirs.serialize())
    assert ours == Event("x", EventSource.WORKER, 12, {"a": 1.5, "b": None})
    assert ours.serialize() == theirs.serialize()  # the same string, byte for byte
    assert torch_events.Event.deserialize(ours.serialize()) == theirs

    rdzv = torch_events.RdzvEvent("join", "run", "msg", "host", 7, torch_events.NodeState.RUNNING)
    mine = RdzvEvent.deserialize(rdzv.serialize())
    assert mine.node_state is NodeState.RUNNING
    assert mine.serialize() == rdzv.serialize()


class Exploding(Event):
    def serialize(self) -> str:
        raise AssertionError("serialized for the null destination")


def test_null_destination_never_serializes() -> None:
    events.record(Exploding("x", EventSource.AGENT), "null")


def test_registered_destination_receives_json(tmp_path: object) -> None:
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    events.register_handler("test-collect", Collect())
    events.record(Event("hello", EventSource.AGENT, 1), "test-collect")
    assert [json.loads(line)["name"] for line in seen] == ["hello"]
    with pytest.raises(ValueError, match="unknown event destination"):
        events.record(Event("x", EventSource.AGENT), "nowhere")


def test_events_are_torchs_dataclasses_and_log_what_torch_logs() -> None:
    event = Event("timer_expired", EventSource.AGENT, 17, {"pid": 5, "scope": "step"})
    rdzv = RdzvEvent("join", "run", "msg", "host", 7, NodeState.RUNNING, rank=3)
    for value in (event, rdzv):
        expected = json.dumps(dataclasses.asdict(value))  # torch's serialize(), ", " and ": "
        assert str(value) == value.serialize() == expected
        assert ", " in expected
        assert type(value).deserialize(expected) == value  # torch's form
        assert type(value).deserialize(msgspec.json.encode(value)) == value  # msgspec's compact one
    batch = p.EventBatch(1, [event])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=p.Reply) == batch


def test_a_rendezvous_handler_provided_the_torch_way_records() -> None:
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    original = events.get_logging_handler("dynamic_rendezvous")
    assert isinstance(original, logging.NullHandler)
    events.construct_and_record_rdzv_event("run", "ignored", NodeState.INIT)
    events._log_handlers["dynamic_rendezvous"] = Collect()  # what torch users do
    try:
        events.construct_and_record_rdzv_event("run", "joined", NodeState.RUNNING, rank=1)
    finally:
        events._log_handlers["dynamic_rendezvous"] = original
    assert [json.loads(line)["message"] for line in seen] == ["joined"]
    assert json.loads(seen[0])["name"] == "test_a_rendezvous_handler_provided_the_torch_way_records"


_metadata_values = st.none() | st.booleans() | st.integers() | st.floats() | st.text()


@given(
    st.text(),
    st.sampled_from(EventSource),
    st.integers(min_value=0),
    st.dictionaries(st.text(), _metadata_values),
)
def test_serialize_is_torchs_json_dumps_of_asdict_for_any_event(
    name: str, source: EventSource, timestamp: int, metadata: dict[str, object]
) -> None:
    event = Event(name, source, timestamp, metadata)  # type: ignore[arg-type]
    assert event.serialize() == json.dumps(dataclasses.asdict(event))
