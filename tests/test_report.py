"""fl-report: figures from hand-computed confusion matrices, seed grouping, a synthetic run
set written like the server writes history.json (with and without --eval-detail's
per-class counts, and as protocol 3 wrote it), and bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fl_server.evaluation import split_figures, summarize
from fl_tools.report import accuracy as acc
from fl_tools.report import (
    config_id,
    group_runs,
    macro_f1,
    main,
    mean_accuracy,
    mean_std,
    plot_similarity,
    pooled,
    pooled_mean,
    round_figures,
    std_accuracy,
    weighted_f1,
)

REPO = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# rows = true class, columns = predicted class
THREE = [[5, 1, 0],
         [2, 3, 1],
         [0, 2, 6]]
# class 0: TP 5, support 6, predicted 7 -> P 5/7, R 5/6, F1 = 2*(5/7)(5/6)/(5/7+5/6) = 10/13
# class 1: TP 3, support 6, predicted 6 -> P 1/2, R 1/2, F1 = 1/2
# class 2: TP 6, support 8, predicted 7 -> P 6/7, R 3/4, F1 = 2*(6/7)(3/4)/(6/7+3/4) = 12/15 = 4/5
# accuracy 14/20; macro F1 = (10/13 + 1/2 + 4/5)/3 = 0.689744
# weighted F1 = (6*10/13 + 6*1/2 + 8*4/5)/20 = 0.700769


def detailed(matrix, loss_sum: float, brier_sum: float) -> dict:
    """An edge's split figures as an --eval-detail server records them: the sums and the
    confusion they come from."""
    m = np.array(matrix, dtype=np.int64)
    return split_figures(int(np.trace(m)), int(m.sum()), loss_sum, brier_sum, m)


def sums_only(matrix, loss_sum: float, brier_sum: float) -> dict:
    """The same edge as a default server records it: no per-class counts."""
    m = np.array(matrix, dtype=np.int64)
    return split_figures(int(np.trace(m)), int(m.sum()), loss_sum, brier_sum)


def test_f1_of_a_three_class_matrix():
    assert acc(THREE) == pytest.approx(14 / 20)
    assert macro_f1(THREE) == pytest.approx((10 / 13 + 1 / 2 + 4 / 5) / 3)
    assert macro_f1(THREE) == pytest.approx(0.689744, abs=1e-6)
    assert weighted_f1(THREE) == pytest.approx((6 * 10 / 13 + 6 * 0.5 + 8 * 0.8) / 20)
    assert weighted_f1(THREE) == pytest.approx(0.700769, abs=1e-6)


def test_macro_f1_leaves_out_classes_without_support_or_predictions():
    m = [[2, 0, 1, 0],
         [1, 1, 0, 0],
         [0, 0, 0, 0],
         [0, 0, 0, 0]]
    # class 0: TP 2, support 3, predicted 3 -> F1 2/3
    # class 1: TP 1, support 2, predicted 1 -> P 1, R 1/2, F1 2/3
    # class 2: predicted once, never true -> F1 0, counted
    # class 3: neither -> left out (counting it would give 4/3 / 4 = 1/3)
    assert macro_f1(m) == pytest.approx((2 / 3 + 2 / 3 + 0) / 3)
    # weighted: (3 * 2/3 + 2 * 2/3 + 0 * 0) / 5
    assert weighted_f1(m) == pytest.approx(2 / 3)
    perfect = [[4, 0], [0, 0]]
    assert macro_f1(perfect) == 1.0 and weighted_f1(perfect) == 1.0
    assert math.isnan(macro_f1([[0, 0], [0, 0]])) and math.isnan(weighted_f1([[0, 0], [0, 0]]))
    with pytest.raises(ValueError):
        macro_f1([[1, -1], [0, 1]])
    with pytest.raises(ValueError):
        macro_f1([[1, 2, 3]])


def test_pooled_versus_mean_accuracy_and_brier():
    a = [[3, 1], [0, 0]]   # 4 samples, accuracy 3/4, brier_sum 2.0 -> brier 0.5
    b = [[0, 2], [2, 6]]   # 10 samples, accuracy 6/10, brier_sum 2.0 -> brier 0.2
    empty = [[0, 0], [0, 0]]
    assert pooled([a, b]).tolist() == [[3, 3], [2, 6]]
    assert mean_accuracy([a, b, empty]) == pytest.approx((0.75 + 0.6) / 2)  # 0.675
    assert std_accuracy([a, b]) == pytest.approx(0.075)  # population std of (0.75, 0.6)
    assert acc(pooled([a, b])) == pytest.approx(9 / 14)  # 0.642857
    assert pooled_mean([0.5, 0.2], [4, 10]) == pytest.approx(4 / 14)  # not (0.5 + 0.2) / 2
    with pytest.raises(ValueError):
        pooled([a, THREE])


def test_round_figures_ignore_precomputed_accuracy_and_match_the_server_summary():
    per_edge = {
        "e0": {"test": detailed([[3, 1], [0, 0]], loss_sum=2.0, brier_sum=2.0)},
        "e1": {"test": sums_only([[0, 2], [2, 6]], loss_sum=8.0, brier_sum=2.0)},
        "e2": {"test": detailed(np.zeros((2, 2)), 0.0, 0.0)},  # no samples
    }
    server = summarize(per_edge)["test"]
    for figures in per_edge.values():
        figures["test"]["accuracy"] = -1.0  # never read
    mine = round_figures(per_edge, "test")
    assert mine["edges"] == server["edges"] == 2
    assert mine["mean_accuracy"] == pytest.approx(server["mean_accuracy"])
    assert mine["pooled_accuracy"] == pytest.approx(server["pooled_accuracy"])
    assert mine["std_accuracy"] == pytest.approx(server["std_accuracy"])
    assert mine["brier"] == pytest.approx(4 / 14) and mine["loss"] == pytest.approx(10 / 14)
    assert mine["n"] == 14
    assert math.isnan(mine["macro_f1"])  # e1 sent no per-class counts
    assert round_figures(per_edge, "global_test") is None


def test_mean_std_over_seeds_is_population_std():
    stats = mean_std([0.8, 0.6, 0.7])
    # mean 0.7; deviations 0.1, -0.1, 0 -> variance 0.02/3
    assert stats["mean"] == pytest.approx(0.7)
    assert stats["std"] == pytest.approx(math.sqrt(0.02 / 3))
    assert stats["n"] == 3
    assert mean_std([0.5]) == {"mean": 0.5, "std": 0.0, "n": 1}


def test_grouping_ignores_seed_and_run_locations():
    def run(label, seed, lr, final):
        config = {"method": "fedavg", "train": {"lr": lr}, "params": {}, "server": {"rounds": 2}}
        figures = dict.fromkeys(("mean_accuracy", "pooled_accuracy", "macro_f1", "weighted_f1",
                                 "brier"), final)
        return {"label": label, "method": "fedavg", "seed": seed, "config": config,
                "config_id": config_id(config), "final": figures, "best": figures}

    groups = group_runs([run("a", 0, 0.1, 0.8), run("b", 1, 0.1, 0.6),
                         run("c", 0, 0.5, 0.3), run("d", 2, 0.1, 0.7)])
    assert [g["runs"] for g in groups] == [["a", "b", "d"], ["c"]]
    assert groups[0]["label"] == "fedavg [train.lr=0.1]" and groups[1]["label"] == "fedavg [train.lr=0.5]"
    assert groups[0]["final_mean_accuracy"]["mean"] == pytest.approx(0.7)
    assert groups[0]["final_mean_accuracy"]["std"] == pytest.approx(math.sqrt(0.02 / 3))
    assert groups[1]["final_mean_accuracy"] == {"mean": 0.3, "std": 0.0, "n": 1}


# ---- a synthetic run set written the way the server writes history.json ---------------------

def manifest(seed: int, checkpoint_dir: str, port: int, method: str = "fedavg", lr: float = 0.01) -> dict:
    return {
        "aggregator": "streaming_weighted_sum", "fedattn": "0.1.0", "git_sha": "unknown",
        "grpcio": "1.85.1", "method": method, "params": {}, "platform": "Linux",
        "protocol_version": 1, "python": "3.11.7", "seeds": {"train": seed},
        "server": {"checkpoint_dir": checkpoint_dir, "chunk_bytes": 1048576, "eval_every": 1,
                   "fraction": 1.0, "host": "0.0.0.0", "insecure": True, "join_token": "",
                   "keep_checkpoints": 2, "max_concurrent_uploads": 4, "method": method,
                   "metrics_port": -1 if port % 2 else 9100, "min_edges": 2, "poll_timeout": 20.0,
                   "port": port, "quorum": 0, "resume": bool(port % 2), "round_timeout": 600.0,
                   "rounds": 2},
        "torch": "2.14.1", "train": {
            "batch_size": 32, "class_names": [], "image_size": 28, "in_channels": 1,
            "local_epochs": 1, "lr": lr, "model": "lenet-bn", "momentum": 0.0, "num_classes": 2,
            "optimizer": "sgd", "private": [], "seed": seed, "test_fraction": 0.2,
            "weight_decay": 0.0},
    }


def phase(selected: list[str], received: list[str], dropped: dict[str, str] | None = None) -> dict:
    return {"dropped": dropped or {}, "edge_metrics": {e: {"train_loss": 1.0} for e in received},
            "num_examples": dict.fromkeys(received, 40), "quorum": len(selected), "received": received,
            "seconds": 0.5, "selected": selected}


def round_record(number: int, confusions: dict[str, list], brier_sums: dict[str, float],
                 train: dict, detail: bool = True) -> dict:
    figures = detailed if detail else sums_only
    per_edge = {e: {"test": figures(c, loss_sum=float(np.sum(c)), brier_sum=brier_sums[e])}
                for e, c in confusions.items()}
    summary = summarize(per_edge)
    for figures in per_edge.values():  # the report must not read the server's own accuracies
        figures["test"]["accuracy"] = 0.0
    summary["test"]["mean_accuracy"] = summary["test"]["pooled_accuracy"] = 0.0
    return {
        "aggregate": {"aggregated": len(train["received"]), "total_weight": 80.0},
        "bytes": {"down": {"meta": {"messages": 12, "raw": 0, "wire": 4834},
                           "shared_tensors": {"messages": 2, "raw": 362640, "wire": 362658 * (3 - number)}},
                  "up": {"meta": {"messages": 13, "raw": 0, "wire": 3261},
                         "shared_tensors": {"messages": 2, "raw": 362640, "wire": 362658}}},
        "evaluate": phase(sorted(confusions), sorted(confusions)),
        "evaluation": {"per_edge": per_edge, "summary": summary},
        "round": number, "seconds": 1.0, "train": train,
    }


BRIER = {"e0": 2.0, "e1": 1.0}  # e0: 4 samples -> 0.5, e1: 8 samples -> 0.125; pooled 3/12
# seed 0
#  r1: e0 [[2,2],[0,0]] acc 1/2; e1 [[3,1],[1,3]] acc 3/4 -> mean 0.625, pooled [[5,3],[1,3]] 8/12
#  r2: e0 [[4,0],[0,0]] acc 1;   e1 [[3,1],[2,2]] acc 5/8 -> mean 0.8125, pooled [[7,1],[2,2]] 9/12
#      macro F1 of [[7,1],[2,2]]: class 0 2*7/(8+9) = 14/17, class 1 2*2/(4+3) = 4/7 -> 83/119
#  best round 2 = final round
# seed 1
#  r1: e0 [[2,0],[0,2]] acc 1;   e1 [[4,0],[2,2]] acc 3/4 -> mean 0.875, pooled [[6,0],[2,4]] 10/12
#      macro F1: class 0 2*6/(6+8) = 6/7, class 1 2*4/(6+4) = 4/5 -> 29/35
#  r2: e0 [[1,1],[1,1]] acc 1/2; e1 [[4,0],[0,4]] acc 1   -> mean 0.75, pooled [[5,1],[1,5]] 10/12
#      macro F1: both classes 2*5/(6+6) = 5/6
#  best round 1, final round 2; train phase of round 2 lost e2 (deadline)
SEED_ROUNDS = {
    0: [{"e0": [[2, 2], [0, 0]], "e1": [[3, 1], [1, 3]]}, {"e0": [[4, 0], [0, 0]], "e1": [[3, 1], [2, 2]]}],
    1: [{"e0": [[2, 0], [0, 2]], "e1": [[4, 0], [2, 2]]}, {"e0": [[1, 1], [1, 1]], "e1": [[4, 0], [0, 4]]}],
}


def write_run(root: Path, name: str, seed: int, port: int, rounds: list[dict],
              detail: bool = True, **kwargs) -> Path:
    run_dir = root / name
    run_dir.mkdir(parents=True)
    records = []
    for number, confusions in enumerate(rounds, start=1):
        if seed == 1 and number == 2:
            train = phase(["e0", "e1", "e2"], ["e0", "e1"], {"e2": "deadline"})
        else:
            train = phase(["e0", "e1"], ["e0", "e1"])
        records.append(round_record(number, confusions, BRIER, train, detail))
    history = {"manifest": manifest(seed, str(run_dir), port, **kwargs), "rounds": records}
    (run_dir / "history.json").write_text(json.dumps(history, indent=1, sort_keys=True))
    return run_dir


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_report_on_two_seeds_by_two_rounds(tmp_path, capsys):
    run0 = write_run(tmp_path, "fedavg-s0", 0, 40001, SEED_ROUNDS[0])
    run1 = write_run(tmp_path, "fedavg-s1", 1, 40002, SEED_ROUNDS[1])
    other = write_run(tmp_path, "fedavg-lr", 0, 40003, SEED_ROUNDS[1], lr=0.1)
    out = tmp_path / "out"
    assert main([str(run0), str(run1 / "history.json"), str(other), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out

    for name in ("accuracy.png",
                 "bytes_fedavg-seed-0-fedavg-s0.png", "participation_fedavg-seed-0-fedavg-s0.png",
                 "bytes_fedavg-seed-1.png", "participation_fedavg-seed-1.png",
                 "bytes_fedavg-seed-0-fedavg-lr.png", "participation_fedavg-seed-0-fedavg-lr.png"):
        assert_png(out / name)
    assert (out / "summary.md").read_text() == stdout
    assert "| fedavg seed 1 | fedavg | 1 | 2 | 1 | 0.8750 |" in stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["split"] == "test"
    s0, s1, s_lr = summary["runs"]
    # two runs would be "fedavg seed 0": both get their directory's name
    assert (s0["label"], s1["label"]) == ("fedavg seed 0 (fedavg-s0)", "fedavg seed 1")
    assert s_lr["label"] == "fedavg seed 0 (fedavg-lr)"

    assert [r["mean_accuracy"] for r in s0["rounds"]] == pytest.approx([0.625, 0.8125])
    assert [r["pooled_accuracy"] for r in s0["rounds"]] == pytest.approx([8 / 12, 9 / 12])
    assert (s0["best_round"], s0["final_round"]) == (2, 2)
    assert s0["final"]["macro_f1"] == pytest.approx(83 / 119)
    assert s0["final"]["brier"] == pytest.approx(3 / 12)
    assert s0["final"]["std_accuracy"] == pytest.approx(0.1875)  # |1 - 0.625| / 2

    assert (s1["best_round"], s1["final_round"]) == (1, 2)
    assert s1["best"]["mean_accuracy"] == pytest.approx(0.875)
    assert s1["best"]["macro_f1"] == pytest.approx(29 / 35)
    assert s1["final"]["mean_accuracy"] == pytest.approx(0.75)
    assert s1["final"]["macro_f1"] == pytest.approx(5 / 6)
    assert s1["participation"][1] == {"round": 2, "selected": 3, "received": 2, "dropped": 1}
    assert s1["wire_bytes_total"] == {"up": 2 * (3261 + 362658), "down": 2 * 4834 + 3 * 362658}

    fedavg, lr = summary["groups"]
    assert fedavg["runs"] == ["fedavg seed 0 (fedavg-s0)", "fedavg seed 1"] and fedavg["seeds"] == [0, 1]
    assert lr["runs"] == ["fedavg seed 0 (fedavg-lr)"]
    assert fedavg["label"] == "fedavg [train.lr=0.01]" and lr["label"] == "fedavg [train.lr=0.1]"

    def check(stats, a, b):  # mean and population std of two seeds
        assert stats["n"] == 2
        assert stats["mean"] == pytest.approx((a + b) / 2)
        assert stats["std"] == pytest.approx(abs(a - b) / 2)

    check(fedavg["final_mean_accuracy"], 0.8125, 0.75)      # 0.78125 ± 0.03125
    check(fedavg["best_mean_accuracy"], 0.8125, 0.875)      # 0.84375 ± 0.03125
    check(fedavg["final_pooled_accuracy"], 9 / 12, 10 / 12)  # 0.791667 ± 0.041667
    check(fedavg["best_pooled_accuracy"], 9 / 12, 10 / 12)
    check(fedavg["final_macro_f1"], 83 / 119, 5 / 6)        # 0.765406 ± 0.067927
    check(fedavg["best_macro_f1"], 83 / 119, 29 / 35)
    check(fedavg["final_brier"], 0.25, 0.25)
    assert "0.7812 ± 0.0312" in stdout or "0.7813 ± 0.0313" in stdout


def test_without_eval_detail_the_same_accuracies_and_no_f1(tmp_path, capsys):
    """A default server records sums only: every accuracy and Brier figure is the one the
    per-class counts give, and the per-class figures are n/a (null in summary.json)."""
    with_detail = write_run(tmp_path, "detail", 0, 40001, SEED_ROUNDS[0])
    plain = write_run(tmp_path, "plain", 0, 40002, SEED_ROUNDS[0], detail=False)
    assert "confusion" not in (plain / "history.json").read_text()
    assert main([str(with_detail), "--out", str(tmp_path / "a")]) == 0
    assert main([str(plain), "--out", str(tmp_path / "b")]) == 0
    stdout = capsys.readouterr().out
    a, b = (json.loads((tmp_path / d / "summary.json").read_text())["runs"][0] for d in "ab")
    for key in ("mean_accuracy", "std_accuracy", "pooled_accuracy", "brier", "loss", "n"):
        assert [r[key] for r in b["rounds"]] == pytest.approx([r[key] for r in a["rounds"]]), key
    assert a["final"]["macro_f1"] == pytest.approx(83 / 119)
    assert b["final"]["macro_f1"] is None and b["final"]["weighted_f1"] is None
    assert b["edge_accuracy"] == a["edge_accuracy"]
    assert "| 0.7500 | n/a | n/a | 0.2500 |" in stdout  # final pooled acc, F1s, Brier


def test_a_protocol_3_history_is_still_read(tmp_path):
    """Histories from before protocol 4 hold each edge's confusion and no correct count."""
    run_dir = write_run(tmp_path, "old", 0, 40001, SEED_ROUNDS[0])
    history = json.loads((run_dir / "history.json").read_text())
    for record in history["rounds"]:
        for figures in record["evaluation"]["per_edge"].values():
            del figures["test"]["correct"]
    (run_dir / "history.json").write_text(json.dumps(history))
    assert main([str(run_dir), "--out", str(tmp_path / "out")]) == 0
    run = json.loads((tmp_path / "out" / "summary.json").read_text())["runs"][0]
    assert [r["pooled_accuracy"] for r in run["rounds"]] == pytest.approx([8 / 12, 9 / 12])
    assert run["final"]["macro_f1"] == pytest.approx(83 / 119)


