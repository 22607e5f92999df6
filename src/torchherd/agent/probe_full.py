"""The full probe (`herd doctor`): torch, CUDA, NCCL, GPUs, memory, disk, credential files.

Still standard library only in this process: torch is imported by a short ``python -c``
subprocess (so a broken torch is reported, not fatal), GPUs are read with nvidia-smi when it
exists. The slow parts (torch import, nvidia-smi, the disk write test) overlap.

Importing torch costs seconds of CPU (more where CUDA initialises), so its result is remembered
per node in ~/.cache/torchherd, keyed by a fingerprint of the interpreter, the torch install
(file sizes and times), the NVIDIA driver and the variables that change what torch sees. Any
change re-imports; ``fresh`` forces it. Failures are never remembered.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from ..files import private_dir, write_private

TORCH_TIMEOUT = 90.0
"""Seconds the torch import may take (CUDA initialisation on a loaded node is slow)."""
DISK_TEST_BYTES = 16 << 20
DISK_TEST_SECONDS = 1.0
CREDENTIAL_FILES = (
    "~/.aws/credentials",
    "~/.passwd-s3fs",
    "~/.netrc",
    "~/.git-credentials",
    "~/.cache/huggingface/token",
)
_FINGERPRINT_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "LD_LIBRARY_PATH",
    "LD_PRELOAD",
    "PYTHONPATH",
    "CUDA_HOME",
    "NCCL_HOME",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
)

# Runs in the node's interpreter; prints one JSON object. Never raises.
TORCH_SNIPPET = r"""
import json, sys
out = {"ok": False}
try:
    import torch
except BaseException as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out))
    sys.exit(0)
out.update(ok=True, version=torch.__version__, cuda=torch.version.cuda,
           hip=getattr(torch.version, "hip", None))
try:
    import torch.distributed as dist
    out["distributed"] = dist.is_available()
    out["gloo"] = bool(out["distributed"] and dist.is_gloo_available())
    out["nccl_backend"] = bool(out["distributed"] and dist.is_nccl_available())
except Exception as exc:
    out["distributed_error"] = f"{type(exc).__name__}: {exc}"
if torch.version.cuda:
    try:
        version = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception:
        pass
try:
    out["cuda_available"] = torch.cuda.is_available()
    count = torch.cuda.device_count() if out["cuda_available"] else 0
    out["device_count"] = count
    out["devices"] = [
        {"name": p.name, "memory": p.total_memory, "capability": f"{p.major}.{p.minor}"}
        for p in (torch.cuda.get_device_properties(i) for i in range(count))
    ]
except Exception as exc:
    out["cuda_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def collect_full(request: dict[str, Any], workdir: str | None) -> dict[str, Any]:
    """The facts only the doctor needs, gathered with the slow parts overlapping."""
    started = time.monotonic()
    fingerprint = _torch_fingerprint()
    cached = None if request.get("fresh") else _read_cache(fingerprint)
    torch_process = None if cached is not None else _start([sys.executable, "-c", TORCH_SNIPPET])
    smi = shutil.which("nvidia-smi")
    gpu_process = apps_process = None
    if smi:
        gpu_process = _start(
            [
                smi,
                "--query-gpu=index,uuid,name,memory.total,memory.used,"
                "utilization.gpu,driver_version",
                "--format=csv,noheader,nounits",
            ]
        )
        apps_process = _start(
            [
                smi,
                "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                "--format=csv,noheader,nounits",
            ]
        )
    facts: dict[str, Any] = {
        "memory": memory(),
        "disk": disk(workdir or os.path.expanduser("~")),
        "credentials": credentials(),
        "load": list(os.getloadavg()),
    }
    if cached is not None:
        facts["torch"] = {**cached, "cached": True}
    else:
        facts["torch"] = _torch_result(torch_process)
        if facts["torch"].get("ok"):
            _write_cache(fingerprint, facts["torch"])
    facts["nvidia_smi"] = smi
    facts["driver"] = _driver_version()
    if gpu_process is not None and apps_process is not None:
        facts["gpus"], driver = _gpus(_finish(gpu_process, 15))
        facts["driver"] = driver or facts["driver"]
        # The torch import above may show up on a GPU for a moment; it is not someone else's.
        ours = {torch_process.pid} if torch_process is not None else set()
        facts["gpu_processes"] = [
            a for a in _gpu_apps(_finish(apps_process, 15)) if a["pid"] not in ours
        ]
    facts["probe_seconds"] = time.monotonic() - started
    return facts


def _start(argv: list[str]) -> subprocess.Popen[str] | None:
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    except OSError:
        return None


def _finish(process: subprocess.Popen[str] | None, timeout: float) -> tuple[int, str, str]:
    if process is None:
        return -1, "", "could not start"
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return -1, "", f"no answer within {timeout:g} s"
    return process.returncode, out, err


def _torch_result(process: subprocess.Popen[str] | None) -> dict[str, Any]:
    code, out, err = _finish(process, TORCH_TIMEOUT)
    try:
        return dict(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        last = err.strip().splitlines()[-1] if err.strip() else f"exit code {code}"
        # A crash inside torch's import (a segfault in a CUDA library) lands here.
        return {"ok": False, "error": f"importing torch crashed: {last}"}


# ---------------------------------------------------------------------------------------------
# the torch cache


def _torch_fingerprint() -> str | None:
    """What the torch import result depends on, hashed; None when torch is not installed."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    root = os.path.dirname(spec.origin)
    parts = [socket.gethostname(), sys.executable, os.path.realpath(sys.executable), root]
    site = os.path.dirname(root)
    for folder in (root, os.path.join(root, "lib"), os.path.join(site, "nvidia")):
        try:
            entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
        except OSError:
            continue
        for entry in entries:
            try:
                stat = entry.stat()
            except OSError:
                continue
            parts.append(f"{entry.path}:{stat.st_size}:{stat.st_mtime_ns}")
    # Unset and empty differ: CUDA_VISIBLE_DEVICES="" hides every GPU, unset shows them all.
    parts += [f"{name}={os.environ.get(name)!r}" for name in _FINGERPRINT_VARS]
    try:
        with open("/proc/driver/nvidia/version") as driver:
            parts.append(driver.read())
    except OSError:
        pass
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _cache_path(fingerprint: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "torchherd", f"torch-{fingerprint}.json")


def _read_cache(fingerprint: str | None) -> dict[str, Any] | None:
    if fingerprint is None:
        return None
    try:
        with open(_cache_path(fingerprint)) as handle:
            value = json.load(handle)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and value.get("ok") else None


def _write_cache(fingerprint: str | None, value: dict[str, Any]) -> None:
    if fingerprint is None:
        return
    path = _cache_path(fingerprint)
    folder = os.path.dirname(path)
    try:
        # Private like herd's other files (0700, 0600): one left wider is tightened.
        private_dir(folder, home=folder)
        write_private(path, json.dumps(value))
    except OSError:
        pass  # a read-only home only costs the next run an import


# ---------------------------------------------------------------------------------------------
# GPUs, memory, disk, credentials


def _driver_version() -> str | None:
    """The NVIDIA kernel driver's version, without nvidia-smi (None when not loaded)."""
    try:
        with open("/proc/driver/nvidia/version") as driver:
            first = driver.readline()
    except OSError:
        return None
    words = first.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), first.strip() or None)


