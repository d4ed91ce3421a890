"""The log sink: callers never wait on the output; what it cannot hold is dropped and counted."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator

import pytest

from watchdogd.linux.logsink import DescriptorHandler, LogSink

from ..conftest import wait_until


class Gate(logging.Handler):
    """An output that hangs until opened, like a pipe nobody reads."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.entered.set()
        self.opened.wait()
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("test-logsink")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    yield logger
    logger.handlers.clear()


def test_a_full_queue_drops_and_counts_and_reports_the_gap_once_caught_up(
    logger: logging.Logger,
) -> None:
    gate = Gate()
    sink = LogSink(gate, capacity=1)
    logger.addHandler(sink.handler)
    sink.start()
    try:
        logger.info("first")
        assert gate.entered.wait(10)  # the thread holds "first", stuck in the output
        logger.info("queued")  # fills the queue of one
        for n in range(3):  # none of these may wait for the output
            logger.info("lost %d", n)
        gate.opened.set()
        assert sink.close()
    finally:
        gate.opened.set()
    # The gap is marked where it was: after all that was queued before it.
    assert gate.lines == [
        "INFO first",
        "INFO queued",
        "WARNING 3 log records dropped: the log output did not keep up",
    ]


def test_queueing_resumes_after_the_gap_is_reported(logger: logging.Logger) -> None:
    gate = Gate()
    sink = LogSink(gate, capacity=1, notice=lambda count: f"gap of {count}")
    logger.addHandler(sink.handler)
    sink.start()
    try:
        logger.info("first")
        assert gate.entered.wait(10)
        logger.info("queued")
        logger.info("lost")
        gate.opened.set()
        wait_until(lambda: len(gate.lines) == 3)  # "first", "queued", then the notice
        logger.info("after")
        assert sink.close()
    finally:
        gate.opened.set()
    assert gate.lines == ["INFO first", "INFO queued", "WARNING gap of 1", "INFO after"]


def test_close_gives_up_on_a_stuck_output_within_its_bound(logger: logging.Logger) -> None:
    gate = Gate()
    sink = LogSink(gate, capacity=1)
    logger.addHandler(sink.handler)
    sink.start()
    try:
        logger.info("stuck")
        assert gate.entered.wait(10)
        logger.info("queued")
        assert not sink.close(timeout=0.05)
    finally:
        gate.opened.set()
    assert sink.close()  # the output came back: all it held is written
    assert gate.lines == ["INFO stuck", "INFO queued"]


def test_descriptor_handler_writes_each_record_as_one_line(logger: logging.Logger) -> None:
    read_end, write_end = os.pipe()
    target = DescriptorHandler(write_end)
    target.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    sink = LogSink(target)
    logger.addHandler(sink.handler)
    sink.start()
    try:
        logger.info("plain %s", "args")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("failed")
        assert sink.close()
    finally:
        os.close(write_end)
    with os.fdopen(read_end) as f:
        text = f.read()
    first, second = text.split("\n", 1)
    assert first == "test-logsink INFO plain args"
    assert second.startswith("test-logsink ERROR failed\nTraceback (most recent call last):")
    assert second.endswith("ValueError: boom\n")
