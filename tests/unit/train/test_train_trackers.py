"""W&B (offline mode) and MLflow (a local file store, and a real tracking server) as trackers of
real Trainer runs: one tracker run per training run across restarts and requeues, redone steps
recorded, and a tracker that hangs or fails never stalls or stops training.

W&B's offline mode writes its transaction log (the `.wandb` file that `wandb sync` uploads);
the test reads it back with a small reader of that record format (leveldb's log format, with
a W&B header), so nothing is sent anywhere.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.trackserver import FaultyProxy, mlflow_server
from torchherd.train import ConfigInvalid, Trainer, TrainerConfig, seed_everything, supervised
from torchherd.train.trackers import STEP_AXIS

JOB = "1122-031442-8f1c"
REQUEUED_JOB = "1122-041502-77aa"  # a Slurm requeue runs `herd launch` again: a new herd job


class Crash(Exception):
    """A worker dying mid-run (raised from the loss function)."""


def _fit(
    run_dir: Path,
    max_steps: int,
    trackers: str,
    crash_at: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> Trainer:
    seed_everything(0)
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(64, 8, generator=generator)
    config = TrainerConfig(
        run_dir=str(run_dir),
        batch_size=8,
        snapshot_every=3,
        log_every=1,
        max_steps=max_steps,
        trackers=trackers,
        tracker_project="herd-tests",
    )
    loss = supervised(nn.functional.mse_loss)
    state: dict[str, Trainer] = {}

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        step = state["trainer"].step + 1
        if crash_at is not None and step == crash_at:
            raise Crash(f"killed at step {step}")
        if on_step is not None:
            on_step(step)
        return loss(model, batch)

    trainer = Trainer(
        nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)),
        lambda params: torch.optim.AdamW(params, lr=3e-3),
        TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).tanh()),
        loss_fn,
        config,
    )
    state["trainer"] = trainer
    with trainer:
        trainer.fit()
    return trainer


def _job_restarted_once(run_dir: Path, trackers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 0 stops at step 5 (a snapshot), attempt 1 resumes from it to step 8."""
    monkeypatch.setenv("HERD_JOB_ID", JOB)
    monkeypatch.setenv("HERD_ATTEMPT", "0")
    _fit(run_dir, 5, trackers)
    monkeypatch.setenv("HERD_ATTEMPT", "1")
    assert _fit(run_dir, 8, trackers).resumed_from == 5


