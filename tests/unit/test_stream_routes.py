"""Where worker streams go: torchrun's flags in watchdogd's layout, and a LogsSpecs' choice."""

from __future__ import annotations

import os
from pathlib import Path

from watchdogd.core.workerenv import LogsDest, StreamRoute, routes_from_logs_dest, stream_routes
from watchdogd_client.groups import GroupSpec


def spec(**fields: object) -> GroupSpec:
    return GroupSpec(name="g", entrypoint=["true"], nproc=2, log_dir="/logs", **fields)  # type: ignore[arg-type]


def test_redirects_tee_and_filters_in_watchdogd_layout() -> None:
    routes = stream_routes(
        spec(redirects="1", tee="0:2", duplicate_stderr_filters=["NCCL"]), Path("/a")
    )
    assert routes[0] == (
        StreamRoute("stdout", "/a/0/stdout.log", "none", (), "/a/0/filtered_stdout.log"),
        StreamRoute("stderr", "/a/0/stderr.log", "prefixed", ("NCCL",), "/a/0/filtered_stderr.log"),
    )
    assert routes[1][1] == StreamRoute(
        "stderr", None, "plain", ("NCCL",), "/a/1/filtered_stderr.log"
    )
    assert routes[1][1].piped and not routes[0][0].piped


def test_local_ranks_filter_keeps_other_ranks_off_the_console_not_out_of_files() -> None:
    routes = stream_routes(spec(tee="3", local_ranks_filter=[1]), Path("/a"))
    assert [r.console for r in routes[0]] == ["none", "none"]
    assert [r.file for r in routes[0]] == ["/a/0/stdout.log", "/a/0/stderr.log"]
    assert [r.console for r in routes[1]] == ["prefixed", "prefixed"]


def test_a_logs_dest_as_torchs_agent_reads_it() -> None:
    dest = LogsDest(
        stdouts={0: "/x/out0", 1: ""},
        stderrs={0: os.devnull, 1: "/x/err1"},
        tee_stdouts={0: "/x/out0"},
        tee_stderrs={1: os.devnull},
        error_files={0: "/x/e0", 1: "/x/e1"},
        filtered_stdout="/x/filtered",
    )
    routes = routes_from_logs_dest(spec(duplicate_stdout_filters=["WARN"]), dest)
    out0, err0 = routes[0]
    assert out0 == StreamRoute("stdout", "/x/out0", "prefixed", ("WARN",), "/x/filtered")
    assert err0 == StreamRoute("stderr", None, "none", (), None)  # devnull: nowhere
    out1, err1 = routes[1]
    assert (out1.file, out1.console) == (None, "plain")  # "": the console as it is
    assert (err1.file, err1.console) == ("/x/err1", "none")  # a tee to devnull shows nothing
    assert out1.piped and not err1.piped


def test_a_rank_the_logs_dest_leaves_out_stays_on_the_console() -> None:
    empty = LogsDest(stdouts={}, stderrs={}, tee_stdouts={}, tee_stderrs={}, error_files={})
    routes = routes_from_logs_dest(spec(), empty)
    assert {r.console for pair in routes.values() for r in pair} == {"plain"}
    assert {r.file for pair in routes.values() for r in pair} == {None}
