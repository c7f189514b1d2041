"""Prometheus config, alert rules and the Grafana dashboard agree with the metrics that exist."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from peerlm.app.compose import scrape_targets
from tests.deploy_tools import ROOT, documented_metrics, is_documented, promql_metric_names, tool

PROM = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "peerlm.json"

#: Series Prometheus itself makes.
BUILTIN = frozenset({"up"})


def _known(name: str) -> bool:
    documented = documented_metrics()
    if name in BUILTIN or is_documented(name, documented):
        return True
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return is_documented(base, documented)


def _alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def _panels() -> list[dict[str, Any]]:
    dash = json.loads(DASHBOARD.read_text())
    panels: list[dict[str, Any]] = []
    for panel in dash["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def test_promql_names_are_extracted() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (le, method) "
        '(rate(peerlm_grpc_server_handling_seconds_bucket{component="cpm"}[5m]))) > 1 '
        'and on(instance) up{job="x"} == 1 unless offset_metric'
    )
    assert promql_metric_names(expr) == {
        "peerlm_grpc_server_handling_seconds_bucket",
        "up",
        "offset_metric",
    }


def test_alert_rules_are_complete_and_use_catalogued_metrics() -> None:
    rules = _alerts()
    names = {r["alert"] for r in rules}
    assert {"PeerlmCpmDown", "PeerlmAgentDown", "PeerlmRoundStalled"} <= names
    operations = (ROOT / "docs" / "operations.md").read_text()
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert f"`{rule['alert']}`" in operations, f"{rule['alert']} not explained in operations.md"
        for metric in promql_metric_names(rule["expr"]):
            assert metric in BUILTIN or is_documented(metric, documented_metrics()), (
                rule["alert"],
                metric,
            )


def test_alert_jobs_match_the_scrape_config() -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    for rule in _alerts():
        for job in re.findall(r'job="([^"]+)"', rule["expr"]):
            assert job in jobs, (rule["alert"], job)
    files = {
        Path(f).name
        for job in config["scrape_configs"]
        for sd in job.get("file_sd_configs", [])
        for f in sd["files"]
    }
    assert files == set(scrape_targets(4, 1)), "scrape-target files and prometheus.yml differ"
    assert config["rule_files"] == ["alerts.yml"]


def test_dashboard_uses_the_provisioned_datasource_and_existing_metrics() -> None:
    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/peerlm.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    panels = [p for p in _panels() if p["type"] != "row"]
    assert len({p["id"] for p in _panels()}) == len(_panels()), "panel ids must be unique"
    unknown: list[tuple[str, str]] = []
    for panel in panels:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid, panel["title"]
            names = promql_metric_names(target["expr"])
            assert names, (panel["title"], target["expr"])
            unknown += [(panel["title"], n) for n in names if not _known(n)]
    assert not unknown, f"metrics in panels that docs/metrics.md does not list: {unknown}"


def test_dashboard_covers_what_operators_watch() -> None:
    text = " ".join(p["title"].lower() for p in _panels())
    for topic in ("rounds", "pairings", "rewards", "bytes", "loss", "pass@1", "overlay depth",
                  "query latency", "lease take-overs", "refused"):  # fmt: skip
        assert topic in text, topic
    exprs = " ".join(t["expr"] for p in _panels() for t in p.get("targets", []))
    for metric in ("peerlm_agent_pass_at_1_ratio", "peerlm_agent_validation_loss_nats",
                   "peerlm_cpm_directives_issued_total", "peerlm_auth_refusals_total"):  # fmt: skip
        assert metric in exprs, metric


def test_dashboard_shows_the_overlay() -> None:
    exprs = " ".join(t["expr"] for p in _panels() for t in p.get("targets", []))
    for metric in ("peerlm_overlay_depth_count", "peerlm_overlay_query_latency_seconds_bucket",
                   "peerlm_overlay_lease_takeovers_total"):  # fmt: skip
        assert metric in exprs, metric


def test_the_metric_check_can_fail() -> None:
    assert not _known("peerlm_agent_made_up_total")
    assert promql_metric_names("rate(peerlm_agent_made_up_total[5m])") == {
        "peerlm_agent_made_up_total"
    }


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, cwd=PROM)


def test_promtool_checks_config_and_rules() -> None:
    out = _promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    out = _promtool("check", "rules", "alerts.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_rules_fire_when_they_should() -> None:
    out = _promtool("test", "rules", "alerts.test.yml")
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n- name: x\n  rules:\n  - alert: X\n    expr: up{job=\n")
    out = subprocess.run([tool("promtool"), "check", "rules", str(bad)], capture_output=True)
    assert out.returncode != 0


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in GRAFANA.rglob("*.yml")))
def test_grafana_provisioning_files_parse(path: str) -> None:
    assert yaml.safe_load((ROOT / path).read_text())["apiVersion"] == 1
