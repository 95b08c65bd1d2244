"""deploy/ checked without a container engine or a cluster: Dockerfiles linted with
hadolint, Kubernetes manifests validated against the Kubernetes schemas (both ship with
their PyPI packages, so this works offline), the compose file and systemd units checked
for what would break a deployment."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

DEPLOY = REPO / "deploy"
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is missing: pip install -c constraints.txt -e '.[test]'")
    return path


def test_dockerfiles_pass_hadolint():
    assert [p.name for p in DOCKERFILES] == ["edge-cuda.Dockerfile", "edge-jetson.Dockerfile",
                                             "server.Dockerfile"]
    done = subprocess.run([tool("hadolint"), "--failure-threshold", "info", *map(str, DOCKERFILES)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
            for line in (raw.strip() for raw in text.splitlines())
            if line and not line.startswith("#")]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_non_root_with_the_state_dir_as_a_volume(path):
    instructions = dockerfile_instructions(path)
    users = [arg for op, arg in instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert '["/var/lib/fedattn"]' in [arg for op, arg in instructions if op == "VOLUME"]
    assert any(op == "HEALTHCHECK" for op, _ in instructions)
    cmd = next(arg for op, arg in reversed(instructions) if op == "CMD")
    assert "/var/lib/fedattn/" in cmd  # the daemon's state is inside the volume


@pytest.mark.parametrize("name", ["edge-cuda.Dockerfile", "edge-jetson.Dockerfile"])
def test_edge_images_keep_their_torch_and_check_progress(name):
    """The edge images install with a platform's constraints and fail the build if the
    torch they end with is not the one installed before; their health check is the edge's
    progress check (/healthz), on the port the command gives the edge."""
    instructions = dockerfile_instructions(DEPLOY / "docker" / name)
    runs = " ".join(arg for op, arg in instructions if op == "RUN")
    constraints = re.findall(r"install [^&]*-c \"?([^\s\"]+)\"? \.", runs)
    args = dict(arg.split("=", 1) for op, arg in instructions if op == "ARG" and "=" in arg)
    assert constraints, runs
    for path in constraints:  # a literal path, or an ARG whose default is one
        path = args.get(path.strip("${}"), path)
        assert (REPO / path).is_file(), path
    assert "torch.__version__ == kept" in runs
    health = next(arg for op, arg in instructions if op == "HEALTHCHECK")
    cmd = next(arg for op, arg in reversed(instructions) if op == "CMD")
    port = re.search(r'"--metrics-port", "(\d+)"', cmd)[1]
    assert f"http://127.0.0.1:{port}/healthz" in health


def test_the_edge_unit_is_supervised_by_progress():
    """systemd restarts a stuck edge (watchdog pinged while /healthz is 200) and never a
    refused setting (status 2), which would fail the same way every RestartSec."""
    unit = (DEPLOY / "systemd" / "fl-edge@.service").read_text()
    for line in ("Type=notify", "NotifyAccess=main", "RestartPreventExitStatus=2",
                 "WatchdogSignal=SIGTERM", "KillSignal=SIGTERM"):
        assert re.search(rf"^{line}$", unit, re.M), line
    watchdog = int(re.search(r"^WatchdogSec=(\d+)$", unit, re.M)[1])
    stop = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M)[1])
    assert watchdog >= 60 and stop >= 20  # a Leave takes up to 10 s, a state write a few
    assert "exec /opt/fedattn/bin/fl-edge" in unit  # fl-edge is the main PID that notifies


@pytest.mark.slow
def test_the_sources_the_images_copy_build_the_package(tmp_path):
    """pip install . inside the image sees only what the Dockerfile COPYs: build a wheel
    from exactly those files and check that it holds both daemons' entry points."""
    copies = {tuple(arg.split()) for path in DOCKERFILES
              for op, arg in dockerfile_instructions(path) if op == "COPY"}
    context = tmp_path / "context"
    for *sources, _ in copies:
        for source in sources:
            target = context / source
            if (REPO / source).is_dir():
                shutil.copytree(REPO / source, target,
                                ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / source, target)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path / "wheel"), str(context)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    import zipfile

    wheel = next((tmp_path / "wheel").glob("fedattn-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names
                        if n.endswith("entry_points.txt"))
    assert "fl-server = fl_server.cli:main" in entry_points
    assert "fl-edge = fl_edge.cli:main" in entry_points
    assert "fedattn_shared/data/bundled/mnist/README.md" in names


def k8s_resources() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted((DEPLOY / "k8s").glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_kubernetes_manifests_match_the_schemas():
    import kubernetes_validate

    resources = k8s_resources()
    kinds = sorted(f"{doc['kind']}/{doc['metadata']['name']}" for _, doc in resources)
    assert kinds == ["Deployment/fl-server", "PersistentVolumeClaim/fl-server-state",
                     "Secret/fedattn-token", "Service/fl-edge", "Service/fl-server",
                     "StatefulSet/fl-edge"]
    for _, doc in resources:
        # The oldest minor version the manifests target (gRPC probes are GA since 1.27).
        kubernetes_validate.validate(doc, "1.30.0", strict=True)  # raises naming the field
    # The validator does reject a misspelt field.
    deployment = next(doc for _, doc in resources if doc["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["livenessProbes"] = container.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.30.0", strict=True)


def test_kubernetes_wiring():
    resources = {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in k8s_resources()}
    server = resources[("Deployment", "fl-server")]["spec"]["template"]["spec"]
    container = server["containers"][0]
    assert container["livenessProbe"]["grpc"]["port"] == 50051
    assert container["readinessProbe"]["grpc"]["port"] == 50051
    claim = server["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in resources
    assert "--checkpoint-dir /var/lib/fedattn/server" in container["args"][0]
    assert container["volumeMounts"][0]["mountPath"] == "/var/lib/fedattn"
    service = resources[("Service", "fl-server")]
    assert service["spec"]["selector"] == resources[("Deployment", "fl-server")]["spec"]["selector"][
        "matchLabels"]

    edges = resources[("StatefulSet", "fl-edge")]["spec"]
    edge = edges["template"]["spec"]["containers"][0]
    # One PVC per edge for its private state, mounted where --state-dir points.
    assert [t["metadata"]["name"] for t in edges["volumeClaimTemplates"]] == ["state"]
    state_mount = next(m for m in edge["volumeMounts"] if m["name"] == "state")["mountPath"]
    assert edge["args"][edge["args"].index("--state-dir") + 1].startswith(state_mount + "/")
    assert edge["args"][edge["args"].index("--server") + 1] == "fl-server:50051"
    assert edge["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("livenessProbe", "readinessProbe"):  # the edge's progress check
        assert edge[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe
    for env in (container["env"], edge["env"]):
        token = next(e for e in env if e["name"] == "FEDATTN_TOKEN")
        assert ("Secret", token["valueFrom"]["secretKeyRef"]["name"]) in resources


def test_compose_file_is_consistent():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"server", "prometheus", "grafana"} <= set(services)
    edges = sorted(name for name in services if name.startswith("edge-"))
    assert len(edges) >= 2
    for name, service in services.items():
        if "build" in service:
            assert (DEPLOY / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                # bind mounts of deploy/ files must exist; edge data folders are the operator's
                assert (DEPLOY / source).exists() or source.startswith("./data/"), (name, source)
            else:
                assert source in compose["volumes"], (name, source)
    server_args = services["server"]["command"]
    metrics_port = server_args[server_args.index("--metrics-port") + 1]
    grpc_port = server_args[server_args.index("--port") + 1]
    assert "manifest.json" in services["server"]["entrypoint"][2]  # resumes after a crash

    # Prometheus scrapes exactly the daemons compose runs, on the ports they serve.
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job["static_configs"][0]["targets"]
            for job in prometheus["scrape_configs"]}
    assert jobs["fl-server"] == [f"server:{metrics_port}"]
    expected_edges = []
    for name in edges:
        args = services[name]["command"]
        assert args[args.index("--server") + 1] == f"server:{grpc_port}"
        assert args[args.index("--name") + 1] == name
        state = args[args.index("--state-dir") + 1]
        assert any(v.endswith(":/var/lib/fedattn") and state.startswith("/var/lib/fedattn/")
                   for v in services[name]["volumes"]), name
        expected_edges.append(f"{name}:{args[args.index('--metrics-port') + 1]}")
    assert sorted(jobs["fl-edge"]) == expected_edges
    for rule_file in prometheus["rule_files"]:
        assert (DEPLOY / rule_file).is_file()

    # Grafana gets the datasource and the dashboard through provisioning.
    grafana = services["grafana"]["volumes"]
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in grafana
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/fedattn.yml").read_text())
    dashboards_path = provider["providers"][0]["options"]["path"]
    assert f"./grafana/dashboards:{dashboards_path}:ro" in grafana


def test_systemd_units_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    units = sorted((DEPLOY / "systemd").glob("*.service"))
    assert [u.name for u in units] == ["fl-edge@.service", "fl-server.service"]
    for unit in units:
        # A template is verified as one of its instances.
        target = tmp_path / unit.name.replace("@.", "@cam0.")
        shutil.copy(unit, target)
        done = subprocess.run([analyze, "verify", str(target)], capture_output=True, text=True,
                              timeout=60)
        # verify exits 0 on mere warnings, such as an unknown key or a bad value: those fail here
        problems = [line for line in (done.stdout + done.stderr).splitlines()
                    if target.name in line or str(target) in line]
        assert done.returncode == 0 and not problems, done.stdout + done.stderr
        text = unit.read_text()
        assert "Restart=on-failure" in text and "EnvironmentFile=/etc/fedattn/" in text
        assert "User=fedattn" in text and "StateDirectory=fedattn" in text
