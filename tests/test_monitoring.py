"""The monitoring in deploy/ against the real thing: Prometheus scrapes a live fl-server and
two fl-edges on loopback, and every Grafana panel's PromQL must run and return series;
the alert rules pass promtool's checks and unit tests.

Prometheus comes from the Debian package ``prometheus`` (which ships ``promtool``). When it
is absent the tests install it with apt-get (CI machines start bare); where that is not
possible (not root, no apt-get, no network, or FEDATTN_NO_APT=1) they skip with the reason.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import REPO, Proc, free_port, wait_for, write_edge_dirs

DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "fedattn.json"
# The Grafana variable values the panels are evaluated with: the test scrapes every second
# and rounds take well under that window.
TEST_VARIABLES = {"window": "20s"}


def _apt_install(package: str) -> str:
    """Installs a Debian package; returns "" on success or why it could not."""
    if os.environ.get("FEDATTN_NO_APT"):
        return "FEDATTN_NO_APT is set"
    if not shutil.which("apt-get"):
        return "no apt-get on this machine"
    if os.geteuid() != 0:
        return "not root, cannot apt-get install"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends",
               "-o", "DPkg::Lock::Timeout=120", package]
    output = ""
    for command in (install, ["apt-get", "update", "-q"], install):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        except subprocess.TimeoutExpired:
            return f"{' '.join(command[:2])} timed out"
        output = (done.stdout + done.stderr)[-500:]
        if command is install and done.returncode == 0:
            return ""
    return f"apt-get install {package} failed: {output}"


@pytest.fixture(scope="module")
def prometheus_tools() -> dict[str, str]:
    tools = {name: shutil.which(name) for name in ("prometheus", "promtool")}
    if not all(tools.values()):
        why = _apt_install("prometheus")
        tools = {name: shutil.which(name) for name in ("prometheus", "promtool")}
        if not all(tools.values()):
            pytest.skip(f"Prometheus is not installed and could not be: {why or 'not on PATH'}")
    return tools


def promtool(tools: dict, *args: str, cwd: Path = DEPLOY) -> str:
    done = subprocess.run([tools["promtool"], *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def test_alert_rules_and_config_pass_promtool(prometheus_tools):
    assert "SUCCESS: 6 rules found" in promtool(prometheus_tools, "check", "rules",
                                                "prometheus/alerts.yml")
    promtool(prometheus_tools, "check", "config", "prometheus.yml")
    # Each alert fires on the series it is about and stays quiet before its threshold.
    assert "SUCCESS" in promtool(prometheus_tools, "test", "rules", "alerts_test.yml",
                                 cwd=DEPLOY / "prometheus")


# Rows whose panels only have series when the server runs with these flags.
ROWS_WITH_FLAGS = {"Privacy"}
# Rows whose series exist only on GPU boxes and Jetsons: on the CPU edges of these tests only
# the telemetry source panel has one, saying "absent" (tested by name below).
ROWS_ON_HARDWARE = {"Device (GPU / Jetson)"}


def dashboard_queries(rows: set[str] | None = None) -> list[tuple[str, list[str]]]:
    """(panel title, [PromQL]) for every panel (or those under the named rows), Grafana
    variables replaced."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == set(TEST_VARIABLES), "a dashboard variable the test does not fill in"
    all_rows = {p["title"] for p in dashboard["panels"] if p["type"] == "row"}
    assert ROWS_WITH_FLAGS | ROWS_ON_HARDWARE <= all_rows
    rows = all_rows - ROWS_WITH_FLAGS - ROWS_ON_HARDWARE if rows is None else rows
    panels, row = [], None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            continue
        if row not in rows:
            continue
        exprs = []
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in TEST_VARIABLES.items():
                expr = expr.replace(f"${name}", value)
            assert "$" not in expr, f"{panel['title']}: unreplaced variable in {expr}"
            exprs.append(expr)
        panels.append((panel["title"], exprs))
    return panels


