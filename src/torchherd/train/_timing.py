"""Each rank's timings per step, for herd's slow-rank watch (recovery.straggler): its forward
passes (ForwardTimer, any device) and, on a CPU, its wait on the others (WaitTimer).

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


class WaitTimer:
    """How long this rank waits for the others each step, and how long a step takes.

    In a synchronous job the rank everyone waits for is the one that waits least, wherever in
    the step its slowness lands (forward, backward, optimizer, data loading). DDP hands each
    bucket of gradients to a communication hook the moment this rank's backward has made it;
    the wrapped hook (DDP's own all-reduce, unchanged) notes that moment, and the time from
    the last bucket's to the end of ``backward()`` is what this rank spent blocked on the
    others. ``cycle`` is the time from one step's all-reduce to the next: the same on every
    rank, so a rank's work is ``cycle - wait``.

    Only on a CPU (Gloo): on a GPU the end of ``backward()`` is not when the all-reduce ends
    (NCCL runs on its own stream), and the forward timer speaks instead. A step after an
    evaluation or a snapshot (or the first after a start) reports nothing: whoever saved was
    slow for a reason. Forward-pass buffer broadcasts (models with buffers) are not counted
    as waiting.
    """

    def __init__(self, model: Any, device: torch.device, across_groups: bool = False) -> None:
        from torch.nn.parallel import DistributedDataParallel

        hooked = isinstance(model, DistributedDataParallel)
        # Replica groups: the all-reduce over the groups comes after backward (``reducing``),
        # so a group of one worker, without DDP, is timed too.
        self.enabled = (hooked or across_groups) and device.type == "cpu"
        self._ready: float | None = None
        self._synced: float | None = None
        self._data = 0.0
        self._clean = False
        if self.enabled and hooked:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            # Unannotated: DDP checks a hook's annotations, and this module's are strings.
            def noting_ready(state, bucket):  # type: ignore[no-untyped-def]
                self._ready = time.perf_counter()
                return default_hooks.allreduce_hook(state, bucket)

            model.register_comm_hook(None, noting_ready)

    def fetching(self) -> Any:
        """A context around the wait for the step's batches."""
        return _Stopwatch(self)

    def reducing(self) -> None:
        """This rank's gradients are ready for the all-reduce over the replica groups: its
        work for the step is done (unless DDP's hook already said so, inside its group)."""
        if self.enabled and self._ready is None:
            self._ready = time.perf_counter()

    def synced(self) -> tuple[float | None, float | None, float | None]:
        """The step's gradients were all-reduced (``backward()`` of its last micro-batch
        returned): (wait, cycle, data) seconds, each None where unknown."""
        if not self.enabled:
            return None, None, None
        now = time.perf_counter()
        clean = self._clean and self._ready is not None and self._synced is not None
        result = (
            (now - self._ready, now - self._synced, self._data)  # type: ignore[operator]
            if clean
            else (None, None, None)
        )
        self._synced, self._ready, self._data, self._clean = now, None, 0.0, True
        return result

    def interrupted(self) -> None:
        """An evaluation or a snapshot ran between steps: the next step is not compared."""
        self._clean = False


class _Stopwatch:
    def __init__(self, timer: WaitTimer) -> None:
        self.timer = timer
        self.started = 0.0

    def __enter__(self) -> None:
        self.started = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timer._data += time.perf_counter() - self.started
