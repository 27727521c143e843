"""``deploy/``: the Kubernetes manifests validate against the schema of a stated
Kubernetes version (kubernetes-validate, strict: unknown fields are errors), hang
together (labels, ports, probes, permissions), and carry a config file kvroute accepts;
the Dockerfile is multi-stage and runs as non-root (it is not built here: no base image
can be pulled on this machine)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvroute.cli import main

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.31.0"  # also stated in docs/deployment.md


def resources() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def by_kind(kind: str) -> dict[str, Any]:
    found = [r for r in resources() if r["kind"] == kind]
    assert len(found) == 1, kind
    return found[0]


def test_manifests_validate_against_the_kubernetes_schema() -> None:
    kinds = []
    for res in resources():
        kinds.append(res["kind"])
        if res["apiVersion"].startswith("monitoring.coreos.com/"):
            # A Prometheus Operator CRD: not in Kubernetes' own schema (checked below).
            with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
                kubernetes_validate.validate(res, KUBERNETES_VERSION, strict=True)
            continue
        kubernetes_validate.validate(res, KUBERNETES_VERSION, strict=True)
    assert sorted(kinds) == sorted(
        [
            "ConfigMap",
            "Deployment",
            "PrometheusRule",
            "Role",
            "RoleBinding",
            "Service",
            "ServiceAccount",
            "ServiceMonitor",
        ]
    )


def test_the_validator_rejects_a_wrong_field() -> None:
    bad = by_kind("Deployment")
    bad["spec"]["replica"] = 2  # a typo strict validation must catch
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_manifests_hang_together() -> None:
    from kvroute.config import Settings
    from kvroute.service.app import create_app

    dep, svc, mon = by_kind("Deployment"), by_kind("Service"), by_kind("ServiceMonitor")
    pod = dep["spec"]["template"]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    container = pod["spec"]["containers"][0]
    port_names = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    assert {e["port"] for e in mon["spec"]["endpoints"]} <= {
        p["name"] for p in svc["spec"]["ports"]
    }
    # The probes hit routes the router serves.
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    paths = {getattr(r, "path", None) for r in create_app(Settings()).routes}
    assert {"/readiness", "/health", "/metrics"} <= paths
    # Discovery may list and watch EndpointSlices, as the pod's service account.
    role, binding = by_kind("Role"), by_kind("RoleBinding")
    rule = role["rules"][0]
    assert rule["apiGroups"] == ["discovery.k8s.io"] and rule["resources"] == ["endpointslices"]
    assert {"list", "watch"} <= set(rule["verbs"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == pod["spec"]["serviceAccountName"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_configmap_holds_a_config_kvroute_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cm, dep = by_kind("ConfigMap"), by_kind("Deployment")
    (name, text), *_ = cm["data"].items()
    pod = dep["spec"]["template"]["spec"]
    mount = pod["containers"][0]["volumeMounts"][0]
    assert pod["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--config") + 1] == f"{mount['mountPath']}/{name}"
    cfg = tmp_path / name
    cfg.write_text(text)
    assert main(["serve", "--config", str(cfg), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert 'service-discovery = "k8s"' in out
    port = pod["containers"][0]["ports"][0]["containerPort"]
    assert f"port = {port}  # file" in out


def test_dockerfile_is_multi_stage_and_runs_as_non_root() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)", text, re.M)
    assert len(stages) >= 2
    assert "maturin build" in text
    last = text[text.rindex("\nFROM ") :]
    user = re.findall(r"^USER\s+(\S+)", last, re.M)
    assert user and not user[-1].startswith(("root", "0"))
    for src in re.findall(r"^COPY\s+(?!--from)(.+?)\s+\S+$", text, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
