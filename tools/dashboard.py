"""``python -m fl_tools.dashboard``: a picture of deploy's Grafana dashboard, rendered from
the dashboard's own queries.

Grafana is in neither Debian, PyPI nor npm, so no screenshot can be taken where fedattn is
built. This tool reads ``deploy/grafana/dashboards/fedattn.json``, runs every panel's PromQL
through a real Prometheus' HTTP API and draws each panel where its ``gridPos`` puts it (24
columns; rows as headings) with matplotlib: time series as lines over the time range, the
stat panel as its latest values, bar gauges as bars of the instant values. Titles, legends
(``legendFormat``) and units come from the JSON; colours, thresholds and Grafana's styling
do not, so the picture says it is a preview, not a screenshot.

``--live`` makes the data too: a real fl-server and fl-edges on loopback (the bundled MNIST
subset), scraped every second by Debian's ``prometheus`` with ``deploy/prometheus.yml``'s
jobs and rules, rendered once ``--seconds`` of the run are in Prometheus. That is how
``docs/img/dashboard-preview.png`` is made.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .dashboard_live import REPO, DashboardError, live_prometheus

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "fedattn.json"
GRID_COLUMNS = 24
UNIT_INCHES = 0.36  # one gridPos height unit (Grafana: 30 px + margin)
MAX_LEGEND = 8      # legend entries drawn per panel; the rest are counted


@dataclass
class Panel:
    """One panel of the dashboard: where it goes and what it asks."""

    title: str
    kind: str
    grid: dict
    unit: str
    targets: list[dict]
    row: str = ""


@dataclass
class Dashboard:
    title: str
    rows: list[tuple[str, int]] = field(default_factory=list)  # (title, gridPos y)
    panels: list[Panel] = field(default_factory=list)
    variables: dict[str, str] = field(default_factory=dict)   # name -> current value


def load_dashboard(path: Path, overrides: dict[str, str]) -> Dashboard:
    """The panels and rows of a Grafana dashboard JSON, variables at their current value
    unless overridden (``--set window=20s``)."""
    try:
        data = json.loads(path.read_text())
        board = Dashboard(str(data.get("title", path.stem)))
        for variable in (data.get("templating") or {}).get("list", []):
            board.variables[variable["name"]] = str((variable.get("current") or {}).get("value", ""))
        unknown = set(overrides) - set(board.variables)
        if unknown:
            raise DashboardError(f"{path}: no dashboard variable {sorted(unknown)[0]!r} "
                                 f"(it has {sorted(board.variables)})")
        board.variables.update(overrides)
        row = ""
        for panel in data["panels"]:
            if panel["type"] == "row":
                row = panel["title"]
                board.rows.append((row, panel["gridPos"]["y"]))
                continue
            unit = ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("unit", "")
            board.panels.append(Panel(panel["title"], panel["type"], panel["gridPos"], unit or "",
                                      panel.get("targets", []), row))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DashboardError(f"{path}: not a readable Grafana dashboard ({err})") from None
    return board


class Prometheus:
    """The two queries the panels need, over Prometheus' HTTP API."""

    def __init__(self, url: str):
        self.base = url.rstrip("/") + "/api/v1"

    def _get(self, path: str, **params) -> list[dict]:
        url = f"{self.base}/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as reply:
                body = json.loads(reply.read())
        except urllib.error.HTTPError as err:  # a bad query: 400 with the error
            body = json.loads(err.read() or b"{}")
        except OSError as err:
            raise DashboardError(f"Prometheus at {self.base}: {err}") from None
        if body.get("status") != "success":
            raise ValueError(body.get("error", "query failed"))
        return body["data"]["result"]

    def range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        return self._get("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                         step=f"{step:.3f}")

    def instant(self, expr: str, at: float) -> list[dict]:
        return self._get("query", query=expr, time=f"{at:.3f}")


def legend(template: str, labels: dict) -> str:
    """Grafana's ``{{label}}`` substitution; the series' labels when there is no template."""
    if not template:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: str(labels.get(m.group(1), "")), template)


