"""deploy/k8s: Kubernetes schemas (kubernetes-validate, strict) and a consistency check.

kubeconform cannot be installed here (no Go toolchain download, and it fetches schemas at
run time); ``kubernetes-validate`` from PyPI ships the schemas and validates offline. On top
of the schema, the checks below catch what a schema cannot: resources listed in the
kustomization exist, selectors match pod labels, Services reach named container ports,
StatefulSets name a headless Service, ConfigMaps exist and hold settings that load,
Prometheus annotations point at the metrics port, and pods run as the image's user.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from peerlm.agent import AgentSettings
from peerlm.services.cpm import CpmSettings

from peerlm.config import load_settings
from tests.deploy_tools import ROOT, tool

K8S = ROOT / "deploy" / "k8s"
WORKLOADS = ("Deployment", "StatefulSet")


def _kustomization() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return data


def _resources() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in _kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in _resources() if d["kind"] == kind]


def test_kustomization_lists_existing_files_and_every_manifest() -> None:
    listed = _kustomization()["resources"]
    for name in listed:
        assert (K8S / name).is_file(), name
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == present, "a manifest in deploy/k8s is not in the kustomization"
    for doc in _resources():
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert doc["metadata"].get("name"), doc


def test_selectors_services_and_ports_are_consistent() -> None:
    workloads = [d for d in _resources() if d["kind"] in WORKLOADS]
    assert {(w["kind"], w["metadata"]["name"]) for w in workloads} == {
        ("Deployment", "cpm"),
        ("StatefulSet", "overlay"),
        ("StatefulSet", "agent"),
    }
    services = {s["metadata"]["name"]: s for s in _by_kind("Service")}
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        selector = w["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), w["metadata"]["name"]
    for name, svc in services.items():
        selector = svc["spec"]["selector"].items()
        targets = [
            w for w in workloads if selector <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, name
        ports = {
            p["name"]: p["containerPort"]
            for c in targets[0]["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports, (name, port)
            assert ports[port["targetPort"]] == port["port"], (name, port)
    for sts in _by_kind("StatefulSet"):
        svc = services[sts["spec"]["serviceName"]]
        assert svc["spec"].get("clusterIP") == "None", "StatefulSets need a headless Service"


def test_volumes_config_maps_probes_and_security() -> None:
    config_maps = {c["metadata"]["name"] for c in _by_kind("ConfigMap")}
    claims = {c["metadata"]["name"] for c in _by_kind("PersistentVolumeClaim")}
    for w in (d for d in _resources() if d["kind"] in WORKLOADS):
        pod = w["spec"]["template"]
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001
        volumes = {v["name"]: v for v in spec["volumes"]}
        templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, mount
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in config_maps
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
            if "secret" in v:
                assert v["secret"]["secretName"].startswith("peerlm-")
        main = spec["containers"][0]
        assert main["readinessProbe"]["exec"]["command"][:2] == ["peerlm", "health"]
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        metrics = {p["containerPort"] for p in main["ports"] if p["name"] == "metrics"}
        assert {int(annotations["prometheus.io/port"])} == metrics


def test_per_pod_certificates_stay_out_of_the_main_container() -> None:
    for sts in _by_kind("StatefulSet"):
        spec = sts["spec"]["template"]["spec"]
        secret_volumes = {v["name"] for v in spec["volumes"] if "secret" in v}
        for container in spec["containers"]:
            mounted = {m["name"] for m in container["volumeMounts"]}
            assert not mounted & secret_volumes, sts["metadata"]["name"]
        copier = spec["initContainers"][0]
        assert "$(POD_NAME).key" in copier["args"][0]
        # Agents and overlay nodes are overlay nodes: their certified VRF key goes along.
        assert "$(POD_NAME).vrf.key" in copier["args"][0]


def test_overlay_members_advertise_dialable_names_and_share_one_bootstrap() -> None:
    prefixes = {"overlay": "PEERLM_OVERLAY_", "agent": "PEERLM_AGENT_"}
    bootstraps = set()
    for sts in _by_kind("StatefulSet"):
        name = sts["metadata"]["name"]
        env = {
            e["name"]: e.get("value")
            for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        prefix = prefixes[name]
        service = sts["spec"]["serviceName"]
        advertise = env[f"{prefix}ADVERTISE"]
        assert advertise.startswith(f"$(POD_NAME).{service}.$(POD_NAMESPACE).svc"), advertise
        bootstrap = env[f"{prefix}OVERLAY__BOOTSTRAP" if name == "agent" else f"{prefix}BOOTSTRAP"]
        bootstraps.add(bootstrap)
    assert len(bootstraps) == 1, bootstraps


def test_config_map_matches_the_compose_settings_files() -> None:
    """The ConfigMap and deploy/*.yaml (docker compose) carry the same settings, so the
    overlay schedule agrees between the two deployments and within each."""
    data = _by_kind("ConfigMap")[0]["data"]
    for key in ("cpm.yaml", "agent.yaml", "overlay.yaml"):
        compose = yaml.safe_load((ROOT / "deploy" / key).read_text())
        k8s = yaml.safe_load(data[key])
        assert k8s == compose, key
    agent = yaml.safe_load(data["agent.yaml"])
    overlay = yaml.safe_load(data["overlay.yaml"])
    assert agent["overlay"]["protocol"] == overlay["protocol"]


def test_config_map_settings_load(tmp_path: Path) -> None:
    data = _by_kind("ConfigMap")[0]["data"]
    for key, cls in (("cpm.yaml", CpmSettings), ("agent.yaml", AgentSettings)):
        path = tmp_path / key
        path.write_text(data[key])
        settings = load_settings(cls, path)
        assert settings.listen.startswith("0.0.0.0:")
        assert settings.metrics_host == "0.0.0.0"


def _validate(*files: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--quiet", "-k", "1.30.0", *files],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("name", sorted(_kustomization()["resources"]))
def test_manifests_match_the_kubernetes_schema(name: str) -> None:
    out = _validate(str(K8S / name))
    assert out.returncode == 0, out.stdout + out.stderr


def test_rendered_kustomization_matches_the_schema(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed")
    rendered = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True)
    assert rendered.returncode == 0, rendered.stderr
    out_file = tmp_path / "rendered.yaml"
    out_file.write_text(rendered.stdout)
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    assert all(d["metadata"].get("namespace") == "peerlm" for d in docs if d["kind"] != "Namespace")
    out = _validate(str(out_file))
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_schema_check_can_fail(tmp_path: Path) -> None:
    doc = next(d for d in _resources() if d["kind"] == "Deployment")
    doc["spec"]["replica"] = 1  # misspelt field: strict validation must refuse it
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    assert _validate(str(bad)).returncode != 0
