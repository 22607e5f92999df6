"""A hand-written DDP loop's step timings for herd's slow-rank watch, with no change to it.

In a synchronous job the rank everyone waits for is the one that waits least
(recovery/straggler.py). The Trainer times its own waits; a plain script does not, and herd's
periodic looks at its ranks catch only a rank about 3x slow. DDP itself can time every
iteration (its runtime logging: the backward pass and the gradients' all-reduce, on the CPU
or with CUDA events, ``_set_ddp_runtime_logging_sample_rate``). Loaded by herd's workers'
``sitecustomize``, this asks every DistributedDataParallel model to do so as it is made
(``import_hooks``: nothing is imported here before the script imports DDP), and reads the
latest timings at each forward (at most every READ_EVERY s), for ``progress.ddp_timed``:

    wait    the all-reduce that ran after the rank's own backward had ended (DDP's comm
            time less its overlap with the backward): the rank blocked on the others
    cycle   the wall time between two reads over the iterations between them

A script that beats timings of its own (the Trainer) stands these aside (progress). Anything
that fails here leaves the script as it was, with the looks as its only signal.
"""

from __future__ import annotations

import functools
import os
import time
from types import ModuleType
from typing import Any

from . import progress
from .import_hooks import when_imported

DDP_MODULE = "torch.nn.parallel.distributed"
# Seconds between reads of DDP's timings (a read builds a dict of about forty numbers).
READ_EVERY = 0.02
# DDP times every iteration on the CPU; with CUDA events every GPU_SAMPLE_RATE-th (each
# timed iteration's events are waited for at the next one).
GPU_SAMPLE_RATE = 10
NANOSECONDS = 1e9


def install() -> None:
    """Time every DDP model of a herd worker. Never raises."""
    try:
        if os.environ.get(progress.PROGRESS_DIR_VAR) and "RANK" in os.environ:
            when_imported(DDP_MODULE, _wrap)
    except Exception:  # noqa: BLE001 - a worker must start whatever happens here
        pass


def _wrap(module: ModuleType) -> None:
    cls = getattr(module, "DistributedDataParallel", None)
    original = getattr(cls, "__init__", None)
    if cls is None or original is None or getattr(original, "_herd_timed", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            _time(self)
        except Exception:  # noqa: BLE001 - a model herd cannot time still trains
            pass

    __init__._herd_timed = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def _time(model: Any) -> None:
    on_gpu = getattr(model, "device_type", "cpu") not in ("cpu", None)
    model._set_ddp_runtime_logging_sample_rate(GPU_SAMPLE_RATE if on_gpu else 1)
    model.register_forward_pre_hook(Reader().before_forward)


class Reader:
    """One DDP model's latest timed iteration, read before a forward."""

    def __init__(self) -> None:
        self.read_at = 0.0
        self.iteration: int | None = None
        self.iteration_read_at = 0.0

    def before_forward(self, model: Any, _inputs: Any) -> None:
        now = time.monotonic()
        if now - self.read_at < READ_EVERY:
            return
        self.read_at = now
        try:
            data = model._get_ddp_logging_data()
        except Exception:  # noqa: BLE001
            return
        iteration = data.get("iteration")
        if not isinstance(iteration, int) or iteration == self.iteration:
            return  # no new timed iteration (an evaluation's forwards, say)
        timing = iteration_timing(data, self.iteration, now - self.iteration_read_at)
        self.iteration, self.iteration_read_at = iteration, now
        if timing is not None:
            progress.ddp_timed(*timing)


def iteration_timing(
    data: dict[str, Any], last_iteration: int | None, seconds: float
) -> tuple[float, float] | None:
    """(wait, cycle) in seconds from DDP's logging data, given the iteration read last and
    the seconds since; None before two timed iterations were read."""
    iteration = data.get("iteration")
    comm = data.get("backward_comm_time")
    overlap = data.get("backward_compute_comm_overlap_time")
    if not isinstance(iteration, int) or last_iteration is None or iteration <= last_iteration:
        return None
    if not isinstance(comm, int) or not isinstance(overlap, int) or comm <= 0:
        return None
    wait = max(0, comm - overlap) / NANOSECONDS
    return wait, seconds / (iteration - last_iteration)


__all__ = ["install", "iteration_timing"]
