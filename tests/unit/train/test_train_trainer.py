"""The Trainer in one process: exact resume, metrics, evaluation, refusal of foreign snapshots,
epochs, timed snapshots and configuration from a command line."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset
from train_helpers import read_metrics

from torchherd.train import (
    ConfigInvalid,
    SnapshotMismatch,
    Snapshotter,
    Trainer,
    TrainerConfig,
    parse_config,
    seed_everything,
    setup,
    supervised,
)
from torchherd.train.config import field_docs
from torchherd.train.metrics import MetricsLogger, peak_flops_for


def dataset(size: int = 96) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(size, 8, generator=generator)
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).tanh())


def model(hidden: int = 32) -> nn.Module:
    return nn.Sequential(nn.Linear(8, hidden), nn.GELU(), nn.Dropout(0.3), nn.Linear(hidden, 1))


def make_trainer(run_dir: Path, hidden: int = 32, **overrides: Any) -> Trainer:
    settings: dict[str, Any] = {
        "run_dir": str(run_dir),
        "batch_size": 8,
        "grad_accum_steps": 2,
        "max_grad_norm": 0.5,
        "snapshot_every": 3,
        "log_every": 2,
        "max_steps": 10,
    }
    settings.update(overrides)
    seed_everything(0)
    return Trainer(
        model(hidden),
        lambda params: torch.optim.AdamW(params, lr=3e-3),
        dataset(),
        supervised(nn.functional.mse_loss),
        TrainerConfig(**settings),
        scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
        eval_dataset=dataset(24),
    )


def fit(run_dir: Path, **overrides: Any) -> Trainer:
    with make_trainer(run_dir, **overrides) as trainer:
        trainer.fit()
    return trainer


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_stopped_and_resumed_equals_straight(tmp_path: Path, precision: str) -> None:
    # 96 samples / (8 x 2) = 6 steps per epoch: the run crosses an epoch boundary.
    straight = fit(tmp_path / "a", precision=precision)
    fit(tmp_path / "b", max_steps=5, precision=precision)  # ends with a snapshot at step 5
    resumed = fit(tmp_path / "b", precision=precision)
    assert resumed.resumed_from == 5
    assert straight.step == resumed.step == 10 and straight.epoch == resumed.epoch == 1
    expected, got = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in got] == list(range(1, 11))
    keys = ("step", "epoch", "loss", "lr", "grad_norm")
    assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in expected]
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if precision == "fp16":
        assert resumed.scaler is not None
        assert resumed.scaler.get_scale() == straight.scaler.get_scale()


def test_metrics_progress_and_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fit(tmp_path, eval_every=5, snapshot_every=0)
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == list(range(1, 11))
    assert all(r["loss"] > 0 and "lr" in r and "grad_norm" in r for r in train_records)
    assert "samples_per_s" in train_records[1] and "eta_s" in train_records[1]
    assert [r["step"] for r in records if "eval_loss" in r] == [5, 10]
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["2/10", "4/10", "6/10", "8/10", "10/10"]
    assert "samples/s" in progress[0] and "eta" in progress[0]
    assert "eval step 5 | eval_loss" in out
    assert not (tmp_path / "snapshots").exists()


def test_mfu_and_tokens_when_known() -> None:
    assert peak_flops_for("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for("NVIDIA H200") == 989e12
    assert peak_flops_for("Tesla T4") is None


def test_mfu_is_logged_with_a_known_peak(tmp_path: Path) -> None:
    logger = MetricsLogger(
        tmp_path, enabled=True, tokens_per_sample=64, flops_per_sample=1e9, peak=1e12,
        tensorboard=False,
    )  # fmt: skip
    logger.restart_window()
    time.sleep(0.05)
    logger.log_steps([{"step": 1, "epoch": 0, "loss": 1.0}], samples=100)
    logger.close()
    (record,) = read_metrics(tmp_path)
    rate = record["samples_per_s"]
    assert 0 < rate <= 100 / 0.05
    assert record["tokens_per_s"] == pytest.approx(rate * 64, rel=1e-3)
    assert record["mfu"] == pytest.approx(rate * 1e9 / 1e12, rel=1e-2)


def test_snapshot_from_a_different_model_is_refused(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=3)
    bigger = make_trainer(tmp_path, hidden=48)
    with pytest.raises(SnapshotMismatch) as caught:
        bigger.fit()
    error = caught.value
    assert set(error.shape_differences) == {"0.weight", "0.bias", "3.weight"}
    assert error.shape_differences["0.weight"] == ((32, 8), (48, 8))
    assert "shape of 0.weight: [32, 8] in snapshot, [48, 8] in this model" in str(error)
    assert error.remedy


def test_snapshot_with_different_keys_lists_them(tmp_path: Path) -> None:
    fit(tmp_path, max_steps=3)
    trainer = make_trainer(tmp_path)
    _, state = Snapshotter(tmp_path / "snapshots", ctx=trainer.ctx).load_latest()
    state["model"]["extra.weight"] = torch.zeros(2)
    del state["model"]["3.bias"]
    with pytest.raises(SnapshotMismatch) as caught:
        trainer.load_state_dict(state)
    assert caught.value.missing == ("3.bias",)
    assert caught.value.unexpected == ("extra.weight",)
    assert "missing from snapshot: 3.bias" in str(caught.value)


def test_max_epochs_and_final_snapshot(tmp_path: Path) -> None:
    trainer = fit(tmp_path, max_steps=None, max_epochs=2, snapshot_every=4)
    assert (trainer.step, trainer.epoch) == (12, 2)
    snaps = Snapshotter(tmp_path / "snapshots", ctx=trainer.ctx)
    assert snaps.steps() == [12, 8, 4]
    _, state = snaps.load_latest()
    assert state["progress"] == {"step": 12, "epoch": 2}
    assert state["sampler"]["epoch"] == 2 and state["sampler"]["consumed"] == 0


def test_timed_snapshots(tmp_path: Path) -> None:
    seed_everything(0)
    slow = supervised(nn.functional.mse_loss)

    def loss(module: nn.Module, batch: Any) -> torch.Tensor:
        time.sleep(0.03)
        return slow(module, batch)

    config = TrainerConfig(
        run_dir=str(tmp_path), max_steps=8, batch_size=8, log_every=1, snapshot_every_seconds=0.1
    )
    with Trainer(model(), lambda p: torch.optim.SGD(p, lr=0.1), dataset(), loss, config) as t:
        t.fit()
    steps = Snapshotter(tmp_path / "snapshots", keep=None).steps()
    assert steps[0] == 8 and len(steps) >= 2  # at least one by time, plus the final one


def test_setup_without_torchrun_is_a_single_process() -> None:
    ctx = setup()
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.is_main) == (0, 0, 1, True)
    assert not ctx.distributed and ctx.device.type == "cpu"


def test_config_from_the_command_line() -> None:
    (config,) = parse_config(
        TrainerConfig,
        argv=["--max-steps", "7", "--precision", "bf16", "--max-grad-norm", "none"],
        defaults={"run_dir": "runs/x", "snapshot_every": 5},
    )
    assert (config.max_steps, config.precision, config.run_dir) == (7, "bf16", "runs/x")
    assert config.snapshot_every == 5 and config.max_grad_norm is None
    docs = field_docs(TrainerConfig)
    assert set(docs) == {f.name for f in dataclasses.fields(TrainerConfig)}
    with pytest.raises(SystemExit):
        parse_config(TrainerConfig, argv=["--precision", "fp8"])


def test_help_shows_field_docstrings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(TrainerConfig, argv=["--help"])
    assert "Micro-batches whose gradients are summed" in capsys.readouterr().out


def test_impossible_config_is_refused() -> None:
    with pytest.raises(ConfigInvalid, match="max_steps or max_epochs"):
        TrainerConfig()
    with pytest.raises(ConfigInvalid, match="batch_size must be >= 1"):
        TrainerConfig(max_steps=1, batch_size=0)


def test_tensorboard_events_when_installed(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    fit(tmp_path, max_steps=2, snapshot_every=0)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("background", [True, False])
def test_snapshots_written_in_background_or_not_resume_the_same(
    tmp_path: Path, background: bool
) -> None:
    straight = fit(tmp_path / "a", max_steps=6, snapshot_async=background)
    fit(tmp_path / "b", max_steps=4, snapshot_async=background)
    resumed = fit(tmp_path / "b", max_steps=6, snapshot_async=background)
    assert resumed.resumed_from == 4
    assert Snapshotter(tmp_path / "b" / "snapshots").steps()[0] == 6
    a, b = weights(straight), weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_finished_run_run_again_says_there_is_nothing_to_train(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same command twice (a README example): the second finds the run finished and says
    how to train again, rather than a bare "done"."""
    fit(tmp_path)
    first = capsys.readouterr().out
    assert "nothing to train" not in first
    again = fit(tmp_path)
    assert again.resumed_from == 10
    out = capsys.readouterr().out
    assert f"nothing to train: {tmp_path} holds a run that already finished (step 10)" in out
    assert "new run directory" in out