def _crashed_then_requeued(run_dir: Path, trackers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Job A dies at step 6 (snapshot at 3; steps 1-4 logged: a step's record is written at
    the next log step); job B, a requeue with a new herd job id, resumes from step 3 and
    redoes step 4 (and 5) on its way to 8."""
    monkeypatch.setenv("HERD_JOB_ID", JOB)
    monkeypatch.setenv("HERD_ATTEMPT", "0")
    with pytest.raises(Crash):
        _fit(run_dir, 8, trackers, crash_at=6)
    monkeypatch.setenv("HERD_JOB_ID", REQUEUED_JOB)
    assert _fit(run_dir, 8, trackers).resumed_from == 3


def _mlflow_file_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store, no server
    return MlflowClient()


def test_mlflow_one_run_per_job_across_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = _mlflow_file_store(tmp_path, monkeypatch)
    _job_restarted_once(tmp_path / "run", "mlflow", monkeypatch)
    experiment = client.get_experiment_by_name("herd-tests")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == JOB and run.data.tags["herd.job_id"] == JOB
    assert run.data.tags["herd.attempt"] == "1" and run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == "5" and run.data.params["world_size"] == "1"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted({m.step for m in history}) == list(range(1, 9))
    local = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in local if "loss" in r][-1]
    assert run.data.tags["final.step"] == "8"
    assert float(run.data.tags["final.loss"]) == pytest.approx(last["loss"])


def test_mlflow_a_requeued_job_continues_the_run_and_records_redone_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = _mlflow_file_store(tmp_path, monkeypatch)
    _crashed_then_requeued(tmp_path / "run", "mlflow", monkeypatch)
    experiment = client.get_experiment_by_name("herd-tests")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]  # the requeue did not start another
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.tags["final.step"] == "8"
    history = client.get_metric_history(run.info.run_id, "loss")
    steps = Counter(m.step for m in history)
    # Step 4 was logged before the crash and again after the resume: both kept.
    assert steps == Counter({1: 1, 2: 1, 3: 1, 4: 2, 5: 1, 6: 1, 7: 1, 8: 1})
    values = {}
    for metric in history:  # exact resume: the redone steps have the same losses
        assert values.setdefault(metric.step, metric.value) == metric.value


def test_a_tracker_that_hangs_then_fails_never_stalls_training_and_catches_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with mlflow_server(tmp_path / "server") as backend:
        proxy = FaultyProxy(backend, mode="hold")  # the server takes requests, answers none
        try:
            monkeypatch.setenv("MLFLOW_TRACKING_URI", proxy.url)
            monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast, we retry
            seen: list[tuple[int, str, int]] = []

            def on_step(step: int) -> None:
                seen.append((step, proxy.mode, proxy.answered))
                if step == 5:
                    proxy.mode = "fail"  # now it answers, with errors
                if step == 7:
                    proxy.mode = "ok"

            caplog.set_level(logging.WARNING, logger="torchherd.train")
            trainer = _fit(tmp_path / "run", 8, "mlflow", on_step=on_step)
        finally:
            proxy.close()
        assert trainer.step == 8
        # Steps 1-4 ran while the tracker held its first request: training did not wait.
        assert [mode for _, mode, _ in seen[:4]] == ["hold"] * 4
        assert seen[3][2] == 0 and proxy.requests >= 1
        failures = [r for r in caplog.records if "mlflow failed" in r.getMessage()]
        assert len(failures) == 1, [r.getMessage() for r in caplog.records]  # reported once
        assert any("works again" in r.getMessage() for r in caplog.records)

        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=backend)
        experiment = client.get_experiment_by_name("herd-tests")
        (run,) = client.search_runs([experiment.experiment_id])
        history = client.get_metric_history(run.info.run_id, "loss")
        assert sorted(m.step for m in history) == list(range(1, 9))  # nothing lost
        assert run.info.status == "FINISHED"


def _wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    position, pending, block = 7, b"", 32768
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or kind == 0:  # block trailer padding
            position += left
            continue
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 2):  # a whole record, or its first piece
            pending = payload
        else:
            pending += payload
        if kind in (1, 4):  # whole, or last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _has_exit(log: Path) -> bool:
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(log))
    except Exception:  # noqa: BLE001 - a record still being written: look again
        return False


def _wandb_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _wandb_logs(run_dir: Path, count: int) -> list[Path]:
    logs = sorted(
        (run_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime
    )
    assert len(logs) == count  # one per attempt, all for the one run `wandb sync` uploads
    # wandb's writer process may still be flushing the last attempt's log after finish().
    deadline = time.monotonic() + 60
    while not all(_has_exit(log) for log in logs):
        assert time.monotonic() < deadline, "a W&B log never got its exit record"
        time.sleep(0.2)
    return logs


def _wandb_read(logs: list[Path]) -> dict[str, Any]:
    run_ids, groups, history, summary, config = set(), set(), [], {}, {}
    for log in logs:
        for record in _wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(record.run.run_id)
                groups.add(record.run.run_group)
                for item in record.run.config.update:
                    config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                if "loss" in items:
                    history.append({k: json.loads(v) for k, v in items.items()})
            elif kind == "summary":
                for item in record.summary.update:
                    summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return {
        "run_ids": run_ids,
        "groups": groups,
        "history": history,
        "summary": summary,
        "config": config,
    }


def test_wandb_offline_one_run_per_job_across_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _wandb_offline(monkeypatch)
    _job_restarted_once(tmp_path / "run", "wandb", monkeypatch)
    found = _wandb_read(_wandb_logs(tmp_path / "run", 2))
    assert found["run_ids"] == {JOB} and found["groups"] == {JOB}
    assert [h[STEP_AXIS] for h in found["history"]] == list(range(1, 9))
    summary, config = found["summary"], found["config"]
    assert summary["step"] == 8 and isinstance(summary["loss"], float)
    assert config["world_size"] == 1 and config["batch_size"] == 8 and "max_steps" in config


def test_wandb_a_requeued_job_continues_the_run_and_records_redone_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _wandb_offline(monkeypatch)
    _crashed_then_requeued(tmp_path / "run", "wandb", monkeypatch)
    found = _wandb_read(_wandb_logs(tmp_path / "run", 2))
    assert found["run_ids"] == {JOB}  # the requeued job (a new herd job id) continued it
    history = found["history"]
    # Plotted against the Trainer's step: 1-4, then 4-8 again after the resume from 3. No
    # record carries an explicit W&B step, so none is dropped as "below the run's current
    # step" (W&B numbers them itself, on from where the resumed run stands).
    assert [h[STEP_AXIS] for h in history] == [1, 2, 3, 4, 4, 5, 6, 7, 8]
    assert history[3]["loss"] == history[4]["loss"]  # exact resume


def test_unknown_tracker_is_refused() -> None:
    with pytest.raises(ConfigInvalid, match="unknown tracker"):
        TrainerConfig(max_steps=1, trackers="wandb,tensorbored")


def test_missing_tracker_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    with pytest.raises(ConfigInvalid) as caught:
        _fit(tmp_path, 1, "wandb")
    assert "pip install 'torchherd[wandb]'" in caught.value.remedy