def _scaled(value: float, unit: str) -> str:
    """A value in the panel's unit, short (axis ticks, stat and bar labels)."""
    if not math.isfinite(value):
        return "n/a"
    if unit == "percentunit":
        return f"{100 * value:.0f}%"
    if unit in ("bytes", "Bps"):
        suffix = "/s" if unit == "Bps" else ""
        for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}{suffix}"
        return f"{value:.3g} B{suffix}"
    if unit == "s":
        return f"{value * 1e3:.3g} ms" if 0 < abs(value) < 1 else f"{value:.3g} s"
    if value == int(value) and abs(value) < 1e9:  # a count: 1000, not 1e+03
        return str(int(value))
    return f"{value:.3g}"


def render(board: Dashboard, prometheus: Prometheus, start: float, end: float,
           out: Path, rows: set[str] | None = None) -> dict[str, int]:
    """Draws the dashboard (or the named rows) into ``out``; returns the number of series
    each panel drew (0: "No data", as Grafana shows it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [p for p in board.panels if rows is None or p.row in rows]
    headings = [(t, y) for t, y in board.rows if rows is None or t in rows]
    if not panels:
        raise DashboardError(f"no panel in rows {sorted(rows or [])}")
    # A row's block runs from its heading to the next heading; rows left out close up.
    ends = [y for _, y in board.rows[1:]] + [max(p.grid["y"] + p.grid["h"] for p in board.panels)]
    shift, offset = {"": 0}, 0
    for (title, y), block_end in zip(board.rows, ends, strict=True):
        if rows is None or title in rows:
            shift[title] = offset - y
            offset += block_end - y
    new_y = {id(p): p.grid["y"] + shift[p.row] for p in panels}
    height_units = max(new_y[id(p)] + p.grid["h"] for p in panels)
    fig = Figure(figsize=(22, UNIT_INCHES * height_units))
    FigureCanvasAgg(fig)
    top = 1.5  # units above the grid for the title

    def box(x: float, y: float, w: float, h: float) -> list[float]:
        total = height_units + top
        return [x / GRID_COLUMNS + 0.028, 1 - (y + top + h) / total,
                w / GRID_COLUMNS - 0.036, h / total]

    when = (f"{datetime.fromtimestamp(start, timezone.utc):%Y-%m-%d %H:%M:%S} - "
            f"{datetime.fromtimestamp(end, timezone.utc):%H:%M:%S} UTC")
    fig.text(0.005, 1 - 0.6 / (height_units + top),
             f"{board.title}: a preview rendered with matplotlib from the dashboard's own "
             f"queries against a real Prometheus (not a Grafana screenshot). {when}, "
             + ", ".join(f"${k}={v}" for k, v in sorted(board.variables.items())),
             fontsize=13, va="center", weight="bold")
    for title, y in headings:
        fig.text(0.005, 1 - (y + shift[title] + top + 0.5) / (height_units + top), title,
                 fontsize=12, weight="bold", va="center", color="#1f4e79")
    step = max(1.0, (end - start) / 240)
    drawn = {}
    for panel in panels:
        g = panel.grid
        ax = fig.add_axes(box(g["x"], new_y[id(panel)] + 0.7, g["w"], g["h"] - 1.6))
        drawn[panel.title] = _draw_panel(ax, panel, board.variables, prometheus, start, end, step)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    return drawn


def _draw_panel(ax, panel: Panel, variables: dict[str, str], prometheus: Prometheus,
                start: float, end: float, step: float) -> int:
    """One panel on its axes; returns the number of series drawn."""
    from matplotlib.ticker import FuncFormatter, ScalarFormatter

    ax.set_title(panel.title, fontsize=9, loc="left")
    ax.tick_params(labelsize=7)
    series: list[tuple[str, list[float], list[float]]] = []
    errors = []
    for target in panel.targets:
        expr = target["expr"]
        for name, value in variables.items():
            expr = expr.replace(f"${name}", value)
        instant = panel.kind != "timeseries" or target.get("instant")
        try:
            result = (prometheus.instant(expr, end) if instant
                      else prometheus.range(expr, start, end, step))
        except ValueError as err:
            errors.append(str(err))
            continue
        for s in result:
            points = [s["value"]] if instant else s["values"]
            series.append((legend(target.get("legendFormat", ""), s["metric"]),
                           [float(t) for t, _ in points], [float(v) for _, v in points]))
    if not series:
        ax.set_xticks([])
        ax.set_yticks([])
        ax.text(0.5, 0.5, "No data" + (f"\n{errors[0][:80]}" if errors else ""),
                ha="center", va="center", fontsize=9, color="grey", transform=ax.transAxes)
        return 0
    # Units the axis cannot say by itself get their own labels; plain numbers keep
    # matplotlib's (which tells 1.0016 from 1.0017 where 3 digits would not).
    fmt = (FuncFormatter(lambda v, _: _scaled(v, panel.unit))
           if panel.unit in ("bytes", "Bps", "percentunit", "s") else ScalarFormatter())
    if panel.kind == "timeseries":
        for label, times, values in series:
            ax.plot([t - end for t in times], values, linewidth=1, label=label)
        ax.set_xlim(start - end, 0)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f}s" if v else "now"))
        ax.yaxis.set_major_formatter(fmt)
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        more = len(labels) - MAX_LEGEND
        ax.legend(handles[:MAX_LEGEND],
                  labels[:MAX_LEGEND - 1] + [f"... and {more + 1} more"] if more > 0
                  else labels, fontsize=6, loc="upper left", ncol=2, framealpha=0.6)
    elif panel.kind == "stat":
        ax.axis("off")
        for i, (label, _, values) in enumerate(series):
            ax.text(0.5, 0.75 - 0.45 * i, _scaled(values[-1], panel.unit), ha="center",
                    va="center", fontsize=22, weight="bold", color="#2e7d32",
                    transform=ax.transAxes)
            ax.text(0.5, 0.55 - 0.45 * i, label, ha="center", va="center", fontsize=8,
                    transform=ax.transAxes)
    else:  # bargauge: the instant values as horizontal bars
        labels = [label for label, _, _ in series]
        values = [v[-1] for _, _, v in series]
        ax.barh(range(len(values)), values, color="#4caf50")
        ax.set_yticks(range(len(values)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.xaxis.set_major_formatter(fmt)
        for i, value in enumerate(values):
            ax.text(value, i, " " + _scaled(value, panel.unit), va="center", fontsize=6)
        ax.grid(True, axis="x", alpha=0.3)
    return len(series)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fl_tools.dashboard",
                                description=__doc__.splitlines()[0].strip("`: "))
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prometheus", metavar="URL",
                        help="a Prometheus that scrapes fl-server and fl-edges "
                             "(jobs as deploy/prometheus.yml), e.g. http://localhost:9090")
    source.add_argument("--live", action="store_true",
                        help="start a short real federation and a Prometheus scraping it "
                             "every second, then render (needs `prometheus` on PATH)")
    p.add_argument("--dashboard", type=Path, default=DASHBOARD, help="Grafana dashboard JSON")
    p.add_argument("--out", type=Path, default=Path("dashboard-preview.png"))
    p.add_argument("--seconds", type=float, default=120.0,
                   help="time range drawn, ending now (with --live: how long the run is "
                        "scraped first)")
    p.add_argument("--set", action="append", default=[], metavar="VARIABLE=VALUE",
                   help="a dashboard variable (default its current value; --live: window=20s)")
    p.add_argument("--rows", nargs="+", metavar="ROW", help="only these rows (default: all)")
    p.add_argument("--edges", type=int, default=3, help="--live: fl-edge processes")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        overrides = dict(s.split("=", 1) for s in args.set)
    except ValueError:
        print("dashboard: error: --set takes VARIABLE=VALUE", file=sys.stderr)
        return 2
    if args.seconds <= 0:
        print("dashboard: error: --seconds must be > 0", file=sys.stderr)
        return 2
    try:
        if args.live:
            overrides.setdefault("window", "20s")
            board = load_dashboard(args.dashboard, overrides)
            with live_prometheus(args.edges, args.seconds) as url:
                drawn = render(board, Prometheus(url), time.time() - args.seconds - 2.5,
                               time.time() - 2.5, args.out, set(args.rows) if args.rows else None)
        else:
            board = load_dashboard(args.dashboard, overrides)
            now = time.time()
            drawn = render(board, Prometheus(args.prometheus), now - args.seconds, now,
                           args.out, set(args.rows) if args.rows else None)
    except DashboardError as err:
        print(f"dashboard: error: {err}", file=sys.stderr)
        return 2
    empty = [title for title, n in drawn.items() if n == 0]
    print(f"wrote {args.out}: {len(drawn)} panels, {len(drawn) - len(empty)} with data"
          + (f" (no data: {', '.join(empty)})" if empty else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
