"""``deploy/prometheus/kvroute-alerts.yaml``: the alerting rules load in a real
Prometheus's ``promtool`` (Debian's prometheus package; CI installs it) and pass their
unit tests (``tests/data/prometheus/kvroute-alerts.test.yaml``: each alert fires when
it should, with its labels and text, and not before); every series and label they read
is one a router exports; the Prometheus Operator's PrometheusRule holds the same
groups."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvroute.commands._metrics_reference import metrics

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "deploy" / "prometheus" / "kvroute-alerts.yaml"
UNIT_TESTS = ROOT / "tests" / "data" / "prometheus" / "kvroute-alerts.test.yaml"
OPERATOR = ROOT / "deploy" / "kubernetes" / "prometheusrule.yaml"
PROMTOOL = shutil.which("promtool")


def rules() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_the_rules_load_and_pass_their_unit_tests() -> None:
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(UNIT_TESTS)]):
        out = subprocess.run(
            [str(PROMTOOL), *args], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert out.returncode == 0, out.stdout + out.stderr
    # Every alert has a unit test.
    tested = set(re.findall(r"alertname: (\w+)", UNIT_TESTS.read_text()))
    assert {str(r["alert"]) for r in rules()} == tested


def test_every_series_and_label_the_rules_read_is_exported() -> None:
    exported = {m.name: set(m.labels) for m in metrics()}
    for rule in rules():
        expr = str(rule["expr"])
        names = set(re.findall(r"\bkvroute_[a-z_]+\b", expr))
        assert names, rule["alert"]
        assert names <= exported.keys(), (rule["alert"], names - exported.keys())
        labels = set()
        for group in re.findall(r"by \(([^)]*)\)", expr):
            labels |= {x.strip() for x in group.split(",")}
        labels |= set(re.findall(r"(\w+)\s*=~?", expr.replace("==", "")))
        known = {"instance"}.union(*(exported[n] for n in names))
        assert labels <= known, (rule["alert"], labels - known)


def test_the_operator_rule_holds_the_same_groups() -> None:
    operator = yaml.safe_load(OPERATOR.read_text())
    assert operator["kind"] == "PrometheusRule"
    assert operator["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