def _gpus(result: tuple[int, str, str]) -> tuple[list[dict[str, Any]], str | None]:
    code, out, err = result
    if code != 0:
        return [{"error": (err.strip() or out.strip() or f"exit code {code}")[:300]}], None
    gpus, driver = [], None
    for line in out.strip().splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) < 7:
            continue
        gpus.append(
            {
                "index": _int(fields[0]),
                "uuid": fields[1],
                "name": fields[2],
                "memory_total_mib": _int(fields[3]),
                "memory_used_mib": _int(fields[4]),
                "utilization": _int(fields[5]),
            }
        )
        driver = fields[6]
    return gpus, driver


def _gpu_apps(result: tuple[int, str, str]) -> list[dict[str, Any]]:
    code, out, _ = result
    apps = []
    for line in out.strip().splitlines() if code == 0 else []:
        fields = [field.strip() for field in line.split(",")]
        if len(fields) >= 4:
            apps.append(
                {
                    "gpu_uuid": fields[0],
                    "pid": _int(fields[1]),
                    "name": fields[2],
                    "used_mib": _int(fields[3]),
                }
            )
    return apps


def _int(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def memory() -> dict[str, int]:
    """Total and available memory in bytes, from /proc/meminfo."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                key, _, value = line.partition(":")
                names = {"MemTotal": "total", "MemAvailable": "available"}
                if key in names:
                    found[names[key]] = int(value.split()[0]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return found


def disk(path: str) -> dict[str, Any]:
    """Free space where the job writes, and a short fsynced write test there."""
    target = path if os.path.isdir(path) else os.path.expanduser("~")
    result: dict[str, Any] = {"path": target}
    try:
        stat = os.statvfs(target)
        result["free_bytes"] = stat.f_bavail * stat.f_frsize
        result["total_bytes"] = stat.f_blocks * stat.f_frsize
    except OSError as exc:
        result["error"] = exc.strerror or str(exc)
        return result
    block = os.urandom(1 << 20)  # random: a compressing filesystem must not flatter the number
    try:
        with tempfile.NamedTemporaryFile(dir=target, prefix=".herd-disk-test-") as handle:
            started = time.perf_counter()
            written = 0
            while written < DISK_TEST_BYTES and time.perf_counter() - started < DISK_TEST_SECONDS:
                handle.write(block)
                written += len(block)
            handle.flush()
            os.fsync(handle.fileno())
            elapsed = time.perf_counter() - started
        result["write_mb_s"] = written / elapsed / 1e6
    except OSError as exc:
        result["write_error"] = exc.strerror or str(exc)
    return result


def credentials() -> list[dict[str, Any]]:
    """Common credential files that exist, with their permission bits."""
    found = []
    for name in CREDENTIAL_FILES:
        path = os.path.expanduser(name)
        try:
            mode = os.stat(path).st_mode & 0o777
        except OSError:
            continue
        found.append(
            {
                "path": name,
                "mode": f"{mode:04o}",
                "group_readable": bool(mode & 0o040),
                "other_readable": bool(mode & 0o004),
            }
        )
    return found
