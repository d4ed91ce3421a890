"""deploy/: the Grafana dashboard and the Prometheus alerts use only what the daemon exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from watchdogd_client.groups import GroupSpec, GroupState

from ..conftest import REPO, running_daemon

DASHBOARD = REPO / "deploy" / "grafana" / "watchdogd.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
# What a Prometheus scrape adds to every target: not the daemon's to export.
SCRAPE_SERIES = {"up"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
_NAME = re.compile(r"\b(watchdogd_[a-z0-9_]+|up)\b")


def exported(text: str) -> set[str]:
    """The series names of a scrape, with what each type's samples are called."""
    return {
        family.name + suffix
        for family in text_string_to_metric_families(text)
        for suffix in _SUFFIXES[family.type]
    }


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


@pytest.mark.anyio
async def test_every_metric_the_dashboard_and_the_alerts_use_is_exported(short_dir: Path) -> None:
    async with running_daemon(short_dir, metrics_listen="127.0.0.1:0", stack_dumps="off") as d:
        assert d.http_address is not None
        url = "http://{}:{}/metrics".format(*d.http_address)
        sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
        d.supervisor.submit(GroupSpec(name="g", entrypoint=sleeper, max_restarts=2))
        text = await anyio.to_thread.run_sync(lambda: urllib.request.urlopen(url).read().decode())
    assert 'watchdogd_group_restarts_left{group="g"} 2.0' in text
    series = exported(text) | SCRAPE_SERIES
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text())) + [r["expr"] for r in alert_rules()]
    used = {name for expr in exprs for name in _NAME.findall(expr)}
    assert used - series == set()
    # What the issue asks the dashboard to show, and the states it names, are there.
    for name in (
        "watchdogd_active_timers",
        "watchdogd_expiries_total",
        "watchdogd_kills_total",
        "watchdogd_refusals_total",
        "watchdogd_event_loop_lag_seconds",
        "watchdogd_groups",
        "watchdogd_worker_restarts_total",
        "watchdogd_rendezvous_round",
        "watchdogd_rendezvous_waiting_nodes",
    ):
        assert name in used
    states = {s for expr in exprs for s in re.findall(r'state="([A-Z]+)"', expr)}
    assert states <= {state.value for state in GroupState}


def test_the_dashboard_is_one_grafana_can_import() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "watchdogd" and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"type", "title", "gridPos"} <= panel.keys()
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            assert target["expr"].strip()
            # The data source is the dashboard's variable, chosen at import.
            assert target["datasource"]["uid"] == "${datasource}"


_RULE_KEYS = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def test_the_alerting_rules_parse() -> None:
    promtool = shutil.which("promtool")
    if promtool is not None:
        checked = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    # Prometheus's rule-file schema, as `promtool check rules` reads it (without PromQL).
    document = yaml.safe_load(ALERTS.read_text())
    assert set(document) == {"groups"}
    names = [group["name"] for group in document["groups"]]
    assert len(names) == len(set(names))
    alerts = []
    for group in document["groups"]:
        assert set(group) <= {"name", "interval", "limit", "rules"}
        for rule in group["rules"]:
            assert set(rule) <= _RULE_KEYS, rule
            assert isinstance(rule["alert"], str) and re.fullmatch(
                r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"]
            )
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert rule["expr"].count("(") == rule["expr"].count(")")
            if "for" in rule:
                assert _DURATION.match(rule["for"]), rule["for"]
            assert all(isinstance(v, str) for v in rule.get("labels", {}).values())
            assert {"summary", "description"} <= rule["annotations"].keys()
            alerts.append(rule["alert"])
    assert len(alerts) == len(set(alerts))
    for wanted in (
        "WatchdogdDown",
        "WatchdogdEventLoopLag",
        "WatchdogdExpiriesRising",
        "WatchdogdGroupUnhealthy",
        "WatchdogdGroupFailed",
        "WatchdogdRestartsExhausted",
    ):
        assert wanted in alerts
