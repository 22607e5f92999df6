"""W&B (offline mode) and MLflow (a local file store) as trackers of a real Trainer run that
herd restarted once: one run per job, holding every step's metrics, the config and the summary.

W&B's offline mode writes its transaction log (the `.wandb` file that `wandb sync` uploads);
the test reads it back with a small reader of that record format (leveldb's log format, with
a W&B header), so nothing is sent anywhere.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from torchherd.train import ConfigInvalid, Trainer, TrainerConfig, seed_everything, supervised

JOB = "1122-031442-8f1c"


def _fit(run_dir: Path, max_steps: int, trackers: str) -> Trainer:
    seed_everything(0)
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(64, 8, generator=generator)
    config = TrainerConfig(
        run_dir=str(run_dir),
        batch_size=8,
        snapshot_every=3,
        log_every=2,
        max_steps=max_steps,
        trackers=trackers,
        tracker_project="herd-tests",
    )
    with Trainer(
        nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)),
        lambda params: torch.optim.AdamW(params, lr=3e-3),
        TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).tanh()),
        supervised(nn.functional.mse_loss),
        config,
    ) as trainer:
        trainer.fit()
    return trainer


def _job_restarted_once(run_dir: Path, trackers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Attempt 0 stops at step 5 (a snapshot), attempt 1 resumes from it to step 8."""
    monkeypatch.setenv("HERD_JOB_ID", JOB)
    monkeypatch.setenv("HERD_ATTEMPT", "0")
    _fit(run_dir, 5, trackers)
    monkeypatch.setenv("HERD_ATTEMPT", "1")
    assert _fit(run_dir, 8, trackers).resumed_from == 5


def test_mlflow_one_run_per_job_across_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file store, no server
    _job_restarted_once(tmp_path / "run", "mlflow", monkeypatch)
    client = MlflowClient()
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


def test_wandb_offline_one_run_per_job_across_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    _job_restarted_once(tmp_path / "run", "wandb", monkeypatch)
    logs = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2  # one per attempt, both for the one run `wandb sync` uploads
    # wandb's writer process may still be flushing the last attempt's log after finish().
    deadline = time.monotonic() + 60
    while not all(_has_exit(log) for log in logs):
        assert time.monotonic() < deadline, "a W&B log never got its exit record"
        time.sleep(0.2)
    run_ids, groups, steps, summary, config = set(), set(), [], {}, {}
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
                    steps.append(json.loads(items["_step"]))
            elif kind == "summary":
                for item in record.summary.update:
                    summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    assert run_ids == {JOB} and groups == {JOB}
    assert sorted(set(steps)) == list(range(1, 9))
    assert summary["step"] == 8 and isinstance(summary["loss"], float)
    assert config["world_size"] == 1 and config["batch_size"] == 8 and "max_steps" in config


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
