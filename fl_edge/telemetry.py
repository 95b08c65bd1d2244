"""Device telemetry on the edge: GPU utilisation, memory, temperatures, power, throttling,
and the energy of each training task.

Two sources, whichever the device has: NVML (``nvidia-ml-py``, imported only here and only
when the edge trains on CUDA) on a GPU box; ``tegrastats`` on a Jetson, whose GPU NVML does
not see (its output lines are parsed, ``parse_tegrastats``). A device with neither -- a CPU
box, a GPU box without ``nvidia-ml-py``, a Jetson container without ``tegrastats`` -- has
telemetry *absent*: ``fedattn_edge_device_telemetry{source="absent"}`` is 1 and no other
device gauge exists, so a dashboard shows "no data", never a 0 W GPU at 0 %.

Energy per task: NVML's total-energy counter where the GPU has one (Volta and later: the
difference over the task, exact), otherwise the sampled power integrated over the task
(trapezoids between samples, ``integrate``). On a Jetson the power is the module's input
rails that tegrastats reports (VDD_IN where there is one, else the sum of the named rails),
which covers CPU, GPU and memory: the board's energy for the task, not the GPU's alone.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger("fl_edge.telemetry")

#: tegrastats reports a powered-off sensor as -256 C: absent, not a temperature.
OFF_SENSOR = -255.0
#: Rails that hold the whole module's input on boards that have one.
INPUT_RAILS = ("VDD_IN", "POM_5V_IN")
#: Rails that feed the GPU (alone or with the SoC).
GPU_RAILS = ("VDD_GPU", "VDD_GPU_SOC", "GPU", "POM_5V_GPU", "VDD_SYS_GPU")

_RAIL = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+)(?:mW)?/(\d+)(?:mW)?(?:/\d+(?:mW)?)?(?![\d]*[kMG]B)")
_TEMP = re.compile(r"\b([A-Za-z][\w-]*)@(-?\d+(?:\.\d+)?)C\b")
_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_GR3D = re.compile(r"\b(GR3D2?)_FREQ (\d+)%(?:@\[?(\d+))?")


@dataclass
class DeviceSample:
    """One reading; None where the source does not report the figure."""
    gpu_utilization: float | None = None      # 0..1
    memory_used_bytes: float | None = None    # the GPU's (NVML) or the shared RAM (Jetson)
    memory_total_bytes: float | None = None
    temperatures: dict[str, float] = field(default_factory=dict)  # sensor -> Celsius
    rails: dict[str, float] = field(default_factory=dict)         # rail -> watts now
    power_watts: float | None = None          # what energy integrates (see module doc)
    throttle: dict[str, bool] | None = None   # reason -> active (NVML only)
    energy_joules: float | None = None        # a cumulative counter, where the GPU has one


def parse_tegrastats(line: str) -> DeviceSample:
    """One line of ``tegrastats`` output (L4T 32 to 39: Nano, Xavier, Orin, with or
    without units, dates, per-GPC loads), as a ``DeviceSample``."""
    sample = DeviceSample()
    ram = _RAM.search(line)
    if ram:
        sample.memory_used_bytes = float(ram.group(1)) * 2**20
        sample.memory_total_bytes = float(ram.group(2)) * 2**20
    loads = [float(m.group(2)) for m in _GR3D.finditer(line)]
    if loads:
        sample.gpu_utilization = sum(loads) / len(loads) / 100.0
    for name, value in _TEMP.findall(line):
        if float(value) > OFF_SENSOR:
            sample.temperatures[name.lower()] = float(value)
    for name, now, _average in _RAIL.findall(line):
        if name not in ("NC", "RAM", "SWAP", "IRAM"):
            sample.rails[name] = float(now) / 1000.0
    inputs = [sample.rails[r] for r in INPUT_RAILS if r in sample.rails]
    if inputs:
        sample.power_watts = inputs[0]
    elif sample.rails:
        sample.power_watts = sum(sample.rails.values())
    return sample


def integrate(points: list[tuple[float, float]]) -> float:
    """Joules from (seconds, watts) samples in time order: the trapezoids between them."""
    return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(points, points[1:],
                                                                          strict=False))


def _die_with_parent() -> None:
    """In the child: SIGTERM when the edge dies (prctl PR_SET_PDEATHSIG), so a killed edge
    leaves no tegrastats behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class TegrastatsSource:
    """``tegrastats --interval MS`` as a child process; a thread keeps its last line."""

    name = "tegrastats"

    def __init__(self, command: str, interval: float):
        self.proc = subprocess.Popen([command, "--interval", str(max(int(interval * 1000), 1))],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     preexec_fn=_die_with_parent)
        atexit.register(self.close)
        self.latest: DeviceSample | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._read, name="tegrastats", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.latest = parse_tegrastats(line)
            self.ready.set()

    def sample(self) -> DeviceSample | None:
        """The last line tegrastats printed, parsed (None before its first)."""
        return self.latest

    def close(self) -> None:
        """Stops tegrastats."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


class NvmlSource:
    """NVML on the CUDA device the edge trains on (by UUID: CUDA_VISIBLE_DEVICES renumbers)."""

    name = "nvml"
    REASONS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
               "hw_power_brake": 0x80}

    def __init__(self, device: torch.device):
        import pynvml  # nvidia-ml-py: absent -> ImportError, no driver -> NVMLError

        self.nvml = pynvml
        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            uuid = str(torch.cuda.get_device_properties(index).uuid)
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except Exception:  # older torch without .uuid, or a MIG slice
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def _try(self, call: Callable, *args):
        try:
            return call(self.handle, *args)
        except self.nvml.NVMLError:  # not supported on this GPU: absent, not 0
            return None

    def sample(self) -> DeviceSample:
        """One reading of the GPU; a figure the GPU does not report stays None."""
        nvml = self.nvml
        sample = DeviceSample()
        rates = self._try(nvml.nvmlDeviceGetUtilizationRates)
        if rates is not None:
            sample.gpu_utilization = rates.gpu / 100.0
        memory = self._try(nvml.nvmlDeviceGetMemoryInfo)
        if memory is not None:
            sample.memory_used_bytes, sample.memory_total_bytes = float(memory.used), float(memory.total)
        temperature = self._try(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
        if temperature is not None:
            sample.temperatures["gpu"] = float(temperature)
        power = self._try(nvml.nvmlDeviceGetPowerUsage)
        if power is not None:
            sample.power_watts = power / 1000.0
            sample.rails["gpu"] = sample.power_watts
        reasons = self._try(getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons",
                                    nvml.nvmlDeviceGetCurrentClocksThrottleReasons))
        if reasons is not None:
            sample.throttle = {name: bool(reasons & bit) for name, bit in self.REASONS.items()}
        energy = self._try(nvml.nvmlDeviceGetTotalEnergyConsumption)
        if energy is not None:
            sample.energy_joules = energy / 1000.0
        return sample

    def close(self) -> None:
        """Releases NVML."""
        self.nvml.nvmlShutdown()


def open_source(device: torch.device, interval: float, tegrastats: str | None = None):
    """NVML for a CUDA device when ``nvidia-ml-py`` and a driver are there, else
    ``tegrastats`` when on PATH (a Jetson), else None: telemetry absent."""
    if device.type == "cuda":
        try:
            return NvmlSource(device)
        except Exception as err:  # ImportError, NVMLError (no library, e.g. on a Jetson)
            log.info("NVML unavailable (%s: %s)", type(err).__name__, err)
    command = tegrastats or shutil.which("tegrastats")
    if command:
        try:
            return TegrastatsSource(command, interval)
        except OSError as err:
            log.info("tegrastats unavailable (%s)", err)
    return None


class DeviceTelemetry:
    """The edge's device gauges (on its registry) and each task's energy. A sampling thread
    runs only when a source exists; ``begin_task``/``end_task`` bracket a training task."""

    def __init__(self, registry: CollectorRegistry, device: torch.device, interval: float = 1.0,
                 tegrastats: str | None = None):
        self.interval = interval
        self.source = open_source(device, interval, tegrastats)
        name = self.source.name if self.source else "absent"
        Gauge("fedattn_edge_device_telemetry", "1, labelled with where the device figures come "
              "from (nvml, tegrastats) or absent", ["source"], registry=registry).labels(name).set(1)
        self.points: list[tuple[float, float]] | None = None  # (time, watts) of the task
        self.utilization: list[float] = []
        self.energy_at_start: float | None = None
        self.last: DeviceSample | None = None
        self.stop = threading.Event()
        if self.source is None:
            log.info("device telemetry absent (no NVML on a CUDA device, no tegrastats)")
            return
        g = dict(registry=registry)
        self.util = Gauge("fedattn_edge_gpu_utilization_ratio", "GPU busy fraction", **g)
        self.mem_used = Gauge("fedattn_edge_device_memory_used_bytes", "GPU memory in use (the "
                              "shared RAM on a Jetson)", **g)
        self.mem_total = Gauge("fedattn_edge_device_memory_total_bytes", "GPU memory (the shared "
                               "RAM on a Jetson)", **g)
        self.temp = Gauge("fedattn_edge_device_temperature_celsius", "Temperature by sensor",
                          ["sensor"], **g)
        self.rail = Gauge("fedattn_edge_device_power_watts", "Power by rail (total: what energy "
                          "integrates)", ["rail"], **g)
        self.throttled = Gauge("fedattn_edge_gpu_throttled", "1 while the GPU clocks are held "
                               "down for this reason (NVML)", ["reason"], **g)
        self.task_energy = Gauge("fedattn_edge_task_energy_joules", "Energy of the last "
                                 "training task", **g)
        self.energy_total = Counter("fedattn_edge_energy_joules", "Energy of all training "
                                    "tasks", **g)
        self.thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self.thread.start()

    @property
    def present(self) -> bool:
        """Whether the device reports anything (absent hardware is absent, not 0)."""
        return self.source is not None

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            self.poll()

    def poll(self) -> DeviceSample | None:
        """One reading into the gauges (and into the running task's power points)."""
        sample = self.source.sample() if self.source else None
        if sample is None:
            return None
        self.last = sample
        if sample.gpu_utilization is not None:
            self.util.set(sample.gpu_utilization)
        if sample.memory_used_bytes is not None:
            self.mem_used.set(sample.memory_used_bytes)
            self.mem_total.set(sample.memory_total_bytes)
        for sensor, celsius in sample.temperatures.items():
            self.temp.labels(sensor).set(celsius)
        for rail, watts in sample.rails.items():
            self.rail.labels(rail).set(watts)
        if sample.power_watts is not None:
            self.rail.labels("total").set(sample.power_watts)
        for reason, active in (sample.throttle or {}).items():
            self.throttled.labels(reason).set(int(active))
        points = self.points
        if points is not None:
            if sample.power_watts is not None:
                points.append((time.monotonic(), sample.power_watts))
            if sample.gpu_utilization is not None:
                self.utilization.append(sample.gpu_utilization)
        return sample

    def begin_task(self) -> None:
        """A training task starts: its energy is counted from here."""
        if not self.present:
            return
        self.utilization = []
        self.points = []
        sample = self.poll()
        self.energy_at_start = sample.energy_joules if sample else None

    def end_task(self) -> dict[str, float]:
        """The task's figures for its result (and the server's history): energy (J), mean
        GPU utilisation and power; nothing at all when telemetry is absent."""
        if not self.present or self.points is None:
            return {}
        sample = self.poll()
        points, self.points = self.points, None
        figures: dict[str, float] = {}
        if sample is not None and sample.energy_joules is not None and self.energy_at_start is not None:
            figures["energy_joules"] = sample.energy_joules - self.energy_at_start
        elif len(points) >= 2:
            figures["energy_joules"] = integrate(points)
        if "energy_joules" in figures:
            self.task_energy.set(figures["energy_joules"])
            self.energy_total.inc(max(figures["energy_joules"], 0.0))
        if points:
            figures["device_power_watts"] = sum(w for _, w in points) / len(points)
        if self.utilization:
            figures["gpu_utilization"] = sum(self.utilization) / len(self.utilization)
        return figures

    def close(self) -> None:
        """Stops sampling and closes the source."""
        self.stop.set()
        if self.source is not None:
            self.source.close()