def test_dashboard_is_provisionable():
    dashboard = json.loads(DASHBOARD.read_text())
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources"
                                 / "prometheus.yml").read_text())["datasources"][0]
    ids = set()
    for panel in dashboard["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == datasource["uid"]
            assert panel["targets"] and all(t["datasource"]["uid"] == datasource["uid"]
                                            for t in panel["targets"])
    titles = [p["title"] for p in dashboard["panels"]]
    # Traffic overhead comes first.
    assert titles[:3] == ["Traffic overhead", "Wire bytes per round by kind", "Wire overhead ratio"]


class PrometheusAPI:
    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}/api/v1"
        self.at: float | None = None  # evaluation time of queries (default: now)

    def get(self, path: str, **params) -> dict:
        url = f"{self.base}/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as err:  # a bad query answers 400 with the error
            body = json.loads(err.read())
        return body

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        at = at or self.at
        body = self.get("query", query=expr, **({"time": f"{at:.3f}"} if at else {}))
        assert body["status"] == "success", f"{expr}: {body.get('error')}"
        return body["data"]["result"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base.replace("/api/v1", "/-/ready"), timeout=5) as r:
                return r.status == 200
        except OSError:  # refused while starting, 503 until the TSDB is open
            return False


def live_federation(cluster, tmp_path, tools: dict, edges: int, *server_args: str
                    ) -> PrometheusAPI:
    """A running fl-server and ``edges`` fl-edges scraped every second by a real Prometheus
    with deploy/'s config and rules; returns its API set to a moment when all was scraped."""
    dirs = write_edge_dirs(tmp_path, edges, per_edge=60)
    server_metrics, edge_metrics = free_port(), [free_port() for _ in range(edges)]
    # Many rounds: the federation must still be running while the queries are made (a
    # target that stops answering turns its series stale).
    cluster.server("--method", "fedavg", "--rounds", "1000", "--min-edges", str(edges),
                   "--local-epochs", "1", "--metrics-port", str(server_metrics), *server_args)
    for i, d in enumerate(dirs):
        cluster.edge(d, f"e{i}", "--metrics-port", str(edge_metrics[i]))

    # deploy/prometheus.yml as shipped, pointed at loopback and scraping every second.
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / rule) for rule in config["rule_files"]]
    targets = {"fl-server": [f"127.0.0.1:{server_metrics}"],
               "fl-edge": [f"127.0.0.1:{p}" for p in edge_metrics]}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    prometheus = Proc([tools["prometheus"],
                       f"--config.file={tmp_path / 'prometheus.yml'}",
                       f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                       f"--web.listen-address=127.0.0.1:{port}"], tmp_path / "prometheus.log")
    cluster.procs.append(prometheus)
    api = PrometheusAPI(port)
    wait_for(lambda: api.ready() or prometheus.popen.poll() is not None, 60, "Prometheus")
    assert prometheus.popen.poll() is None, prometheus.log()

    # Every query is evaluated at one past moment whose last scrape of each target
    # succeeded: a scrape that times out on a loaded machine marks that target's series
    # stale, and an instant query at such a moment would find none.
    def healthy_and_going() -> float | None:
        at = time.time() - 2.5  # scrapes before it have finished (timeout = interval)
        up = api.query("up", at)
        rounds = api.query("fedattn_round", at)
        ok = (len(up) == 1 + edges and all(s["value"][1] == "1" for s in up) and rounds
              and float(rounds[0]["value"][1]) >= 3
              # two rate windows' worth of scrapes after the first round
              and api.query("count_over_time(fedattn_round[25s]) >= 15", at))
        return at if ok else None
    api.at = wait_for(healthy_and_going, 150, f"{1 + edges} targets up and 3 rounds scraped",
                      interval=1)
    return api


def panels_without_series(api: PrometheusAPI, rows: set[str] | None = None) -> list[str]:
    return [title for title, exprs in dashboard_queries(rows)
            if not any(api.query(expr) for expr in exprs)]


