"""Transport security: the CA and enrollment (`fl-server certs`), mutual TLS between real
daemons over loopback, and the refusals: another CA, a wrong or missing enrollment token,
a revoked edge, a certificate used for another edge id, plaintext against TLS."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading

import grpc
import pytest
from conftest import serving, write_edge_dirs
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedattn_shared import PROTOCOL_VERSION
from fedattn_shared.config import ServerConfig, TrainConfig
from fedattn_shared.methods import MethodContext, load_method
from fedattn_shared.tls import ENROLLED, edge_credentials
from fedattn_shared.wire import fedattn_pb2 as pb
from fedattn_shared.wire import fedattn_pb2_grpc as pb_grpc
from fedattn_shared.wire.signing import new_key_share
from fl_edge.cli import main as edge_main
from fl_edge.daemon import EdgeDaemon, EdgeExit, EdgeOptions
from fl_server.app import ServerApp
from fl_server.cli import main as server_main


@pytest.fixture
def ca(tmp_path):
    directory = tmp_path / "ca"
    assert server_main(["certs", "init", str(directory), "--hosts", "localhost,127.0.0.1"]) == 0
    for edge in ("e0", "e1", "e2"):
        assert server_main(["certs", "issue", str(directory), edge]) == 0
    return directory


def test_certs_are_written_private_and_tokens_stored_hashed(ca, capsys):
    mode = lambda p: os.stat(p).st_mode & 0o777  # noqa: E731
    assert mode(ca) == 0o700
    assert mode(ca / "ca.key") == 0o600 and mode(ca / "server.key") == 0o600
    assert mode(ca / ENROLLED) == 0o600
    edge = ca / "edges" / "e0"
    assert mode(edge) == 0o700 and mode(edge / "edge.key") == 0o600
    assert mode(edge / "token") == 0o600
    token = (edge / "token").read_text()
    enrolled = json.loads((ca / ENROLLED).read_text())
    assert token not in json.dumps(enrolled) and not enrolled["e0"]["revoked"]
    _, read_token, certified = edge_credentials(edge)
    assert (read_token, certified) == (token, "e0")
    assert server_main(["certs", "issue", str(ca), "e0"]) == 2
    assert "already enrolled" in capsys.readouterr().err
    assert server_main(["certs", "init", str(ca)]) == 2
    assert server_main(["certs", "issue", str(ca), "bad/name"]) == 2


def test_plaintext_needs_an_explicit_insecure(tmp_path, capsys):
    assert server_main(["--checkpoint-dir", str(tmp_path / "s")]) == 2
    assert "--tls-dir DIR for mutual TLS" in capsys.readouterr().err
    assert edge_main(["--server", "x:1", "--data-dir", str(tmp_path)]) == 2
    assert "--tls-dir DIR" in capsys.readouterr().err


@contextlib.contextmanager
def tls_server(tmp_path, ca, rounds=1, min_edges=2, **options):
    train = TrainConfig(lr=0.05, local_epochs=1)
    cls = load_method("fedavg")
    cfg = ServerConfig(method="fedavg", rounds=rounds, min_edges=min_edges, host="127.0.0.1",
                       port=0, checkpoint_dir=str(tmp_path / "server"), tls_dir=str(ca),
                       poll_timeout=2.0, round_timeout=60, eval_every=0, **options)
    app = ServerApp(cfg, train, cls(MethodContext(train, cls.Params())))
    with serving(app) as port:
        yield app, port


def edge_options(tmp_path, port, tls_dir, i=0, **extra):
    data = write_edge_dirs(tmp_path / f"d{i}", 1, [60])[0]
    return EdgeOptions(server=f"localhost:{port}", data_dir=data,
                       state_dir=tmp_path / f"state-{i}", device="cpu", retry_for=20,
                       progress=False, tls_dir=tls_dir, **extra)


@pytest.mark.slow
def test_a_secure_federation_runs_over_mutual_tls(tmp_path, ca):
    with tls_server(tmp_path, ca, min_edges=3, secagg=True, secagg_graph="full") as (app, port):
        results = {}

        def run(i):
            results[i] = EdgeDaemon(edge_options(tmp_path, port, ca / "edges" / f"e{i}", i)).run()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results == {0: 0, 1: 0, 2: 0}
        record = app.engine.history["rounds"][0]
        assert record["aggregate"]["secagg-unmask"]["unmasked"] == 3
        assert sorted(app.engine.edges.records) == ["e0", "e1", "e2"]


def raw_join(port, tls_dir, edge_id, token=None):
    credentials, enrolled_token, _ = edge_credentials(tls_dir)
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        stub = pb_grpc.FederatedLearningStub(channel)
        signing_key = Ed25519PrivateKey.generate()
        _, share, proof = new_key_share(signing_key, edge_id)
        return stub.Join(pb.JoinRequest(
            protocol_version=PROTOCOL_VERSION, edge_id=edge_id, edge_secret="s" * 32,
            join_token=enrolled_token if token is None else token,
            signing_key=signing_key.public_key().public_bytes_raw(),
            upload_key_share=share, upload_key_proof=proof), timeout=20)


def test_identity_refusals(tmp_path, ca, caplog):
    other = tmp_path / "other-ca"
    assert server_main(["certs", "init", str(other), "--hosts", "localhost"]) == 0
    assert server_main(["certs", "issue", str(other), "e0"]) == 0
    assert server_main(["certs", "revoke", str(ca), "e2"]) == 0
    caplog.set_level(logging.WARNING, logger="fl_server")
    with tls_server(tmp_path, ca) as (_, port):
        assert raw_join(port, ca / "edges" / "e0", "e0").session  # the enrolled edge is in
        with pytest.raises(grpc.RpcError) as err:
            raw_join(port, ca / "edges" / "e0", "e1")  # e0's certificate, e1's id
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "certificate is for 'e0', not edge 'e1'" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            raw_join(port, ca / "edges" / "e1", "e1", token="0" * 64)
        assert "wrong enrollment token" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            raw_join(port, ca / "edges" / "e2", "e2")
        assert "edge e2 is revoked" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # a certificate of another CA
            raw_join(port, other / "edges" / "e0", "e0")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, \
                pytest.raises(grpc.RpcError) as err:  # plaintext against TLS
            pb_grpc.FederatedLearningStub(channel).Join(pb.JoinRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(EdgeExit, match="revoked"):  # the daemon stops with the reason
            EdgeDaemon(edge_options(tmp_path, port, ca / "edges" / "e2", 2)).run()
        with pytest.raises(EdgeExit, match="certificate .* is for edge e1"):
            EdgeDaemon(edge_options(tmp_path, port, ca / "edges" / "e1", 1, name="e0"))
    logged = caplog.text
    assert "join refused for 'e1'" in logged and "wrong enrollment token" in logged
    assert "edge e2 is revoked" in logged