def test_the_heap_is_frozen_after_the_first_step_and_after_saving(tmp_path: Path) -> None:
    """What the model, optimizer and compiled code hold is frozen once they exist (after the
    first step) and again after a step that saved (an evaluation or a snapshot may build
    objects of their own), so the collector's passes stop walking it; a collection first, so
    no garbage is frozen; afterwards the interpreter is as fit found it. gc_freeze false
    leaves the collector alone; a script that froze objects itself keeps them frozen."""
    import gc

    seen: list[tuple[int, int]] = []
    dropped: list[weakref.ref[Any]] = []

    class Cycle:
        def __init__(self) -> None:
            self.me = self

    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        seen.append((len(seen) + 1, gc.get_freeze_count()))
        if len(seen) == 2 and seen[-1][1] > 0:  # the freeze after step 1 followed a collection
            assert dropped[-1]() is None, "garbage was frozen"
        dropped.append(weakref.ref(Cycle()))  # a reference cycle, garbage at once
        return supervised(nn.functional.mse_loss)(model, batch)

    def run(run_dir: Path, **overrides: Any) -> Trainer:
        seen.clear()
        trainer = make_trainer(run_dir, **overrides)
        trainer.loss_fn = loss  # type: ignore[method-assign]
        with trainer:
            trainer.fit()
        return trainer

    gc.collect()
    assert gc.get_freeze_count() == 0
    trainer = run(tmp_path / "on", grad_accum_steps=1, snapshot_every=4, max_steps=6)
    before_first = seen[0][1]
    steps = seen[:6]  # then the final evaluation's, after fit let go
    assert before_first == 0 and all(frozen > 0 for _, frozen in steps[1:]), steps
    assert trainer._heap.freezes == 2, trainer._heap.freezes  # after step 1 and step 4
    assert gc.get_freeze_count() == 0  # unfrozen at the end
    saved_first = run(tmp_path / "first", grad_accum_steps=1, snapshot_every=1, max_steps=2)
    assert saved_first._heap.freezes == 2  # step 1 saved: one freeze for it, not two
    run(tmp_path / "off", grad_accum_steps=1, max_steps=4, gc_freeze=False)
    assert all(frozen == 0 for _, frozen in seen), seen
    assert len(seen) > 4  # the final evaluation's calls too
    # The script's own frozen objects stay frozen: lists (tracked by the collector, unlike
    # object()) that get_objects() does not list while they sit in the permanent generation.
    # (Not the freeze count: it drops whenever any frozen object of this process is freed.)
    mine = [[] for _ in range(10)]
    gc.freeze()
    try:
        run(tmp_path / "owned", grad_accum_steps=1, max_steps=3)
        mine_ids = {id(o) for o in mine}
        assert not any(id(o) in mine_ids for o in gc.get_objects()), "unfrozen by fit"
    finally:
        gc.unfreeze()
    del mine


