"""An optional training loop with exact resume: ``Trainer(...).fit()``.

Lifecycle::

    trainer = Trainer(model, optimizer, dataset, loss_fn, config)   # wraps, builds the loader
    trainer.fit()        # resumes from the latest snapshot, trains, snapshots, evaluates
    trainer.close()      # flushes metrics (also done by ``with Trainer(...) as trainer``)

``state_dict()`` / ``load_state_dict()`` hold everything a bit-identical continuation needs:
model, optimizer, scheduler, scaler, step, epoch, sampler position and every RNG of every rank.
Collectives happen only at log, evaluation and snapshot steps, the same steps on every rank, so
the per-step cost over a hand-written DDP loop is a few Python operations.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset

from torchherd import progress
from torchherd.train import _state
from torchherd.train._batches import batch_len, to_device
from torchherd.train._heap import FrozenHeap
from torchherd.train._timing import ForwardTimer, WaitTimer
from torchherd.train.config import TrainerConfig
from torchherd.train.data import ResumableSampler
from torchherd.train.dist import Context, setup
from torchherd.train.errors import ConfigInvalid, SnapshotMismatch, TrainError
from torchherd.train.metrics import MetricsLogger
from torchherd.train.replica_groups import ReplicaGroups, group_env
from torchherd.train.rng import get_rng_state, seed_everything, set_rng_state
from torchherd.train.snapshot import Snapshotter
from torchherd.train.trackers import check_installed, parse_trackers

__all__ = ["Trainer", "FitResult", "LossFn"]

log = logging.getLogger("torchherd.train")

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar loss``; the batch is already on the rank's device."""
OptimizerFactory = Callable[[Iterable[nn.Parameter]], Optimizer]
SchedulerFactory = Callable[[Optimizer], LRScheduler]
STATE_FORMAT = 1
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, slots=True)
class FitResult:
    """How a ``fit()`` ended."""

    step: int
    """Optimizer steps done, including those before a resume."""
    epoch: int
    """Epochs completed."""
    loss: float | None
    """Mean loss over all ranks at the last step (None if no step ran)."""
    resumed_from: int | None
    """Step of the snapshot this run resumed from, if any."""
    eval_loss: float | None = None
    """Last evaluation loss, if an eval dataset was given."""
    stopped: bool = False
    """True when herd asked for a save and stop (a time limit, or nodes back to grow the job)
    and ``fit()`` returned at a snapshot before the end: the run is not finished, and code after
    ``fit()`` (a final evaluation, an export) should not run on the partial model; the job
    resumes from the snapshot. False when training reached max_steps or max_epochs."""

    @property
    def finished(self) -> bool:
        """Training reached its end (not stopped for a save)."""
        return not self.stopped


@dataclass(slots=True)
class _Reduction:
    """Losses of some steps being summed over ranks, and what to write once that is done."""

    work: Any
    values: torch.Tensor
    records: list[dict[str, Any]]
    show: bool
    started: float
    written: bool = False
    """Its records are in metrics.jsonl (and its line printed): rank 0 of a CPU job writes them
    as soon as the sum is in; what the sum decides still waits for the next log step."""

    def summed(self) -> bool:
        return self.work is None or bool(self.work.is_completed())


