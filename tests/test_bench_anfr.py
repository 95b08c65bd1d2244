"""bench/anfr.py's FedAdam server learning-rate sweep (issue #24): each rate is its own
run label, and each label sets exactly its rate on the server; a bad list is refused."""

from __future__ import annotations

import argparse

import pytest
from conftest import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("anfr") as module:
        yield module


def test_fedadam_becomes_one_run_per_server_rate_and_the_others_stay(bench):
    labels = bench.expand(["fedavg", "fedadam", "fedper"], [1e-3, 3e-3, 1e-2])
    assert labels == ["fedavg", "fedadam-slr0.001", "fedadam-slr0.003", "fedadam-slr0.01",
                      "fedper"]
    assert [bench.base_method(label) for label in labels] == [
        ("fedavg", {}), ("fedadam", {"fedadam.server_lr": 0.001}),
        ("fedadam", {"fedadam.server_lr": 0.003}), ("fedadam", {"fedadam.server_lr": 0.01}),
        ("fedper", {})]


def test_the_default_sweep_spans_the_rate_the_paper_saw_diverge(bench):
    parser_default = bench.DEFAULT_FEDADAM_SERVER_LRS
    assert 1e-2 in parser_default and min(parser_default) < 1e-2


@pytest.mark.parametrize("text, rates", [("1e-3,3e-3", [1e-3, 3e-3]), ("0.01", [0.01]),
                                         ("3e-3, 1e-3,", [3e-3, 1e-3])])
def test_rates_parse_in_the_given_order(bench, text, rates):
    assert bench.server_lrs(text) == rates


@pytest.mark.parametrize("text", ["", "0", "-1e-3", "1e-3,1e-3", "inf", "fast", "1e-3;2e-3"])
def test_a_bad_rate_list_is_refused(bench, text):
    with pytest.raises(argparse.ArgumentTypeError):
        bench.server_lrs(text)
