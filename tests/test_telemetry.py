"""Device telemetry (``fl_edge.telemetry``): tegrastats lines recorded on real Jetsons
(tests/data/tegrastats, sources in its README) parsed by hand-checked values, the energy
integral, a tegrastats process replaying a recorded line through the edge's gauges, and
absent hardware reported as absent (no gauge), never as zero."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from conftest import wait_for
from prometheus_client import CollectorRegistry, generate_latest

from fl_edge.telemetry import DeviceTelemetry, integrate, open_source, parse_tegrastats

LINES = Path(__file__).parent / "data" / "tegrastats"


def line(name: str) -> str:
    return (LINES / name).read_text().strip()


def test_orin_jetpack7_line():
    s = parse_tegrastats(line("orin-agx-jp7.log"))
    assert s.gpu_utilization == pytest.approx(0.12)
    assert (s.memory_used_bytes, s.memory_total_bytes) == (20642 * 2**20, 62817 * 2**20)
    assert s.temperatures == {"cpu": 52.968, "soc2": 48.406, "soc0": 49.531, "gpu": 47.625}
    assert s.rails == {"VDD_GPU_SOC": 5.139, "VDD_CPU_CV": 3.268, "VIN_SYS_5V0": 5.5}
    assert s.power_watts == pytest.approx(5.139 + 3.268 + 5.5)  # no VDD_IN on an AGX Orin
    assert s.throttle is None and s.energy_joules is None


def test_orin_jetpack5_line_with_two_gpcs_and_sensors_off():
    s = parse_tegrastats(line("orin-agx-jp5.log"))
    assert s.gpu_utilization == pytest.approx(0.30)  # GR3D 40 % and GR3D2 20 %
    assert "gpu" not in s.temperatures and "cv0" not in s.temperatures  # -256C: off
    assert s.temperatures["tj"] == 41.656 and s.temperatures["tboard"] == 29.0
    assert s.rails == {"VDD_GPU_SOC": 2.39, "VDD_CPU_CV": 0.796, "VIN_SYS_5V0": 3.522,
                       "VDDQ_VDD2_1V8AO": 0.301}  # the NC rails are not connected
    assert s.memory_total_bytes == 30536 * 2**20


def test_xavier_line_with_rails_without_units():
    s = parse_tegrastats(line("xavier-agx.log"))
    assert s.gpu_utilization == pytest.approx(0.63)
    assert s.rails == {"GPU": 1.155, "CPU": 0.385, "SOC": 2.502, "CV": 0.0, "VDDRQ": 0.192,
                       "SYS5V": 2.692}
    assert s.temperatures["iwlwifi"] == 30.0 and s.temperatures["pmic"] == 100.0
    assert s.memory_used_bytes == 408 * 2**20


def test_energy_is_the_integral_of_power():
    assert integrate([(0.0, 10.0), (1.0, 10.0), (3.0, 20.0)]) == pytest.approx(10 + 30)
    assert integrate([(5.0, 7.0)]) == 0.0


def fake_tegrastats(folder: Path, recorded: str) -> Path:
    """An executable named tegrastats printing a recorded line every --interval ms, as the
    real one does (this machine has no Jetson)."""
    path = folder / "tegrastats"
    seconds = '$(awk "BEGIN{print $2/1000}")'  # tegrastats --interval MS
    path.write_text(f"#!/bin/sh\nwhile true; do cat '{LINES / recorded}'; sleep {seconds}; done\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_tegrastats_feeds_the_gauges_and_the_tasks_energy(tmp_path):
    registry = CollectorRegistry()
    telemetry = DeviceTelemetry(registry, torch.device("cpu"), interval=0.05,
                                tegrastats=str(fake_tegrastats(tmp_path, "orin-agx-jp7.log")))
    try:
        assert telemetry.present
        wait_for(lambda: telemetry.source.ready.is_set(), 30, "a tegrastats line")
        telemetry.begin_task()
        wait_for(lambda: len(telemetry.points or []) >= 5, 30, "five power samples")
        points = list(telemetry.points)
        figures = telemetry.end_task()
        watts = 5.139 + 3.268 + 5.5
        assert figures["device_power_watts"] == pytest.approx(watts)
        assert figures["gpu_utilization"] == pytest.approx(0.12)
        assert figures["energy_joules"] >= watts * (points[-1][0] - points[0][0]) > 0
        text = generate_latest(registry).decode()
        assert 'fedattn_edge_device_telemetry{source="tegrastats"} 1.0' in text
        assert 'fedattn_edge_device_power_watts{rail="total"} 13.907' in text
        assert 'fedattn_edge_device_temperature_celsius{sensor="gpu"} 47.625' in text
        assert "fedattn_edge_gpu_utilization_ratio 0.12" in text
        assert "fedattn_edge_gpu_throttled{" not in text
    finally:
        telemetry.close()
    assert telemetry.source.proc.poll() is not None


def test_absent_hardware_is_absent_not_zero(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no tegrastats here
    registry = CollectorRegistry()
    telemetry = DeviceTelemetry(registry, torch.device("cpu"))
    assert not telemetry.present
    telemetry.begin_task()
    assert telemetry.end_task() == {}
    text = generate_latest(registry).decode()
    assert 'fedattn_edge_device_telemetry{source="absent"} 1.0' in text
    for name in ("gpu_utilization", "device_power_watts", "device_memory", "temperature",
                 "energy"):
        assert f"fedattn_edge_{name}" not in text.replace("fedattn_edge_device_telemetry", "")
    # A CUDA device without nvidia-ml-py or a driver (as here) is absent too.
    assert open_source(torch.device("cuda"), 1.0) is None
    assert os.environ["PATH"] == str(tmp_path)


def found(record, key: str) -> list[float]:
    """Every value of ``key`` anywhere in a history record."""
    if isinstance(record, dict):
        return [v for k, v in record.items() if k == key] + [
            x for v in record.values() for x in found(v, key)]
    if isinstance(record, list):
        return [x for v in record for x in found(v, key)]
    return []


def test_a_real_edge_on_a_jetson_reports_energy_into_the_servers_history(cluster, tmp_path):
    """fl-edge with tegrastats on its PATH (replaying a recorded AGX Orin line) against a
    real fl-server: the training result carries the task's energy, mean power and GPU
    utilisation, and the server keeps them in its history (they are standard metrics)."""
    from conftest import read_history, write_edge_dirs

    tools = tmp_path / "bin"
    tools.mkdir()
    fake_tegrastats(tools, "orin-agx-jp7.log")
    (data,) = write_edge_dirs(tmp_path, 1, per_edge=120)
    server = cluster.server("--method", "fedavg", "--rounds", "1", "--min-edges", "1")
    edge = cluster.edge(data, "orin", "--progress", "off",
                        env={**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"})
    assert edge.wait(300) == 0 and server.wait(120) == 0
    record = read_history(tmp_path / "server-state")["rounds"][0]["train"]
    assert found(record, "device_power_watts") == [pytest.approx(13.907)], record
    assert found(record, "gpu_utilization") == [pytest.approx(0.12)]
    assert found(record, "energy_joules")[0] > 0
    assert "reported metrics" not in server.log()  # declared: not ignored as unknown
