"""Training metrics on rank 0: progress lines, ``metrics.jsonl``, TensorBoard, throughput, MFU.

Progress is printed as plain lines, one every ``log_every`` steps, never redrawn in place:
under ``herd launch`` stdout is a pipe whose lines get a ``host:rank`` prefix, and a carriage
return there only garbles the log. Every step becomes one JSON line in ``metrics.jsonl``.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch

from torchherd import progress
from torchherd.train._courier import Courier
from torchherd.train._mirror import RunDirMirror
from torchherd.train._store import is_url
from torchherd.train.trackers import RECORD, job_identity, open_tracker, read_record, write_record

__all__ = ["MetricsLogger", "PEAK_BF16_FLOPS", "peak_flops", "peak_flops_for"]

# Dense bf16 tensor-core peak per GPU, FLOP/s, from NVIDIA's data sheets. Matched against
# torch.cuda.get_device_name() by substring, first match wins, so specific names come first.
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM ("NVIDIA H100 80GB HBM3")
    "A100": 312e12,
}


def peak_flops_for(name: str) -> float | None:
    """Peak bf16 FLOP/s for a GPU's marketing name (``torch.cuda.get_device_name``)."""
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


def peak_flops(device: torch.device) -> float | None:
    """Peak bf16 FLOP/s of ``device`` when it is a GPU in the table above, else None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for(torch.cuda.get_device_name(device))


def _duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.1f}"


class MetricsLogger:
    """Writes what the Trainer measured; every method is a no-op where ``enabled`` is False."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        world_size: int = 1,
        device: torch.device | None = None,
        total_steps: int | None = None,
        tokens_per_sample: int | None = None,
        flops_per_sample: float | None = None,
        peak: float | None = None,
        tensorboard: bool = True,
        stream: IO[str] | None = None,
        trackers: Sequence[str] = (),
        tracker_project: str = "torchherd",
        tracker_config: dict[str, Any] | None = None,
        upload_every: float = 30.0,
    ) -> None:
        self.mirror: RunDirMirror | None = None
        tracker_dir: str | None = str(run_dir)
        if enabled and is_url(str(run_dir)) and not str(run_dir).startswith("file://"):
            self.mirror = RunDirMirror(str(run_dir), every=upload_every)
            self.mirror.fetch("metrics.jsonl")  # a restarted job continues the same file
            self.mirror.fetch(RECORD)  # and the same tracker runs
            run_dir = self.mirror.local
            tracker_dir = None  # W&B's files stay in its own default folder
        elif str(run_dir).startswith("file://"):
            run_dir = str(run_dir)[len("file://") :]
            tracker_dir = str(run_dir)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.world_size = world_size
        self.total_steps = total_steps
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample = flops_per_sample
        # Peak FLOP/s of one device; MFU is reported only when it and the model's FLOPs are known.
        self.peak = peak if peak is not None else (peak_flops(device) if device else None)
        self._stream = stream  # None: whatever sys.stdout is when a line is printed
        self._file: IO[str] | None = None
        self._tb: Any = None
        self._tracker_names = list(trackers) if enabled else []
        self._tracker_project = tracker_project
        self._tracker_config = dict(tracker_config or {})
        self._tracker_dir = tracker_dir
        self._record_lock = threading.Lock()
        self.trackers: list[Courier] = []
        self._window_start = time.perf_counter()
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                self._tb = self._open_tensorboard(upload_every if self.mirror else None)
            if self.mirror is not None:
                self.mirror.start()

    def begin(self, resumed: bool) -> None:
        """Open the trackers' runs in the background: the runs ``trackers.json`` names when
        this start continues them (it ``resumed`` from a snapshot, or is the same herd job),
        else new ones. Records logged before wait for it. Once is enough; later calls do
        nothing."""
        if self.trackers or not self._tracker_names:
            return
        folder = self.path.parent
        record = read_record(folder)
        job, _ = job_identity()
        continues = resumed or (job is not None and record.get("herd_job_id") == job)
        for name in self._tracker_names:
            previous = record.get(name) if continues else None
            courier = Courier(
                name,
                functools.partial(
                    open_tracker,
                    name,
                    self._tracker_project,
                    self._tracker_config,
                    self._tracker_dir,
                    previous if isinstance(previous, dict) else None,
                ),
                on_opened=self._remember_run,
            )
            courier.start()
            self.trackers.append(courier)

    def _remember_run(self, name: str, identity: dict[str, Any]) -> None:
        # On a courier's thread, once its run is open: the next start finds the run here.
        with self._record_lock:
            folder = self.path.parent
            record = read_record(folder)
            job, _ = job_identity()
            record[name] = identity
            record["herd_job_id"] = job
            write_record(folder, record)
        if self.mirror is not None:
            self.mirror.nudge()

    def _open_tensorboard(self, flush_every: float | None) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional: no events without it, and no noise
            return None
        # Its own thread writes the events; flushed as often as they are uploaded, if they are.
        flush_secs = min(120.0, flush_every) if flush_every else 120.0
        return SummaryWriter(log_dir=str(self.path.parent / "tensorboard"), flush_secs=flush_secs)

    def _jsonl(self) -> IO[str]:
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        return self._file

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step``: on resume they are about to be redone."""
        if not self.enabled or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except ValueError:
                continue  # a line torn by a kill mid-write
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(self.path)

    def restart_window(self) -> None:
        """Start timing throughput from now (after a resume, an evaluation or a snapshot)."""
        self._window_start = time.perf_counter()

    def log_steps(
        self,
        records: list[dict[str, Any]],
        samples: int,
        show: bool = True,
        now: float | None = None,
    ) -> None:
        """Append one record per step; the last gets throughput and ETA.

        ``samples`` is the number of samples the whole job processed during these steps;
        ``show`` prints the progress line (at log steps, not at every flush); ``now`` is when
        the last of these steps ended (``time.perf_counter()``, default: now).
        """
        now = time.perf_counter() if now is None else now
        elapsed, self._window_start = now - self._window_start, now
        if not self.enabled or not records:
            return
        last = records[-1]
        if elapsed > 0:
            rate = samples / elapsed
            last["samples_per_s"] = round(rate, 3)
            if self.tokens_per_sample:
                last["tokens_per_s"] = round(rate * self.tokens_per_sample, 1)
            if self.flops_per_sample and self.peak:
                last["mfu"] = round(rate * self.flops_per_sample / (self.peak * self.world_size), 4)
            if self.total_steps:
                last["eta_s"] = round((self.total_steps - last["step"]) * elapsed / len(records), 1)
        out = self._jsonl()
        written = round(time.time(), 3)  # wall time: `herd report` keeps a job's own records
        for record in records:
            record.setdefault("time", written)
            out.write(json.dumps(record) + "\n")
            self._scalars(record)
        out.flush()
        if show:
            self._print(self._progress_line(last))

    def log_eval(self, step: int, values: dict[str, float]) -> None:
        """Append an evaluation record and print it."""
        if not self.enabled:
            return
        record = {"step": step, **values, "time": round(time.time(), 3)}
        self._jsonl().write(json.dumps(record) + "\n")
        self._jsonl().flush()
        self._scalars(record)
        shown = " | ".join(f"{k} {v:.4f}" for k, v in values.items())
        self._print(f"eval step {step} | {shown}")

    def message(self, text: str) -> None:
        """Print one line on rank 0 (resume notices, the end of training)."""
        if self.enabled:
            self._print(text)

    def _print(self, line: str) -> None:
        stream = self._stream if self._stream is not None else sys.stdout
        stream.write(line + "\n")
        stream.flush()

    def _scalars(self, record: dict[str, Any]) -> None:
        if self._tb is None and not self.trackers:
            return
        values = {
            key: value
            for key, value in record.items()
            if key not in ("step", "epoch", "time") and isinstance(value, int | float)
        }
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, record["step"])
        for courier in self.trackers:
            courier.log(record["step"], values)  # queued: sent by the courier's thread

    def summary(self, values: dict[str, Any]) -> None:
        """Give the trackers the run's final results (loss, steps, evaluation)."""
        for courier in self.trackers:
            courier.summary(values)

    def _progress_line(self, record: dict[str, Any]) -> str:
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {record['step']}{total}", f"epoch {record.get('epoch', 0)}"]
        loss = record.get("loss")
        if isinstance(loss, float) and not math.isnan(loss):
            parts.append(f"loss {loss:.4f}")
        if "lr" in record:
            parts.append(f"lr {record['lr']:.2e}")
        if "samples_per_s" in record:
            parts.append(f"{_si(record['samples_per_s'])} samples/s")
        if "tokens_per_s" in record:
            parts.append(f"{_si(record['tokens_per_s'])} tok/s")
        if "mfu" in record:
            parts.append(f"mfu {record['mfu'] * 100:.1f}%")
        if "eta_s" in record:
            parts.append(f"eta {_duration(record['eta_s'])}")
        return " | ".join(parts)

    def close(self, finished: bool = True) -> None:
        """Flush and close the files, end the trackers' runs (``finished``: training reached
        its end; otherwise a restart resumes them) and make the last upload of a URL run
        directory; each bounded in time. Safe to call twice."""
        if self._tracker_names and not self.trackers:
            self.begin(resumed=False)  # records were logged without fit(): deliver them
        couriers, self.trackers = self.trackers, []
        if couriers:
            with progress.phase("sending the last records to the trackers"):
                for courier in couriers:
                    courier.close(finished)
        self._tracker_names = []
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self.mirror is not None:
            with progress.phase("uploading the run directory"):
                self.mirror.close()
            self.mirror = None
