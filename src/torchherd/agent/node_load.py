"""`python -m torchherd.agent top`: one node's load as JSON (CPU, memory, GPUs, running jobs).

GPUs come from NVML (the ``pynvml`` module of nvidia-ml-py) when it is installed, else from
``nvidia-smi --query-gpu``; a node with neither shows CPU and memory only.

A job's step rate is read from what it prints: the last ``step N`` (case-insensitive; also
``step: N``, ``step=N``) in the stdout of local rank 0 on this node (torchrun's per-rank file),
compared between two samples. Scripts that print no step numbers show none. With ``follow``,
the verb prints a sample every ``interval`` seconds until its stdin closes, and the rate is
taken between successive samples; otherwise it is taken over the CPU sampling ``window``.
A job whose ranks time their steps (the Trainer does) also shows its recent step times
(recent_steps.py).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from .control import AGENT_FILE, herd_home, live_agent
from .recent_steps import RecentStepTimes

STEP = re.compile(rb"\bstep\b\s*[:=#]?\s*(\d+)", re.IGNORECASE)
# Bytes read from the end of a rank's log when looking for its last step number.
LOG_TAIL = 1 << 16
NVIDIA_SMI_FIELDS = (
    "index",
    "name",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "power.draw",
)


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs, from /proc/stat."""
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already inside user/nice
    return total - idle, total


def memory() -> dict[str, int]:
    """Used and total memory in bytes (used = total - available, as `free` shows it)."""
    info: dict[str, int] = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            info[name] = int(rest.split()[0]) * 1024
    total = info.get("MemTotal", 0)
    return {"used": total - info.get("MemAvailable", info.get("MemFree", 0)), "total": total}


def gpus() -> tuple[list[dict[str, Any]], str | None]:
    """Per-GPU utilisation, memory, temperature and power; and where they came from."""
    try:
        return _nvml(), "nvml"
    except Exception:  # no pynvml, no driver, or an NVML error: try the command line tool
        pass
    if shutil.which("nvidia-smi") is None:
        return [], None
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return [], None
    return parse_nvidia_smi(out), "nvidia-smi"


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    found = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(NVIDIA_SMI_FIELDS):
            continue
        index, name, util, used, total, temp, power = parts
        found.append(
            {
                "index": _number(index),
                "name": name,
                "util": _number(util),
                "mem_used": _mib(used),
                "mem_total": _mib(total),
                "temp": _number(temp),
                "power": _number(power),
            }
        )
    return found


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def _mib(text: str) -> int | None:
    value = _number(text)
    return None if value is None else int(value * 1024 * 1024)


def _nvml() -> list[dict[str, Any]]:
    import pynvml  # type: ignore[import-not-found]

    pynvml.nvmlInit()
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory_info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                power: float | None = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000
            except pynvml.NVMLError:
                power = None
            found.append(
                {
                    "index": index,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "util": float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                    "mem_used": int(memory_info.used),
                    "mem_total": int(memory_info.total),
                    "temp": float(pynvml.nvmlDeviceGetTemperature(handle, 0)),  # 0: the GPU die
                    "power": power,
                }
            )
        return found
    finally:
        pynvml.nvmlShutdown()


# ---------------------------------------------------------------------------------------------
# jobs on this node


def running_jobs(home: str, node: str | None = None) -> list[dict[str, Any]]:
    """Jobs whose agent runs on this node: id, node name and node directory.

    With ``node``, only that node's directories: on a shared home directory every node sees
    every node's, and a pid is only meaningful on the machine that wrote it.
    """
    jobs = []
    pattern = os.path.join(home, "nodes", "*", glob.escape(node) if node else "*", AGENT_FILE)
    for path in glob.glob(pattern):
        node_dir = os.path.dirname(path)
        if live_agent(node_dir) is None:
            continue
        job_id = os.path.basename(os.path.dirname(node_dir))
        jobs.append({"job_id": job_id, "node": os.path.basename(node_dir), "node_dir": node_dir})
    return sorted(jobs, key=lambda job: job["job_id"])


def last_step(node_dir: str) -> int | None:
    """The last step number local rank 0 printed (newest torchrun attempt)."""
    # Each attempt keeps torchrun's per-rank files in its own directory.
    pattern = os.path.join(node_dir, "attempt-*", "torchrun", "*", "attempt_*", "0", "stdout.log")
    logs = glob.glob(pattern)
    if not logs:
        return None
    newest = max(logs, key=_mtime)
    try:
        with open(newest, "rb") as handle:
            handle.seek(max(0, os.path.getsize(newest) - LOG_TAIL))
            tail = handle.read()
    except OSError:
        return None
    matches = STEP.findall(tail)
    return int(matches[-1]) if matches else None


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


class Sampler:
    """Takes samples; remembers the previous one, so rates come from two readings."""

    def __init__(self, home: str, node: str | None = None) -> None:
        self.home = home
        self.node = node
        self._cpu = cpu_times()
        self._steps: dict[str, tuple[int, float, float | None]] = {}
        self._step_times = RecentStepTimes()
        self._take_steps()

    def _take_steps(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        jobs = running_jobs(self.home, self.node)
        for job in jobs:
            step = last_step(job["node_dir"])
            seen = self._steps.get(job["job_id"])
            if step is not None and (seen is None or step != seen[0]):
                rate = None
                if seen is not None and step > seen[0] and now > seen[1]:
                    rate = (step - seen[0]) / (now - seen[1])
                # A step that went back (a restart from a snapshot) starts a new measurement.
                seen = self._steps[job["job_id"]] = (step, now, rate)
            job["step"] = step
            job["step_rate"] = seen[2] if seen is not None else None
            # Seconds since the step last moved: a rate alone would hide a stalled job.
            job["step_age"] = round(now - seen[1], 1) if seen is not None else None
            self._step_times.take(job)
        return jobs

    def sample(self) -> dict[str, Any]:
        busy0, total0 = self._cpu
        busy1, total1 = self._cpu = cpu_times()
        cpu = 100.0 * (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0
        gpu_list, gpu_source = gpus()
        return {
            "hostname": socket.gethostname(),
            "time": time.time(),
            "cpu_percent": round(cpu, 1),
            "cpu_count": os.cpu_count() or 1,
            "load": list(os.getloadavg()),
            "memory": memory(),
            "gpus": gpu_list,
            "gpu_source": gpu_source,
            "jobs": self._take_steps(),
        }


def main(request: dict[str, Any]) -> int:
    sampler = Sampler(herd_home(request), request.get("node"))
    if not request.get("follow"):
        time.sleep(float(request.get("window", 1.0)))
        print(json.dumps(sampler.sample()), flush=True)
        return 0

    def exit_when_stdin_closes() -> None:
        while sys.stdin.buffer.read(1 << 12):
            pass
        os._exit(0)

    threading.Thread(target=exit_when_stdin_closes, daemon=True).start()
    interval = max(0.2, float(request.get("interval", 2.0)))
    time.sleep(min(interval, 1.0))
    while True:
        try:
            print(json.dumps(sampler.sample()), flush=True)
        except BrokenPipeError:
            os._exit(0)
        time.sleep(interval)