class Trainer:
    """Trains ``model`` on ``dataset`` with DDP/FSDP, mixed precision, snapshots and metrics."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer | OptimizerFactory,
        dataset: Dataset[Any],
        loss_fn: LossFn,
        config: TrainerConfig,
        *,
        scheduler: LRScheduler | SchedulerFactory | None = None,
        eval_dataset: Dataset[Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        ctx: Context | None = None,
        tokens_per_sample: int | None = None,
        flops_per_sample: float | None = None,
    ) -> None:
        self.config = config
        self.ctx = ctx if ctx is not None else setup()
        self._forward = ForwardTimer(self.ctx.device)
        self.loss_fn = loss_fn
        self.parallel = self._choose_parallel(config.parallel)
        self.model = self._wrap(model.to(self.ctx.device))
        self._waits = WaitTimer(self.model, self.ctx.device, across_groups=bool(group_env()))
        self._heap = FrozenHeap(False)  # fit makes the real one
        self._timings: tuple[float | None, float | None, float | None] = (None, None, None)
        self.optimizer = self._build_optimizer(optimizer)
        self.scheduler = scheduler(self.optimizer) if callable(scheduler) else scheduler
        self.scaler = (
            torch.amp.GradScaler(self.ctx.device.type) if config.precision == "fp16" else None
        )
        self.sampler = self._sampler(dataset, config.shuffle, config.drop_last)
        self.loader = self._loader(dataset, self.sampler, collate_fn, config.drop_last)
        self.eval_loader = None
        if eval_dataset is not None:
            self.eval_loader = self._loader(
                eval_dataset, self._sampler(eval_dataset, False, False), collate_fn, False
            )
        self.snapshotter = Snapshotter(
            config.snapshot_dir or f"{config.run_dir}/snapshots",
            keep=config.snapshot_keep,
            scope=config.snapshot_scope,
            ctx=self.ctx,
        )
        raw = _state.unwrap(self.model)
        where = group_env()
        self.metrics = MetricsLogger(
            # Replica groups all have a rank 0: each keeps its own metrics.
            f"{config.run_dir}/group-{where.group}" if where else config.run_dir,
            enabled=self.ctx.is_main,
            world_size=self.ctx.world_size,
            device=self.ctx.device,
            total_steps=self._total_steps(),
            tokens_per_sample=tokens_per_sample or _reported(raw, "tokens_per_sample"),
            flops_per_sample=flops_per_sample or _reported(raw, "flops_per_sample"),
            tensorboard=config.tensorboard,
            trackers=self._tracker_names() if self.ctx.is_main else (),
            tracker_project=config.tracker_project,
            tracker_config=self._tracker_settings(),
            upload_every=config.upload_every,
        )
        self.step = 0
        self.epoch = 0
        self.resumed_from: int | None = None
        self._last_loss: float | None = None
        self._last_eval: float | None = None
        self._last_eval_step = -1
        self._snapshot_step = -1
        self._snapshot_time = time.monotonic()
        self._pending: list[dict[str, Any]] = []
        self._reducing: list[_Reduction] = []
        self.stopped_for_save = False
        """True when fit() ended early because herd asked for a snapshot (a time limit)."""
        self._loaders_forked: set[int] = set()
        """The loaders (by id) whose worker processes were forked (see _batches)."""
        self._completed = False
        self._dropped_at: float | None = None
        """When a replica group's loss dropped a step (till the next one is committed)."""
        self.groups = self._replica_groups()
        """torchft's replica groups when herd runs the job as such (--replica-groups)."""

    def _replica_groups(self) -> ReplicaGroups | None:
        where = group_env()
        if where is None:
            return None
        return ReplicaGroups(where, self._heal_state, self._load_heal_state)

    def _heal_state(self) -> dict[str, Any]:
        """What a group that is behind copies from a live one (replica_groups)."""
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "progress": {"step": self.step, "epoch": self.epoch},
            "sampler": self.sampler.state_dict(),
        }

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        _load_optional(self.scheduler, state.get("scheduler"), "scheduler")
        self.step = int(state["progress"]["step"])
        self.epoch = int(state["progress"]["epoch"])
        self.sampler.load_state_dict(state["sampler"])
        self.metrics.message(f"healed from a live replica group at step {self.step}")

    @property
    def module(self) -> nn.Module:
        """The model without its DDP or torch.compile wrapper (for generation, export)."""
        return _state.unwrap(self.model)

    # ------------------------------------------------------------------ construction

    def _choose_parallel(self, wanted: str) -> str:
        if wanted == "auto":
            return "ddp" if self.ctx.distributed and self.ctx.world_size > 1 else "none"
        if wanted in ("ddp", "fsdp") and not self.ctx.distributed:
            log.info("parallel=%s needs a process group; running unwrapped", wanted)
            return "none"
        return wanted

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.parallel == "ddp":
            ids = [self.ctx.device] if self.ctx.device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=ids)
        if self.parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard

            # Blocks the model names (e.g. transformer layers) become their own FSDP units, so
            # only one block's full parameters are materialised at a time.
            for unit in getattr(model, "fsdp_units", lambda: [])():
                fully_shard(unit)
            fully_shard(model)
        return model

    def _tracker_names(self) -> list[str]:
        names = parse_trackers(self.config.trackers)
        check_installed(names)  # before training: the runs themselves open in the background
        return names

    def _tracker_settings(self) -> dict[str, Any]:
        settings = {k: v for k, v in asdict(self.config).items() if v is not None}
        settings["world_size"] = self.ctx.world_size
        return settings

    def _build_optimizer(self, optimizer: Optimizer | OptimizerFactory) -> Optimizer:
        if isinstance(optimizer, Optimizer):
            if self.parallel == "fsdp":
                raise ConfigInvalid(
                    "with parallel='fsdp' the optimizer must be created after sharding",
                    remedy="pass a factory, e.g. lambda params: torch.optim.AdamW(params, lr=3e-4)",
                )
            return optimizer
        return optimizer(self.model.parameters())

    def _sampler(self, dataset: Any, shuffle: bool, drop_last: bool) -> ResumableSampler:
        # Replica groups: each rank of each group keeps to its own shard of the data (a group's
        # ranks are numbered from 0 within it, by its own torchrun).
        where = group_env()
        groups, group = (where.groups, where.group) if where else (1, 0)
        return ResumableSampler(
            dataset,
            shuffle=shuffle,
            seed=self.config.seed,
            drop_last=drop_last,
            rank=group * self.ctx.world_size + self.ctx.rank,
            world_size=groups * self.ctx.world_size,
        )

    def _loader(
        self, dataset: Any, sampler: ResumableSampler, collate_fn: Any, drop_last: bool
    ) -> DataLoader[Any]:
        # Its own generator, so creating an iterator never draws from the global torch RNG,
        # whose state must match between a straight run and a resumed one.
        generator = torch.Generator().manual_seed(self.config.seed)
        return DataLoader(
            dataset,
            batch_size=self.config.batch_size,
            sampler=sampler,
            collate_fn=collate_fn,
            num_workers=self.config.num_workers,
            persistent_workers=self.config.persistent_workers and self.config.num_workers > 0,
            pin_memory=self.ctx.device.type == "cuda",
            drop_last=drop_last,
            generator=generator,
        )

    def _total_steps(self) -> int | None:
        per_epoch = -(-len(self.loader) // self.config.grad_accum_steps)
        limits = [self.config.max_steps]
        if self.config.max_epochs is not None:
            limits.append(self.config.max_epochs * per_epoch)
        known = [x for x in limits if x is not None]
        return min(known) if known else None

    # ------------------------------------------------------------------ training

    def fit(self) -> FitResult:
        """Resume if a snapshot exists, then train until max_steps or max_epochs."""
        if self.config.resume:
            self.resume()
        self.metrics.begin(resumed=self.resumed_from is not None)
        self.metrics.restart_window()
        if self.resumed_from is not None and self._done():
            # The same command run again: its run directory holds a finished run, and a user
            # who meant to train again must not read "done" as having trained.
            self.metrics.message(
                f"nothing to train: {self.config.run_dir} holds a run that already finished "
                f"(step {self.step}); give it a new run directory to train again (--run-dir in "
                "the examples), or more steps to go on with this one"
            )
        heap = self._heap = FrozenHeap(self.config.gc_freeze)
        try:
            self._train_epochs()
        finally:
            heap.close()
        self._finish()
        return FitResult(
            self.step,
            self.epoch,
            self._last_loss,
            self.resumed_from,
            self._last_eval,
            stopped=self.stopped_for_save,
        )

    def _train_epochs(self) -> None:
        first = True
        while not self._done():
            self.sampler.set_epoch(self.epoch)
            left = len(self.loader)
            if left == 0:
                if self.sampler.consumed == 0:
                    raise TrainError(
                        f"the dataset gives rank {self.ctx.rank} no batch at all",
                        remedy="use a smaller batch_size, drop_last=False, or more data",
                    )
                self.epoch += 1  # resumed at the very end of an epoch: nothing left in it
                continue
            batches = self._batches(self.loader)
            while left > 0 and not self._done():
                count = min(self.config.grad_accum_steps, left)
                with self._waits.fetching():
                    micro = [next(batches) for _ in range(count)]
                left -= count
                self._train_step(micro)
                if left == 0:
                    self.epoch += 1
                    self.sampler.set_epoch(self.epoch)
                self._after_step()
                if first:  # the model, optimizer and compiled code exist now
                    first = False
                    if not self._heap.freezes:  # not settled by a first step that saved
                        self._heap.settle()
                    self._waits.interrupted()  # the next step's time holds the freeze

    def _batches(self, loader: DataLoader[Any]) -> Iterator[Any]:
        """An iterator over ``loader``, whose worker processes are forked as it is made: never
        while a snapshot is being written in the background. A fork while another thread
        holds a lock (the writer's, inside torch or the allocator) leaves the child waiting
        for it forever, and the rank for its batch: a job was seen stuck for good right after
        a snapshot taken at an epoch's end, its loader worker forked just then. Waiting costs
        only where a save is in flight as an epoch (or an evaluation) begins, and only when
        the workers are forked: persistent workers are forked at the first epoch alone."""
        forks = loader.num_workers > 0 and (
            not loader.persistent_workers or id(loader) not in self._loaders_forked
        )
        if forks:
            self.snapshotter.wait()
            self._loaders_forked.add(id(loader))
        return iter(loader)

    def _done(self) -> bool:
        cfg = self.config
        return (
            self.stopped_for_save
            or (cfg.max_steps is not None and self.step >= cfg.max_steps)
            or (cfg.max_epochs is not None and self.epoch >= cfg.max_epochs)
        )

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = _DTYPES.get(self.config.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=dtype)

    def _gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager[Any]:
        if self.parallel == "ddp" and not sync:
            return self.model.no_sync()  # type: ignore[operator]
        if self.parallel == "fsdp":
            self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        return contextlib.nullcontext()

    def _train_step(self, micro: list[Any]) -> None:
        if not self.model.training:  # train() walks every module: only when needed
            self.model.train()
        if self.groups is not None:
            self.groups.begin()
        total: torch.Tensor | None = None
        samples = 0
        for index, batch in enumerate(micro):
            samples += batch_len(batch)
            batch = to_device(batch, self.ctx.device)
            with self._gradient_sync(index == len(micro) - 1):
                with self._autocast():
                    self._forward.start()
                    loss = self.loss_fn(self.model, batch)
                    self._forward.stop()
                scaled = loss / len(micro)
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            if index == len(micro) - 1 and self.groups is None:
                self._timings = self._waits.synced()
            detached = loss.detach().float()
            total = detached if total is None else total + detached
        record: dict[str, Any] = {"step": self.step + 1, "epoch": self.epoch}
        if self.config.max_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            record["_grad_norm"] = nn.utils.clip_grad_norm_(
                self.model.parameters(), self.config.max_grad_norm
            ).detach()
        committed = True
        if self.groups is not None:
            # The wait for the other groups counts as waiting (who waits least holds them up).
            self._waits.reducing()
            committed = self.groups.commit(self.model.parameters())
            self._timings = self._waits.synced()
        if not committed:
            # A replica group died during this step: the step is dropped everywhere it ran
            # (its batch is not trained on again), and the live groups go on.
            self.optimizer.zero_grad(set_to_none=True)
            self.sampler.advance(samples)
            if self._dropped_at is None:
                self._dropped_at = time.monotonic()
                self.metrics.message(f"step {self.step + 1} dropped: a replica group was lost")
            return
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        record["lr"] = float(self.optimizer.param_groups[0]["lr"])
        if self.scheduler is not None:
            self.scheduler.step()
        self.sampler.advance(samples)
        self.step = self.groups.step if self.groups is not None else self.step + 1
        if self._dropped_at is not None:
            took = time.monotonic() - self._dropped_at
            self._dropped_at = None
            self.metrics.message(f"step {self.step} committed {took:.1f} s after the dropped step")
        assert total is not None  # micro holds at least one batch
        record["_loss"] = total / len(micro) if len(micro) > 1 else total
        record["_samples"] = samples
        self._pending.append(record)

    def _after_step(self) -> None:
        cfg = self.config
        # herd's hang watch: this rank is advancing; its slow-rank watch: what it computed.
        wait, cycle, data = self._timings
        progress.beat(
            self.step, compute=self._forward.step_done(), wait=wait, cycle=cycle, data=data
        )
        self._write_summed_records()
        last = self._done()
        snapshot_due = cfg.snapshot_every > 0 and self.step % cfg.snapshot_every == 0
        eval_due = (
            self.eval_loader is not None and cfg.eval_every > 0 and self.step % cfg.eval_every == 0
        )
        show = self.step % cfg.log_every == 0 or last
        if show or snapshot_due or eval_due:
            # At a plain log step the reduction runs in the background and is read at the next
            # one, so training never waits for it (on a GPU, reading it at once would drain the
            # stream). Before a snapshot, an evaluation or the end it completes now.
            settle = snapshot_due or eval_due or last
            snapshot_due = self._flush_metrics(show, settle) or snapshot_due
            if snapshot_due and self._reducing:  # a timed snapshot: its records first
                self._flush_metrics(show, settle=True)
        if self.stopped_for_save:
            # herd asked for a snapshot before a time limit: save now and leave the loop.
            self.metrics.message(f"herd asked to save and stop: snapshot at step {self.step}")
            self.save_snapshot()
            return
        if eval_due:
            self.evaluate()
        if snapshot_due:
            self.save_snapshot()
        if eval_due or snapshot_due or self.stopped_for_save:
            self._waits.interrupted()  # the next step carries the others' wait for this one
        if eval_due or snapshot_due:
            self._heap.settle()  # an evaluation compiles graphs of its own

    def _flush_metrics(self, show: bool = True, settle: bool = True) -> bool:
        """Start reducing pending losses across ranks (one collective); write what earlier
        reductions produced, all of them when ``settle``, else all but the newest.
        True if a timed snapshot is due (decided by rank 0's clock, so every rank agrees)."""
        pending, self._pending = self._pending, []
        if pending:
            interval = self.config.snapshot_every_seconds
            timed = interval > 0 and time.monotonic() - self._snapshot_time >= interval
            flags = [self._flag(timed), self._flag(progress.save_requested())]
            values = torch.stack([r.pop("_loss") for r in pending] + flags)
            work = dist.all_reduce(values, async_op=True) if self.ctx.distributed else None
            self._reducing.append(_Reduction(work, values, pending, show, time.perf_counter()))
        timed_due = False
        while len(self._reducing) > (0 if settle else 1):
            timed_due = self._write_reduced(self._reducing.pop(0)) or timed_due
        return timed_due

    def _write_summed_records(self) -> None:
        """Rank 0 of a CPU job writes a log step's records, and prints its progress line, at
        the first step after their sum over the ranks is in, not a whole log interval later
        (with log_every 50 the line for step 50 would wait for step 100). Only the writing:
        the flags the sum carries (a timed snapshot, a save request) are acted on at the next
        log step, where every rank reads them at the same step. On a GPU, reading the sum at
        once would drain the stream, so the records wait for the next log step there."""
        if self.ctx.device.type != "cpu" or not self.metrics.enabled:
            return
        for reduction in self._reducing:
            if reduction.written:
                continue
            if not reduction.summed():
                return  # in order: a later sum is never written before an earlier one
            self._write_records(reduction, reduction.values.tolist())

    def _write_reduced(self, reduction: _Reduction) -> bool:
        if reduction.work is not None:
            reduction.work.wait()
        reduced = reduction.values.tolist()
        # Rank 0's view decides for every rank, so all of them stop at the same step.
        self.stopped_for_save = self.stopped_for_save or reduced[-1] > 0
        if not reduction.written:
            self._write_records(reduction, reduced)
        return reduced[-2] > 0

    def _write_records(self, reduction: _Reduction, reduced: list[float]) -> None:
        reduction.written = True
        pending = reduction.records
        samples = 0
        for index, (raw, loss) in enumerate(zip(pending, reduced[:-2], strict=True)):
            samples += raw.pop("_samples") * self.ctx.world_size
            record = {"step": raw.pop("step"), "epoch": raw.pop("epoch")}
            record["loss"] = loss / self.ctx.world_size
            if "_grad_norm" in raw:
                record["grad_norm"] = float(raw.pop("_grad_norm"))
            pending[index] = record | raw
        self._last_loss = pending[-1]["loss"]
        self.metrics.log_steps(pending, samples, reduction.show, now=reduction.started)

    def _flag(self, value: bool) -> torch.Tensor:
        # Summed over ranks, so only rank 0's clock counts.
        return torch.tensor(float(value and self.ctx.is_main), device=self.ctx.device)

    def _finish(self) -> None:
        self._flush_metrics()
        if (
            self.eval_loader is not None
            and self._last_eval_step != self.step
            and not self.stopped_for_save
        ):
            self.evaluate()
        with progress.phase("saving the last snapshot"):
            if self.config.snapshots_enabled and self._snapshot_step != self.step and self.step:
                self.save_snapshot()
            self.snapshotter.wait()  # a background save must be committed before fit() returns
        self._completed = not self.stopped_for_save
        summary = {"step": self.step, "epoch": self.epoch, "loss": self._last_loss}
        if self._last_eval is not None:
            summary["eval_loss"] = self._last_eval
        self.metrics.summary(summary)
        loss = f"{self._last_loss:.4f}" if self._last_loss is not None else "n/a"
        self.metrics.message(f"done: step {self.step}, epoch {self.epoch}, last loss {loss}")

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over the eval dataset, across all ranks; logged to metrics.jsonl."""
        if self.eval_loader is None:
            return None
        # DDP's forward would sync buffers with ranks that are not evaluating; its module
        # computes the same thing. FSDP's forward must run to gather the shards.
        model = _state.unwrap(self.model) if self.parallel == "ddp" else self.model
        model.eval()
        totals = torch.zeros(2, device=self.ctx.device, dtype=torch.float64)
        for batch in self._batches(self.eval_loader):
            progress.beat(self.step)  # a long evaluation is progress, not a hang
            count = batch_len(batch)
            with self._autocast():
                loss = self.loss_fn(model, to_device(batch, self.ctx.device))
            totals[0] += loss.detach().double() * count
            totals[1] += count
        if self.ctx.distributed:
            dist.all_reduce(totals)
        self.model.train()
        loss_sum, count = totals.tolist()
        self._last_eval = loss_sum / count if count else None
        self._last_eval_step = self.step
        if self._last_eval is not None:
            self.metrics.log_eval(self.step, {"eval_loss": self._last_eval})
        self.metrics.restart_window()
        return self._last_eval

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Everything for an exact continuation; a collective (every rank must call it)."""
        everywhere = self.config.snapshot_scope == "node"
        sharded = self.parallel == "fsdp"
        rng: list[Any] = [get_rng_state()]
        if self.ctx.distributed:
            rng = [None] * self.ctx.world_size
            dist.all_gather_object(rng, get_rng_state())
        return {
            "format": STATE_FORMAT,
            "model": _state.model_state(self.model, sharded, everywhere),
            "optimizer": _state.optimizer_state(self.model, self.optimizer, sharded, everywhere),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "progress": {"step": self.step, "epoch": self.epoch},
            "sampler": self.sampler.state_dict(),
            "rng": rng,
            "world_size": self.ctx.world_size,
            "config": {k: v for k, v in asdict(self.config).items() if v is not None},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; refuses state from a different model."""
        if state.get("format") != STATE_FORMAT or "model" not in state:
            raise SnapshotMismatch(
                f"not a Trainer state (format {state.get('format')!r})",
                remedy="load it with the code that saved it, or use a new run directory",
            )
        _state.check_compatible(self.model, state["model"])
        sharded = self.parallel == "fsdp"
        _state.load_model_state(self.model, state["model"], sharded)
        try:
            _state.load_optimizer_state(self.model, self.optimizer, state["optimizer"], sharded)
            # A loaded state's tensors map the snapshot file; the optimizer keeps what it is
            # given and updates it in place, so it gets copies of its own (one at a time).
            _state.own_tensors(self.optimizer.state)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise SnapshotMismatch(
                f"the snapshot's optimizer state does not fit this optimizer: {exc}",
                remedy="resume with the optimizer that wrote the snapshot",
            ) from exc
        _load_optional(self.scheduler, state.get("scheduler"), "scheduler")
        _load_optional(self.scaler, state.get("scaler"), "scaler")
        self.step = int(state["progress"]["step"])
        self.epoch = int(state["progress"]["epoch"])
        self.sampler.load_state_dict(state["sampler"])
        self._restore_rng(state["rng"], int(state.get("world_size", len(state["rng"]))))

    def _restore_rng(self, saved: list[Any], saved_world: int) -> None:
        if saved_world == self.ctx.world_size and self.ctx.rank < len(saved):
            set_rng_state(saved[self.ctx.rank])
            return
        # A different world size cannot continue every rank's random stream; reseed so the
        # run stays reproducible from here (data order is unaffected: the sampler handles it).
        if self.ctx.is_main:
            log.warning(
                "world size changed from %d to %d: random generators are reseeded",
                saved_world,
                self.ctx.world_size,
            )
        seed_everything(self.config.seed + 1_000_003 * self.step + self.ctx.rank)

    def save_snapshot(self) -> None:
        """Save a snapshot of the current step now (a collective). With ``snapshot_async``
        this returns once the state is copied to host memory; the write goes on behind."""
        if self.groups is not None and not self.groups.takes_snapshots():
            return  # one live group writes the snapshots
        with progress.phase("saving snapshot"):
            state = self.state_dict()
            meta = {"epoch": self.epoch}
            if self.config.snapshot_async:
                self.snapshotter.save_async(self.step, state, meta, on_saved=self._saved)
            else:
                path = self.snapshotter.save(self.step, state, meta=meta)
                if path is not None:
                    self._saved(path)
            del state
        self._snapshot_step = self.step
        self._snapshot_time = time.monotonic()
        self.metrics.restart_window()

    def _saved(self, where: Path | str) -> None:
        self.metrics.message(f"snapshot {where}")

    def resume(self) -> int | None:
        """Load the latest usable snapshot, if any; returns its step."""
        with progress.phase("resuming from a snapshot"):
            found = self.snapshotter.load_latest()
            if found is None:
                return None
            step, state = found
            self.load_state_dict(state)
            del found, state  # the file's pages are let go
            if self.groups is not None:
                self.groups.resume_at(step)
        self.resumed_from = step
        self._snapshot_step = step
        self.metrics.truncate_after(step)
        self.metrics.message(
            f"resumed from {self.snapshotter.directory}/step-{step} "
            f"(epoch {self.epoch}, {self.sampler.consumed} samples into it)"
        )
        return step

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Finish a background save, flush metrics, finish deleting pruned snapshots.
        The process group stays (``teardown()`` ends it)."""
        try:
            self.snapshotter.close()
        finally:
            self.metrics.close(finished=self._completed)
            if self.groups is not None:
                self.groups.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reported(model: nn.Module, name: str) -> Any:
    value = getattr(model, name, None)
    return value() if callable(value) else value


def _load_optional(target: Any, state: Any, what: str) -> None:
    if target is None and state is None:
        return
    if target is None or state is None:
        raise SnapshotMismatch(
            f"the snapshot {'has' if state is not None else 'lacks'} {what} state, "
            f"this Trainer {'has no' if target is None else 'has a'} {what}",
            remedy=f"resume with the same {what} setting that wrote the snapshot",
        )
    target.load_state_dict(state)
