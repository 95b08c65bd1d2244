"""``python -m fl_tools.dashboard``: the dashboard preview drawn from deploy's dashboard
JSON and a real Prometheus that scraped a real federation (``--live``), and its refusals."""

from __future__ import annotations

import json

import pytest
from PIL import Image
from test_monitoring import DASHBOARD, prometheus_tools  # noqa: F401 - a fixture

from fl_tools.dashboard import legend, load_dashboard, main


def test_legend_formats_like_grafana():
    assert legend("{{edge}} {{ direction }}", {"edge": "e0", "direction": "up"}) == "e0 up"
    assert legend("{{missing}}x", {}) == "x"
    assert legend("", {"kind": "meta", "edge": "e1"}) == '{edge="e1", kind="meta"}'


def test_refusals_name_what_is_wrong(tmp_path, capsys):
    assert main(["--prometheus", "http://127.0.0.1:1", "--out", str(tmp_path / "x.png")]) == 2
    assert "Prometheus at http://127.0.0.1:1/api/v1" in capsys.readouterr().err
    assert main(["--prometheus", "http://127.0.0.1:1", "--set", "nope=1"]) == 2
    assert "no dashboard variable 'nope'" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    assert main(["--prometheus", "http://127.0.0.1:1", "--dashboard", str(broken)]) == 2
    assert f"{broken}: not a readable Grafana dashboard" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_live_preview_draws_every_panel_of_a_real_federation(tmp_path, capsys,
                                                             prometheus_tools):  # noqa: F811
    """A short real federation scraped by Prometheus: every panel outside the Privacy row
    (which needs --dp and --secagg) and the device row (which needs a GPU or a Jetson: on
    these CPU edges only its source panel, saying "absent", has a series) draws series, and
    the picture has the dashboard's layout (24 columns wide, a row heading per row)."""
    out = tmp_path / "preview.png"
    assert main(["--live", "--seconds", "25", "--out", str(out), "--edges", "2"]) == 0
    printed = capsys.readouterr().out
    board = load_dashboard(DASHBOARD, {})
    empty = [p.title for p in board.panels if p.row == "Privacy" or (
        p.row == "Device (GPU / Jetson)" and p.title != "Telemetry source per edge")]
    assert f"{len(board.panels)} panels, {len(board.panels) - len(empty)} with data" in printed
    assert f"(no data: {', '.join(empty)})" in printed
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size[0] > 1500 and image.size[1] > 2000
    assert {p.row for p in board.panels} == {t for t, _ in board.rows}
    assert json.loads(DASHBOARD.read_text())["title"] == board.title