@pytest.mark.slow
def test_every_dashboard_panel_returns_series_from_a_live_federation(cluster, tmp_path,
                                                                      prometheus_tools):
    api = live_federation(cluster, tmp_path, prometheus_tools, 2)
    assert not panels_without_series(api)
    # Without --dp nothing claims an epsilon (a 0 would read as perfect privacy).
    assert not api.query('{__name__=~"fedattn_(edge_)?dp_.*"}')
    # CPU edges have no GPU: the device row says so and shows no zeros.
    assert panels_without_series(api, ROWS_ON_HARDWARE) == [
        title for title, _ in dashboard_queries(ROWS_ON_HARDWARE) if title != "Telemetry source per edge"]
    assert len(api.query('fedattn_edge_device_telemetry{job="fl-edge",source="absent"}')) == 2
    assert not api.query('{__name__=~"fedattn_edge_(gpu_utilization|device_power|device_memory|'
                         'device_temperature|task_energy|gpu_throttled).*"}')

    # The figures mean what they say.
    def value(expr: str) -> float:
        result = api.query(expr)
        assert len(result) == 1, f"{expr}: {result}"
        return float(result[0]["value"][1])

    payload_ratio = api.query('sum by (direction) (rate(fedattn_wire_bytes_total{job="fl-server",'
                              'kind!="meta"}[20s])) / sum by (direction) '
                              '(rate(fedattn_raw_tensor_bytes_total{job="fl-server"}[20s]))')
    assert {s["metric"]["direction"] for s in payload_ratio} == {"up", "down"}
    assert all(1.0 <= float(s["value"][1]) < 1.05 for s in payload_ratio)
    # Both edges upload the whole model every round: the uplink tensor bytes over the rounds
    # completed are two models per round, plus at most two rounds in progress: a round
    # counts as completed once its checkpoint is on disk, and that write overlaps the next
    # round, whose uploads are received (and counted) while it runs.
    rounds = value('max(fedattn_rounds_completed_total{job="fl-server"})')
    uplink = value('sum(fedattn_raw_tensor_bytes_total{job="fl-server",kind="shared_tensors",'
                   'direction="up"})')
    first = json.loads((tmp_path / "server-state" / "history.json").read_text())["rounds"][0]
    model_bytes = first["bytes"]["up"]["shared_tensors"]["raw"] / 2
    assert 2 * model_bytes * rounds <= uplink <= 2 * model_bytes * (rounds + 2)
    accuracy = api.query('fedattn_eval_accuracy{job="fl-server",split="test"}')
    assert sorted(s["metric"]["edge"] for s in accuracy) == ["e0", "e1"]
    assert all(0 <= float(s["value"][1]) <= 1 for s in accuracy)
    assert value('sum(fedattn_edges_dropped_total)') == 0
    assert value("min(fedattn_edge_private_state_bytes)") > 0
    assert not math.isnan(value('max(fedattn_edge_result{name="samples_per_second"})'))

    # Prometheus loaded the alert rules, they evaluate cleanly, and none fires on a healthy run.
    groups = api.get("rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 6 and all(r["health"] == "ok" for r in rules), rules
    assert [r["name"] for r in rules if r["state"] != "inactive"] == []


@pytest.mark.slow
def test_privacy_row_under_dp_sgd_and_secure_aggregation(cluster, tmp_path, prometheus_tools):
    budget = 1000.0  # far more than the rounds this test waits for spend
    api = live_federation(cluster, tmp_path, prometheus_tools, 3,
                          "--secagg", "--secagg-graph", "full",
                          "--dp", "--dp-fix-model", "--dp-noise-multiplier", "1.0",
                          "--dp-epsilon", str(budget), "--batch-size", "20")
    assert not panels_without_series(api, ROWS_WITH_FLAGS)

    # Each edge's spend, as its own /metrics and the server's agree, is a share of the budget.
    used = {s["metric"]["edge"]: float(s["value"][1]) for s in api.query(
        'fedattn_dp_epsilon{job="fl-server"} / scalar(fedattn_dp_epsilon_budget)')}
    assert sorted(used) == ["e0", "e1", "e2"] and all(0 < u < 1 for u in used.values())
    on_edges = api.query('fedattn_edge_dp_epsilon_budget{job="fl-edge"}')
    assert len(on_edges) == 3 and {float(s["value"][1]) for s in on_edges} == {budget}
    # The SecAgg+ steps of the masked train phase are timed, and nobody dropped out.
    steps = api.query('fedattn_phase_seconds_count{job="fl-server",phase=~"secagg-.*"}')
    assert {s["metric"]["phase"] for s in steps} == {
        "secagg-advertise:train", "secagg-share:train", "secagg-receive:train",
        "secagg-confirm:train", "secagg-unmask:train"}
    assert all(float(s["value"][1]) >= 3 for s in steps)
    dropped = api.query('sum(fedattn_edges_dropped_total{phase=~"secagg-.*"})')
    assert float(dropped[0]["value"][1]) == 0
    secagg_up = api.query('sum(fedattn_wire_bytes_total{job="fl-server",kind="secagg",'
                          'direction="up"})')
    assert float(secagg_up[0]["value"][1]) > 0
    # Masking keeps the payload overhead that FedattnWireOverheadHigh watches near 1.
    ratio = api.query('sum by (direction) (rate(fedattn_wire_bytes_total{job="fl-server",'
                      'kind!="meta"}[20s])) / sum by (direction) '
                      '(rate(fedattn_raw_tensor_bytes_total{job="fl-server"}[20s]))')
    assert {s["metric"]["direction"] for s in ratio} == {"up", "down"}
    assert all(1.0 <= float(s["value"][1]) < 1.05 for s in ratio)