def test_module_entry_point(tmp_path):
    run0 = write_run(tmp_path, "run", 0, 40001, SEED_ROUNDS[0])
    done = subprocess.run([sys.executable, "-m", "fl_tools.report", str(run0), "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# fl-report (test split)")
    assert (tmp_path / "out" / "summary.json").is_file()


def test_bad_input_exits_2_naming_the_path(tmp_path, capsys):
    def refused(args: list[str], named: Path) -> str:
        assert main([*args, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert str(named) in err, err
        return err

    refused([str(tmp_path / "missing")], tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no history.json" in refused([str(empty)], empty)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "history.json").write_text("{not json")
    refused([str(broken)], broken / "history.json")
    (broken / "history.json").write_text("[1, 2]")
    refused([str(broken)], broken / "history.json")

    good = write_run(tmp_path, "good", 0, 40001, SEED_ROUNDS[0])
    unevaluated = tmp_path / "unevaluated"
    unevaluated.mkdir()
    history = json.loads((good / "history.json").read_text())
    for record in history["rounds"]:
        del record["evaluation"], record["evaluate"]
    (unevaluated / "history.json").write_text(json.dumps(history))
    assert "no evaluated rounds" in refused([str(good), str(unevaluated)], unevaluated / "history.json")
    # the good run has no global_test split
    refused([str(good), "--split", "global_test"], good / "history.json")

    malformed = tmp_path / "malformed"
    malformed.mkdir()
    history = json.loads((good / "history.json").read_text())
    history["rounds"][1]["evaluation"]["per_edge"]["e0"]["test"]["confusion"] = [[1, 2, 3]]
    (malformed / "history.json").write_text(json.dumps(history))
    assert "round 2" in refused([str(malformed)], malformed / "history.json")
    history = json.loads((good / "history.json").read_text())
    history["rounds"][0]["evaluation"]["per_edge"]["e1"]["test"]["correct"] = 9  # of 8
    (malformed / "history.json").write_text(json.dumps(history))
    assert "round 1" in refused([str(malformed)], malformed / "history.json")
    history["rounds"][0]["evaluation"]["per_edge"]["e1"]["test"]["correct"] = 5  # trace 6
    (malformed / "history.json").write_text(json.dumps(history))
    assert "disagrees" in refused([str(malformed)], malformed / "history.json")
    assert not (tmp_path / "out" / "summary.json").exists()


def test_upload_similarity_is_reported_and_plotted(tmp_path):
    run_dir = write_run(tmp_path, "fedsap", 0, 40001, SEED_ROUNDS[0])
    history = json.loads((run_dir / "history.json").read_text())
    for record, (conv, se) in zip(history["rounds"], ((0.99, 0.9), (0.98, 0.7)), strict=True):
        record["aggregate"]["cosine_similarity"] = {"conv": conv, "se-e": se}
    (run_dir / "history.json").write_text(json.dumps(history))
    out = tmp_path / "out"
    assert main([str(run_dir), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    run = summary["runs"][0]
    assert run["similarity"] == [{"round": 1, "conv": 0.99, "se-e": 0.9},
                                 {"round": 2, "conv": 0.98, "se-e": 0.7}]
    assert_png(out / run["figures"]["similarity"])
    plain = write_run(tmp_path, "fedavg", 0, 40002, SEED_ROUNDS[0])
    assert main([str(plain), "--out", str(tmp_path / "plain")]) == 0
    assert "similarity" not in json.loads((tmp_path / "plain" / "summary.json").read_text())[
        "runs"][0]["figures"]


def test_the_similarity_axis_is_the_cosine_scale_not_the_data_range(tmp_path):
    """Uploads at 0.9911-0.9918 are alike: an autoscaled axis spanning just that range drew
    their noise as a trend. The axis spans 0 (or the lowest value, if below) to 1."""
    run = {"label": "fedsap", "similarity": [
        {"round": r, "conv": c} for r, c in ((1, 0.9911), (2, 0.9918), (3, 0.9914))]}
    low, high = plot_similarity(run, tmp_path / "s.png").axes[0].get_ylim()
    assert low <= 0.0 and 1.0 <= high < 1.1
    run["similarity"].append({"round": 4, "conv": -0.5})
    low, _ = plot_similarity(run, tmp_path / "t.png").axes[0].get_ylim()
    assert low <= -0.5


def test_accuracy_per_edge_and_round_is_reported_and_plotted(tmp_path, capsys):
    """The heat map's figures are each edge's own accuracy (recomputed from its counts), in
    the edges' natural order; with 20 edges the picture grows to keep a row per edge."""
    run0 = write_run(tmp_path, "fedavg-s0", 0, 40001, SEED_ROUNDS[0])
    many = [{f"edge_{i}": [[i % 3 + 1, 1], [0, 2]] for i in range(20)}]
    brier = {f"edge_{i}": 1.0 for i in range(20)}
    run_dir = tmp_path / "many"
    run_dir.mkdir()
    history = {"manifest": manifest(0, str(run_dir), 40004),
               "rounds": [round_record(1, many[0], brier, phase(sorted(many[0]), sorted(many[0])))]}
    (run_dir / "history.json").write_text(json.dumps(history))
    out = tmp_path / "out"
    assert main([str(run0), str(run_dir), "--out", str(out)]) == 0
    # 1 + (bytes, participation, edges) x 2 + bytes_vs_accuracy (two runs)
    assert "and 8 PNG file(s)" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    first, second = summary["runs"]
    assert first["edge_accuracy"] == [{"round": 1, "edges": {"e0": 0.5, "e1": 0.75}},
                                      {"round": 2, "edges": {"e0": 1.0, "e1": 0.625}}]
    order = list(second["edge_accuracy"][0]["edges"])
    assert order[:3] == ["edge_0", "edge_1", "edge_2"] and order.index("edge_10") == 10
    assert second["edge_accuracy"][0]["edges"]["edge_2"] == pytest.approx(5 / 6)  # [[3,1],[0,2]]
    small, large = (Image.open(out / run["figures"]["edges"]) for run in (first, second))
    assert_png(out / first["figures"]["edges"])
    assert large.size[1] > small.size[1]


# ---- bytes vs accuracy across real runs ---------------------------------------------------

@pytest.fixture(scope="module")
def codec_runs(tmp_path_factory) -> list[Path]:
    """Two short real federations (fl-demo: a real fl-server and two fl-edge processes over
    gRPC), one with ``--compress up=fp16`` and one without: their history.json files as the
    server wrote them."""
    from fl_tools.demo import main as demo

    root = tmp_path_factory.mktemp("codec-runs")
    runs = {"raw": [], "fp16": ["--compress", "up=fp16"]}

    def run(name: str) -> int:  # both at once: each is mostly processes starting
        return demo(["--method", "fedavg", "--edges", "2", "--rounds", "2", "--local-epochs",
                     "1", "--limit", "200", "--no-report", "--out", str(root / name),
                     *runs[name]])

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(run, runs)) == [0, 0]
    return [root / name / "server" for name in runs]


def test_bytes_vs_accuracy_across_real_runs(codec_runs, tmp_path, capsys):
    """One point per run, labelled by its --compress spec: bytes per round recomputed here
    from each history, accuracy the report's own final and best; the PNG count printed is
    the count written."""
    out = tmp_path / "out"
    assert main([*map(str, codec_runs), "--out", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert_png(out / "bytes_vs_accuracy.png")
    summary = json.loads((out / "summary.json").read_text())
    assert "bytes_vs_accuracy.png" in summary["figures"]
    assert sorted(p.name for p in out.glob("*.png")) == sorted(summary["figures"])
    assert f"and {len(summary['figures'])} PNG file(s)" in stderr
    for run, path in zip(summary["runs"], codec_runs, strict=True):
        history = json.loads((path / "history.json").read_text())
        assert run["compress"] == (history["manifest"]["server"]["compress"] or "none")
        for direction in ("up", "down"):
            per_round = [sum(kind["wire"] for kind in record["bytes"][direction].values())
                         for record in history["rounds"]]
            assert run["wire_bytes_per_round"][direction] == pytest.approx(
                sum(per_round) / len(per_round))
            assert run["wire_bytes_per_round"][direction] > 100e3  # two se-cnn models a round
    assert [run["compress"] for run in summary["runs"]] == ["none", "up=fp16"]
    assert "## Bytes vs accuracy" in stdout
    rows = [line for line in stdout.splitlines() if line.startswith("| fedavg seed 0")
            and ("| none |" in line or "| up=fp16 |" in line)]
    assert len(rows) == 2, stdout


def test_bytes_vs_accuracy_needs_two_runs(codec_runs, tmp_path):
    """One run has nothing to compare: no such plot, and a history written before the
    compress setting existed reads as "none"."""
    history = json.loads((codec_runs[1] / "history.json").read_text())
    del history["manifest"]["server"]["compress"]
    old = tmp_path / "old"
    old.mkdir()
    (old / "history.json").write_text(json.dumps(history))
    assert main([str(old), "--out", str(tmp_path / "out")]) == 0
    assert not (tmp_path / "out" / "bytes_vs_accuracy.png").exists()
    (run,) = json.loads((tmp_path / "out" / "summary.json").read_text())["runs"]
    assert run["compress"] == "none"