class _Served(TensorDataset):
    """The dataset as a loader worker serves it: each item writes "pid time" to a file."""

    def __init__(self, log: Path) -> None:
        super().__init__(*dataset().tensors)
        self.log = log

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        with open(self.log, "a") as handle:
            handle.write(f"{os.getpid()} {time.time()}\n")
        return super().__getitem__(index)


def train_two_epochs_with_slow_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **config: Any
) -> tuple[list[tuple[int, float]], list[float]]:
    """Two epochs of 6 steps (96 samples, batches of 8, 2 a step) with a loader worker and a
    snapshot at each epoch's end, each written in the background in 1 s: (worker pid, time)
    of every item served, and when each snapshot write ended."""
    written: list[float] = []
    commit = Snapshotter._commit_in_background

    def slow_commit(self: Snapshotter, *args: Any) -> None:
        time.sleep(1.0)
        commit(self, *args)
        written.append(time.time())

    monkeypatch.setattr(Snapshotter, "_commit_in_background", slow_commit)
    served = tmp_path / "served"
    settings = TrainerConfig(
        run_dir=str(tmp_path / "run"),
        batch_size=8,
        grad_accum_steps=2,
        snapshot_every=6,
        max_steps=12,
        num_workers=1,
        **config,
    )
    loss = supervised(nn.functional.mse_loss)
    with Trainer(
        model(), lambda p: torch.optim.SGD(p, lr=0.1), _Served(served), loss, settings
    ) as t:
        t.fit()
    items = [line.split() for line in served.read_text().split("\n") if line]
    return [(int(pid), float(at)) for pid, at in items], written


def test_an_epochs_loader_worker_is_never_forked_while_a_snapshot_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot at an epoch's end is written in the background (here it takes 1 s): the
    next epoch's loader worker is forked once the write is over, not during it (a fork while
    the writer holds a lock can leave the worker stuck for good)."""
    served, written = train_two_epochs_with_slow_saves(tmp_path, monkeypatch)
    first_served: dict[int, float] = {}
    for pid, at in served:
        first_served.setdefault(pid, at)
    epoch_starts = sorted(first_served.values())
    assert len(epoch_starts) == 2, first_served  # a worker process for each epoch
    assert written and epoch_starts[1] >= written[0], (epoch_starts, written)


def test_persistent_loader_workers_are_forked_once_and_never_wait_for_a_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """persistent_workers: one worker process serves every epoch, and the second epoch does
    not wait for the first epoch's snapshot (its worker exists already: nothing is forked)."""
    served, written = train_two_epochs_with_slow_saves(
        tmp_path, monkeypatch, persistent_workers=True
    )
    assert len({pid for pid, _ in served}) == 1, served  # one worker for both epochs
    # The second epoch's items (the last 96) were served while the first snapshot was written.
    second_epoch = sorted(at for _, at in served)[-96:]
    assert written and second_epoch[0] < written[0], (second_epoch[0], written)
