"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow.

Selected with ``TrainerConfig.trackers`` (``"wandb"``, ``"mlflow"``, or both comma-separated)
and written from rank 0 only. A job is one tracker run, however often herd restarts it: the
run is named and found by the job's id (``HERD_JOB_ID``, which herd sets on every worker), so a
restarted attempt (``HERD_ATTEMPT``) resumes the same run instead of starting a duplicate.
Outside herd there is no job id, and every start is a new run.

Each tracker is configured the way its own documentation says, from the environment (or
herd's ``env_file``, which keeps secrets off command lines and out of logs): ``WANDB_API_KEY``,
``WANDB_MODE=offline``, ``WANDB_ENTITY``; ``MLFLOW_TRACKING_URI``, ``MLFLOW_TRACKING_TOKEN``.
torchherd never takes a key as an argument. Both packages are optional extras
(``torchherd[wandb]``, ``torchherd[mlflow]``), imported only when selected.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Protocol

from torchherd.train.errors import ConfigInvalid

__all__ = ["Tracker", "TRACKERS", "open_trackers", "parse_trackers", "job_identity"]

TRACKERS = ("wandb", "mlflow")
JOB_TAG = "herd.job_id"


class Tracker(Protocol):
    """One experiment tracker's run, open for the length of a training process."""

    def log(self, step: int, values: dict[str, float]) -> None:
        """Record scalar ``values`` at ``step``."""
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


def job_identity() -> tuple[str | None, int]:
    """The herd job id and restart number from the environment (None outside herd)."""
    job = os.environ.get("HERD_JOB_ID") or None
    try:
        attempt = int(os.environ.get("HERD_ATTEMPT", "0"))
    except ValueError:
        attempt = 0
    return job, attempt


def open_trackers(
    names: list[str], project: str, config: dict[str, Any], local_dir: str | None
) -> list[Tracker]:
    """Open (or resume) this job's run in each named tracker."""
    job, attempt = job_identity()
    opened: list[Tracker] = []
    for name in names:
        if name == "wandb":
            opened.append(WandbTracker(project, job, attempt, config, local_dir))
        elif name == "mlflow":
            opened.append(MlflowTracker(project, job, attempt, config))
    return opened


def _missing(extra: str, exc: ImportError) -> ConfigInvalid:
    return ConfigInvalid(
        f"trackers includes {extra}, but the {extra} package is not installed ({exc})",
        remedy=f"pip install 'torchherd[{extra}]', or remove {extra} from trackers",
    )


def _run_id(job: str) -> str:
    # W&B run ids allow letters, digits, '-' and '_'; herd's job ids already fit.
    return re.sub(r"[^A-Za-z0-9_-]", "-", job)[:64]


class WandbTracker:
    """A W&B run whose id is the job id: every attempt resumes it (``resume="allow"``)."""

    def __init__(
        self,
        project: str,
        job: str | None,
        attempt: int,
        config: dict[str, Any],
        local_dir: str | None,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", exc) from exc
        settings: dict[str, Any] = {"project": project, "config": config}
        if job is not None:
            settings.update(id=_run_id(job), name=job, group=job, resume="allow")
        if local_dir is not None:
            os.makedirs(local_dir, exist_ok=True)
            settings["dir"] = local_dir
        self._run = wandb.init(**settings)
        # Update rather than replace: a resumed run keeps what earlier attempts recorded.
        self._run.config.update({"herd_attempt": attempt}, allow_val_change=True)

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def summary(self, values: dict[str, Any]) -> None:
        self._run.summary.update(values)

    def close(self, finished: bool) -> None:
        self._run.finish(exit_code=0 if finished else 1)


class MlflowTracker:
    """An MLflow run tagged with the job id; a restarted attempt finds it and logs into it."""

    def __init__(self, project: str, job: str | None, attempt: int, config: dict[str, Any]) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise _missing("mlflow", exc) from exc
        self._client = MlflowClient()  # MLFLOW_TRACKING_URI and its credentials, as mlflow reads
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(project)
        )
        found: Any = []
        if job is not None:
            found = self._client.search_runs(
                [experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{job}'", max_results=1
            )
        if found:
            self.run_id = found[0].info.run_id
            self._client.update_run(self.run_id, status="RUNNING")
        else:
            tags = {JOB_TAG: job} if job is not None else {}
            run = self._client.create_run(experiment_id, tags=tags, run_name=job)
            self.run_id = run.info.run_id
            from mlflow.entities import Param

            params = [Param(k, str(v)[:500]) for k, v in sorted(config.items())]
            self._client.log_batch(self.run_id, params=params)
        self._client.set_tag(self.run_id, "herd.attempt", str(attempt))

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in values.items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def summary(self, values: dict[str, Any]) -> None:
        # MLflow has no summary object: final results become tags, shown on the run's page.
        for key, value in values.items():
            self._client.set_tag(self.run_id, f"final.{key}", str(value))

    def close(self, finished: bool) -> None:
        self._client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")
