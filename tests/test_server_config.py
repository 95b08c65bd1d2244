"""fl-server's configuration: defaults < TOML < flags < --set, errors name the item."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from fedattn_shared import config as config_module
from fedattn_shared.config import ConfigError, ServerConfig
from fl_server.cli import build_parser, main, resolve
from fl_server.settings import ServerSettings, resolve_settings


def resolved(*argv: str):
    return resolve(build_parser().parse_args(list(argv)))


def test_precedence_defaults_toml_flags_set(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[server]\nmethod = "fedprox"\nrounds = 7\nquorum = 3\n'
                   '[train]\nlr = 0.2\nbatch_size = 16\n[fedprox]\nmu = 0.5\n')
    server, train, method = resolved("--config", str(cfg))
    assert (server.method, server.rounds, server.quorum) == ("fedprox", 7, 3)
    assert (train.lr, train.batch_size, method.params.mu) == (0.2, 16, 0.5)
    assert server.min_edges == 2  # default untouched

    server, train, method = resolved("--config", str(cfg), "--rounds", "9", "--lr", "0.3")
    assert (server.rounds, server.quorum, train.lr) == (9, 3, 0.3)

    server, train, method = resolved("--config", str(cfg), "--rounds", "9",
                                     "--set", "server.rounds=11", "--set", "fedprox.mu=0.01",
                                     "--set", 'train.private=["bn"]')
    assert (server.rounds, method.params.mu, train.private) == (11, 0.01, ["bn"])
    assert "model/features.1.weight" not in method.shared_specs(method.build_models())


def test_errors_name_the_source_and_key(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[server]\nrounds = 'many'\n")
    with pytest.raises(ConfigError, match=r"bad.toml: server.rounds: expected int"):
        resolved("--config", str(cfg))
    with pytest.raises(ConfigError, match=r"unknown key fedprox.nu"):
        resolved("--method", "fedprox", "--set", "fedprox.nu=1")
    with pytest.raises(ConfigError, match=r"\[fedadam\].*not a section this run uses"):
        resolved("--method", "fedprox", "--set", "fedadam.tau=1")
    with pytest.raises(ConfigError, match="unknown split rule 'gn'"):
        resolved("--private", "gn")
    with pytest.raises(ConfigError, match="unknown model"):
        resolved("--model", "vgg")
    with pytest.raises(ConfigError, match="does not exist"):
        resolved("--config", str(tmp_path / "missing.toml"))


def test_usage_errors_exit_2(capsys):
    assert main(["--insecure", "--fraction", "1.5"]) == 2
    assert "server.fraction" in capsys.readouterr().err
    assert main(["--insecure", "--set", "nodot"]) == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["--rounds", "x"])
    assert exit_info.value.code == 2


def test_scaffold_refuses_optimizers_its_update_does_not_fit():
    with pytest.raises(ConfigError, match="plain SGD"):
        resolved("--method", "scaffold", "--momentum", "0.9")
    with pytest.raises(ConfigError, match="plain SGD"):
        resolved("--method", "scaffold", "--optimizer", "adam")
    server, _, method = resolved("--method", "scaffold")
    assert method.name == "scaffold"
    # NIID-Bench's form steps momentum SGD and corrects after the step: momentum is taken.
    _, train, method = resolved("--method", "scaffold", "--momentum", "0.9",
                                "--set", "scaffold.correction=step")
    assert (train.momentum, method.params.correction) == (0.9, "step")


def test_a_methods_declared_model_and_training_settings_apply_unless_a_source_sets_them(
        tmp_path):
    """Every registered method resolves with no flag beyond --method: its declared default
    model (FedSTAR's mobilenet-v3-compact, whose width 8 heads divide) and training settings
    (SCAFFOLD's plain SGD) fill what no source names; a source that names them wins."""
    from fedattn_shared.methods import available_methods

    for name in available_methods():
        _, train, method = resolved("--method", name)
        assert train.model == (method.default_model or "lenet-bn"), name
    _, train, _ = resolved("--method", "fedstar")
    assert train.model == "mobilenet-v3-compact"
    with pytest.raises(ConfigError, match=r"default model \(mobilenet-v3-compact.*heads=H"):
        resolved("--method", "fedstar", "--model", "lenet-bn")
    cfg = tmp_path / "run.toml"
    cfg.write_text("[train]\nmomentum = 0.5\nweight_decay = 0.1\n")
    _, train, _ = resolved("--config", str(cfg), "--method", "fedavg")
    assert (train.momentum, train.weight_decay) == (0.5, 0.1)
    with pytest.raises(ConfigError, match="plain SGD"):  # the user's file wins, and is refused
        resolved("--config", str(cfg), "--method", "scaffold")


def test_train_settings_must_name_train_keys():
    from fedattn_shared.methods.base import Method

    class Fine(Method):
        train_settings = {"momentum": 0.0}

    assert Fine.train_settings == (("momentum", 0.0),)
    with pytest.raises(TypeError, match="train_settings must map"):
        class Wrong(Method):  # noqa: F841
            train_settings = {"momentun": 0.0}


# ---- specs resolved once; async_lr, the old server_lr ---------------------------------------
def test_the_specs_are_resolved_once_into_typed_settings():
    """fl-server resolves --compress and --staleness-weight once, at start: the server's
    parts read typed values (``ServerSettings``), never the strings."""
    server, _, _ = resolved("--compress", "up=int8,down=fp16", "--mode", "async",
                            "--staleness-weight", "hinge:0.5,2")
    assert isinstance(server, ServerSettings)
    assert server.compression.text == "up=int8:256,down=fp16"
    assert server.compression.up.codec.integer_bits == 8
    assert (server.staleness(2), server.staleness(4)) == (1.0, 0.5)
    assert resolve_settings(server) is server  # resolved once
    assert resolve_settings(ServerConfig()).compression.text == ""


@pytest.mark.parametrize("flags, needle", [
    (["--compress", "up=zstd"], "server.compress: unknown codec 'zstd'"),
    (["--compress", "up=fp16", "--secagg"], "server.compress up=fp16 does not combine with --secagg"),
    (["--staleness-weight", "poly"], "server.staleness_weight"),
])
def test_a_bad_spec_exits_2_before_anything_starts(tmp_path, capsys, flags, needle):
    assert main(["--insecure", "--port", "0", "--checkpoint-dir", str(tmp_path / "s"), *flags]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_the_config_imports_no_codec():
    """``fedattn_shared.config`` is read before anything is built: the codecs (and what
    they import) are the server's to resolve (``fl_server.settings``)."""
    tree = ast.parse((Path(config_module.__file__)).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert not {m for m in imported if m and "compress" in m}, imported


def test_async_lr_is_the_buffered_step_and_the_old_name_is_read_where_it_was_unambiguous(
        tmp_path, caplog):
    assert resolved("--mode", "async", "--async-lr", "0.5")[0].async_lr == 0.5
    assert resolved()[0].async_lr == 1.0
    old = tmp_path / "old.toml"
    old.write_text('[server]\nmode = "async"\nserver_lr = 0.25\n')
    with caplog.at_level(logging.WARNING, logger="fl_server"):
        assert resolved("--config", str(old))[0].async_lr == 0.25
        assert resolved("--mode", "async", "--server-lr", "0.75")[0].async_lr == 0.75
    assert "server.server_lr (--server-lr) is now server.async_lr (--async-lr)" in caplog.text
    # --mode sync never read it: a user who set it more likely meant the method's own step
    with pytest.raises(ConfigError, match=r"now server.async_lr \(--async-lr\).*fedadam.server_lr"):
        resolved("--method", "fedadam", "--server-lr", "0.01")
    with pytest.raises(ConfigError, match="both are set: keep async_lr"):
        resolved("--config", str(old), "--async-lr", "0.5")
    # FedAdam's own server step is untouched by either
    _, _, method = resolved("--method", "fedadam", "--set", "fedadam.server_lr=0.02")
    assert method.params.server_lr == 0.02
