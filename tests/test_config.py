"""Configuration: --set parsing, TOML files, typed application, precedence, validation."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fedattn_shared.config import (
    ConfigError,
    ServerConfig,
    TrainConfig,
    apply_values,
    load_toml,
    merge_sources,
    parse_set,
    to_json,
)

# ---- parse_set ------------------------------------------------------------------------


def test_parse_set_reads_toml_values():
    out = parse_set([
        "fedprox.mu=0.1",
        "server.rounds=5",
        "server.resume=true",
        'train.private=["bn", "head"]',
        'server.join_token="123"',
        "train.lr=1e-3",
        "fedprox.mu=0.25",  # a repeated key: the last one wins
    ])
    assert out == {
        "fedprox": {"mu": 0.25},
        "server": {"rounds": 5, "resume": True, "join_token": "123"},
        "train": {"private": ["bn", "head"], "lr": 0.001},
    }
    assert type(out["server"]["rounds"]) is int
    assert type(out["fedprox"]["mu"]) is float


def test_parse_set_takes_bare_words_as_strings():
    out = parse_set(["server.method=fedavg", "server.host=0.0.0.0", "train.model=lenet-bn",
                     "server.checkpoint_dir=./runs/a b", "x.y=1=2"])
    assert out == {
        "server": {"method": "fedavg", "host": "0.0.0.0", "checkpoint_dir": "./runs/a b"},
        "train": {"model": "lenet-bn"},
        "x": {"y": "1=2"},
    }


def test_parse_set_strips_the_key():
    assert parse_set([" server.rounds =3"]) == {"server": {"rounds": 3}}


@pytest.mark.parametrize("item", ["rounds=3", "server.rounds", ".rounds=3", "server.=3", "=3", ""])
def test_parse_set_malformed(item):
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_set([item])


# ---- load_toml ------------------------------------------------------------------------


def test_load_toml_reads_sections(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[server]\nrounds = 3\nmethod = "fedprox"\n\n[fedprox]\nmu = 0.5\n')
    assert load_toml(path) == {"server": {"rounds": 3, "method": "fedprox"},
                               "fedprox": {"mu": 0.5}}
    assert load_toml(str(path)) == load_toml(path)


def test_load_toml_missing_file_names_it(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="nope.toml does not exist"):
        load_toml(path)


def test_load_toml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[server]\nrounds = = 3\n")
    with pytest.raises(ConfigError, match=r"config file .*bad\.toml: .*line 2"):
        load_toml(path)


def test_load_toml_top_level_values_need_a_section(tmp_path):
    path = tmp_path / "flat.toml"
    path.write_text('rounds = 3\n[server]\nport = 1\n')
    with pytest.raises(ConfigError, match=r"flat\.toml: top-level key 'rounds' must be a \[section\]"):
        load_toml(path)


def test_load_toml_is_utf8_and_bad_bytes_name_the_file(tmp_path):
    path = tmp_path / "utf8.toml"
    path.write_bytes('[train]\nclass_names = ["café", "naïve"]\n'.encode())
    assert load_toml(path) == {"train": {"class_names": ["café", "naïve"]}}
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'[train]\nmodel = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"latin1\.toml"):
        load_toml(bad)


def test_load_toml_directory_names_it(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path.name)):
        load_toml(tmp_path)


# ---- apply_values ---------------------------------------------------------------------


def test_apply_values_sets_typed_fields():
    train = TrainConfig()
    apply_values(train, "train", {"lr": 0.5, "seed": 7, "private": ["bn"], "model": "x"}, "f.toml")
    assert (train.lr, train.seed, train.private, train.model) == (0.5, 7, ["bn"], "x")
    server = ServerConfig()
    apply_values(server, "server", {"resume": True, "insecure": False}, "--set")
    assert server.resume is True and server.insecure is False


def test_apply_values_coerces_int_to_float():
    train = TrainConfig()
    apply_values(train, "train", {"lr": 1, "momentum": 0}, "f.toml")
    assert train.lr == 1.0 and type(train.lr) is float
    assert type(train.momentum) is float
    server = ServerConfig()
    apply_values(server, "server", {"round_timeout": 30}, "f.toml")
    assert type(server.round_timeout) is float


def test_apply_values_refuses_unknown_keys():
    train = TrainConfig()
    with pytest.raises(ConfigError, match=r"run\.toml: unknown key train\.learning_rate") as err:
        apply_values(train, "train", {"learning_rate": 0.1}, "run.toml")
    assert "lr" in str(err.value)  # the known keys are listed
    assert train == TrainConfig()


@pytest.mark.parametrize("key, value", [
    ("seed", 1.5),            # float for int
    ("seed", True),           # bool is not an int here
    ("seed", "3"),            # string for int
    ("lr", "0.1"),            # string for float
    ("lr", True),             # bool is not a float
    ("model", 3),             # int for str
    ("private", "bn"),        # str for list
    ("class_names", [1, 2]),  # wrong element type
])
def test_apply_values_refuses_wrong_types(key, value):
    with pytest.raises(ConfigError, match=rf"--set: train\.{key}"):
        apply_values(TrainConfig(), "train", {key: value}, "--set")


def test_apply_values_names_the_list_element():
    with pytest.raises(ConfigError, match=r"train\.private\[1\]: expected str"):
        apply_values(TrainConfig(), "train", {"private": ["bn", 2]}, "x")


def test_apply_values_bool_field_refuses_int():
    with pytest.raises(ConfigError, match=r"server\.resume: expected bool"):
        apply_values(ServerConfig(), "server", {"resume": 1}, "x")


def test_apply_values_union_field():
    @dataclasses.dataclass
    class Params:
        limit: int | None = None
        ratio: float = 0.5

    params = Params()
    apply_values(params, "p", {"limit": 4, "ratio": 2}, "x")
    assert params.limit == 4 and params.ratio == 2.0 and type(params.ratio) is float
    with pytest.raises(ConfigError, match=r"p\.limit"):
        apply_values(params, "p", {"limit": "four"}, "x")


# ---- merge_sources --------------------------------------------------------------------


def test_merge_sources_later_wins_key_by_key():
    defaults = {"server": {"rounds": 10, "port": 50051}, "fedprox": {"mu": 0.01}}
    file = {"server": {"rounds": 3, "method": "fedprox"}, "train": {"lr": 0.1}}
    flags = {"server": {"port": 6000}}
    sets = {"server": {"rounds": 7}, "fedprox": {"mu": 0.5}}
    merged = merge_sources(("defaults", defaults), ("run.toml", file), ("flags", flags),
                           ("--set", sets))
    values = {section: vals for section, (_, vals) in merged.items()}
    assert values == {
        "server": {"rounds": 7, "port": 6000, "method": "fedprox"},
        "fedprox": {"mu": 0.5},
        "train": {"lr": 0.1},
    }
    assert merged["train"][0] == "run.toml"  # a section only one source touched
    # Inputs are not mutated.
    assert file == {"server": {"rounds": 3, "method": "fedprox"}, "train": {"lr": 0.1}}


def test_merge_sources_order_matters():
    a = ("a", {"s": {"k": 1}})
    b = ("b", {"s": {"k": 2}})
    assert merge_sources(a, b)["s"][1] == {"k": 2}
    assert merge_sources(b, a)["s"][1] == {"k": 1}
    assert merge_sources() == {}


def test_merge_then_apply_end_to_end(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[train]\nlr = 0.1\nbatch_size = 8\n")
    merged = merge_sources((str(path), load_toml(path)),
                           ("--set", parse_set(["train.lr=1", "train.private=[\"bn\"]"])))
    source, values = merged["train"]
    train = TrainConfig()
    apply_values(train, "train", values, source)
    assert (train.lr, train.batch_size, train.private) == (1.0, 8, ["bn"])
    train.validate()
    assert json.loads(to_json(train))["lr"] == 1.0


# ---- validate -------------------------------------------------------------------------


def test_defaults_validate():
    TrainConfig().validate()
    ServerConfig().validate()


@pytest.mark.parametrize("changes, message", [
    ({"num_classes": 1}, r"train\.num_classes must be >= 2"),
    ({"num_classes": 3, "class_names": ["a", "b"]}, r"class_names has 2 names for 3 classes"),
    ({"optimizer": "rmsprop"}, r"train\.optimizer: 'rmsprop' is not one of sgd, adam"),
    ({"local_epochs": -1}, r"train\.local_epochs must be >= 0"),
    ({"batch_size": 0}, r"train\.batch_size must be >= 1"),
    ({"in_channels": 0}, r"train\.in_channels must be >= 1"),
    ({"image_size": 0}, r"train\.image_size must be >= 1"),
    ({"lr": 0.0}, r"train\.lr must be > 0"),
    ({"lr": -0.1}, r"train\.lr must be > 0"),
    ({"lr": float("nan")}, r"train\.lr must be > 0"),
    ({"test_fraction": 0.0}, r"train\.test_fraction must be in \(0, 1\)"),
    ({"test_fraction": 1.0}, r"train\.test_fraction"),
])
def test_train_validate_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(TrainConfig(), **changes).validate()


def test_train_validate_accepts_edges_of_ranges_and_class_names():
    config = TrainConfig(num_classes=2, class_names=["cat", "dog"], optimizer="adam",
                         test_fraction=0.999)
    config.validate()
    assert config.classes == ["cat", "dog"]
    assert TrainConfig(num_classes=3).classes == ["0", "1", "2"]


@pytest.mark.parametrize("changes, message", [
    ({"rounds": 0}, r"server\.rounds must be >= 1"),
    ({"min_edges": 0}, r"server\.min_edges must be >= 1"),
    ({"quorum": -1}, r"server\.quorum must be >= 0"),
    ({"fraction": 0.0}, r"server\.fraction must be in \(0, 1\]"),
    ({"fraction": 1.01}, r"server\.fraction"),
    ({"round_timeout": 0.0}, r"server\.round_timeout must be > 0"),
    ({"chunk_bytes": 1023}, r"server\.chunk_bytes must be in \[1024, 3 MiB\]"),
    ({"chunk_bytes": (3 << 20) + 1}, r"server\.chunk_bytes"),
    ({"max_concurrent_uploads": 0}, r"server\.max_concurrent_uploads must be >= 1"),
    ({"port": -1}, r"server\.port out of range"),
    ({"port": 65536}, r"server\.port out of range"),
    ({"eval_every": -1}, r"server\.eval_every must be >= 0"),
])
def test_server_validate_errors(changes, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(ServerConfig(), **changes).validate()


def test_server_validate_accepts_range_ends():
    dataclasses.replace(ServerConfig(), chunk_bytes=1024, fraction=1.0, port=0, quorum=0,
                        eval_every=0).validate()
    dataclasses.replace(ServerConfig(), chunk_bytes=3 << 20, port=65535).validate()
