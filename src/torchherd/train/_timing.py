"""Each rank's own compute time per step, for herd's slow-rank watch (recovery.straggler).

A step's wall time is the same on every rank (the gradients' all-reduce waits for the
slowest), so herd compares what each rank spends on its own: its forward passes, in which DDP
waits for no one. On a CPU that is wall-clock time; on a GPU, kernels run after the Python
call returns, so the time comes from CUDA events read one step later (by then they are done:
no synchronisation is ever forced on the training stream).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class ForwardTimer:
    """Times the forward passes of a step (micro-batches add up)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._started = 0.0
        self._cpu_total = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._pending: list[tuple[Any, Any]] = []
        self.last: float | None = None
        """Seconds of the last step whose time is known (the one before, on a GPU)."""

    def start(self) -> None:
        if self.cuda:
            begin = torch.cuda.Event(enable_timing=True)
            begin.record()
            self._events.append((begin, None))
        else:
            self._started = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            begin, _ = self._events.pop()
            self._events.append((begin, end))
        else:
            self._cpu_total += time.perf_counter() - self._started

    def step_done(self) -> float | None:
        """Close the step; the seconds of the latest step whose time is known."""
        if not self.cuda:
            self.last, self._cpu_total = self._cpu_total, 0.0
            return self.last
        if self._pending and all(end.query() for _, end in self._pending):
            self.last = sum(begin.elapsed_time(end) for begin, end in self._pending) / 1000.0
        self._pending, self._events = self._events, []
        return self.last
