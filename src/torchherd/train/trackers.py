"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow.

Selected with ``TrainerConfig.trackers`` (``"wandb"``, ``"mlflow"``, or both comma-separated)
and written from rank 0 only, each from a thread of its own (``_courier.py``): a tracker that
answers slowly, or not at all, never holds up training.

One training run is one tracker run, however often it is restarted. The first start records
the run's id in ``<run_dir>/trackers.json``; a start that resumes from a snapshot of the same
run directory (a restart by herd, a Slurm requeue, the same command run again), or that
belongs to the same herd job (``HERD_JOB_ID``), continues that run. Steps redone after a
restart are recorded again, not dropped: W&B plots against a step axis of its own
(``train/step``, since W&B refuses a step below the run's current one), MLflow keeps every
value of a step.

Each tracker is configured the way its own documentation says, from the environment (or
herd's ``env_file``, which keeps secrets off command lines and out of logs): ``WANDB_API_KEY``,
``WANDB_MODE=offline``, ``WANDB_ENTITY``; ``MLFLOW_TRACKING_URI``, ``MLFLOW_TRACKING_TOKEN``.
torchherd never takes a key as an argument. Both packages are optional extras
(``torchherd[wandb]``, ``torchherd[mlflow]``), imported only when selected.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from torchherd.train.errors import ConfigInvalid

__all__ = [
    "Tracker",
    "TRACKERS",
    "STEP_AXIS",
    "open_tracker",
    "parse_trackers",
    "job_identity",
    "check_installed",
    "read_record",
    "write_record",
]

TRACKERS = ("wandb", "mlflow")
JOB_TAG = "herd.job_id"
STEP_AXIS = "train/step"
RECORD = "trackers.json"
# MLflow takes at most this many metrics in one request.
MLFLOW_BATCH = 1000


class Tracker(Protocol):
    """One experiment tracker's run, open for the length of a training process."""

    identity: dict[str, Any]
    """What finds this run again (``trackers.json``)."""

    def log(self, records: list[tuple[int, dict[str, float]]]) -> None:
        """Record scalar values at their steps, in order."""
        ...

    def summary(self, values: dict[str, Any]) -> None:
        """Record the run's final results."""
        ...

    def close(self, finished: bool) -> None:
        """End this process's part of the run; ``finished`` when training reached its end."""
        ...


def parse_trackers(text: str) -> list[str]:
    """``"wandb,mlflow"`` -> ``["wandb", "mlflow"]``; an unknown name is a ConfigInvalid."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown:
        raise ConfigInvalid(
            f"unknown tracker(s) {', '.join(unknown)}",
            remedy=f"use {' or '.join(TRACKERS)} (comma-separated for both), or leave it empty",
        )
    return list(dict.fromkeys(names))


def check_installed(names: list[str]) -> None:
    """Raise ConfigInvalid naming the extra for a selected tracker that is not installed
    (before training starts: the trackers themselves open on a background thread)."""
    for name in names:
        try:
            found = sys.modules.get(name, False) is not None and (
                name in sys.modules or importlib.util.find_spec(name) is not None
            )
        except (ImportError, ValueError) as exc:  # a broken install
            raise _missing(name, exc) from exc
        if not found:
            raise _missing(name, ImportError(f"No module named {name!r}"))


def job_identity() -> tuple[str | None, int]:
    """The herd job id and restart number from the environment (None outside herd)."""
    job = os.environ.get("HERD_JOB_ID") or None
    try:
        attempt = int(os.environ.get("HERD_ATTEMPT", "0"))
    except ValueError:
        attempt = 0
    return job, attempt


def read_record(folder: Path) -> dict[str, Any]:
    """``trackers.json`` in ``folder`` (empty when absent or unreadable)."""
    try:
        record = json.loads((folder / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_record(folder: Path, record: dict[str, Any]) -> None:
    """Replace ``trackers.json`` in ``folder`` atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    temporary = folder / f".{RECORD}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps(record, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(temporary, folder / RECORD)


def open_tracker(
    name: str,
    project: str,
    config: dict[str, Any],
    local_dir: str | None,
    previous: dict[str, Any] | None,
) -> Tracker:
    """Open this run in tracker ``name``: the one ``previous`` identifies, else the herd
    job's (found by its id), else a new one. Blocks on the network: call it off the training
    thread."""
    job, attempt = job_identity()
    if name == "wandb":
        return WandbTracker(project, job, attempt, config, local_dir, previous)
    return MlflowTracker(project, job, attempt, config, previous)


def _missing(extra: str, exc: BaseException) -> ConfigInvalid:
    return ConfigInvalid(
        f"trackers includes {extra}, but the {extra} package is not installed ({exc})",
        remedy=f"pip install 'torchherd[{extra}]', or remove {extra} from trackers",
    )


def _run_id(job: str) -> str:
    # W&B run ids allow letters, digits, '-' and '_'; herd's job ids already fit.
    return re.sub(r"[^A-Za-z0-9_-]", "-", job)[:64]


class WandbTracker:
    """A W&B run, resumed (``resume="allow"``) by its recorded id or the herd job's id."""

    def __init__(
        self,
        project: str,
        job: str | None,
        attempt: int,
        config: dict[str, Any],
        local_dir: str | None,
        previous: dict[str, Any] | None,
    ) -> None:
        import wandb

        settings: dict[str, Any] = {"project": project, "config": config}
        run_id = (previous or {}).get("id") or (_run_id(job) if job is not None else None)
        if run_id is not None:
            settings.update(id=run_id, resume="allow")
        if job is not None:
            settings.update(name=(previous or {}).get("name") or job, group=job)
        if local_dir is not None:
            os.makedirs(local_dir, exist_ok=True)
            settings["dir"] = local_dir
        self._run = wandb.init(**settings)
        # Every metric is plotted against the Trainer's step, which may go back after a
        # restart; W&B's own step only grows, so redone steps are kept, not dropped.
        self._run.define_metric(STEP_AXIS)
        self._run.define_metric("*", step_metric=STEP_AXIS)
        # Update rather than replace: a resumed run keeps what earlier attempts recorded.
        self._run.config.update({"herd_attempt": attempt}, allow_val_change=True)
        self.identity = {"id": self._run.id, "name": self._run.name, "project": project}

    def log(self, records: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in records:
            self._run.log({**values, STEP_AXIS: step})

    def summary(self, values: dict[str, Any]) -> None:
        self._run.summary.update(values)

    def close(self, finished: bool) -> None:
        self._run.finish(exit_code=0 if finished else 1)


class MlflowTracker:
    """An MLflow run, found again by its recorded id or by its ``herd.job_id`` tag."""

    def __init__(
        self,
        project: str,
        job: str | None,
        attempt: int,
        config: dict[str, Any],
        previous: dict[str, Any] | None,
    ) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient()  # MLFLOW_TRACKING_URI and its credentials, as mlflow reads
        self.run_id = self._find(project, job, config, (previous or {}).get("run_id"))
        self._client.set_tag(self.run_id, "herd.attempt", str(attempt))
        self.identity = {"run_id": self.run_id, "experiment": project}

    def _find(
        self, project: str, job: str | None, config: dict[str, Any], recorded: str | None
    ) -> str:
        if recorded:
            self._client.update_run(recorded, status="RUNNING")
            return str(recorded)
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(project)
        )
        if job is not None:
            found = self._client.search_runs(
                [experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job}'", max_results=1
            )
            if found:
                self._client.update_run(found[0].info.run_id, status="RUNNING")
                return str(found[0].info.run_id)
        tags = {JOB_TAG: job} if job is not None else {}
        run = self._client.create_run(experiment_id, tags=tags, run_name=job)
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in sorted(config.items())]
        self._client.log_batch(run.info.run_id, params=params)
        return str(run.info.run_id)

    def log(self, records: list[tuple[int, dict[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(key, float(value), now, step)
            for step, values in records
            for key, value in values.items()
        ]
        for start in range(0, len(metrics), MLFLOW_BATCH):  # one request per 1000 values
            self._client.log_batch(self.run_id, metrics=metrics[start : start + MLFLOW_BATCH])

    def summary(self, values: dict[str, Any]) -> None:
        # MLflow has no summary object: final results become tags, shown on the run's page.
        for key, value in values.items():
            self._client.set_tag(self.run_id, f"final.{key}", str(value))

    def close(self, finished: bool) -> None:
        self._client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")
