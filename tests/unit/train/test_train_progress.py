"""The Trainer tells herd's hang watch about its long phases, through real progress files.

Every phase the training thread waits for (a save, a wait for the background save, the last
snapshot, a resume, the last tracker records and uploads) writes ``rank-R.phase`` while it runs,
and a snapshot is reported in ``rank-R.saved`` only once it is committed (``latest`` names it).
A watcher thread looks at the directory as herd's agent does (``read_progress``), every
millisecond, while a real Trainer runs on CPU with a state large enough for the phases to last.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from torchherd import progress
from torchherd.train import Snapshotter, Trainer, TrainerConfig, seed_everything, supervised
from torchherd.train.dist import Context

CTX = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


class Watcher:
    """Samples the progress folder on a thread: phases seen, and each ``saved`` report with
    what ``latest`` said at the moment the report was first seen."""

    def __init__(self, folder: Path, snapshots: Path) -> None:
        self.folder = folder
        self.snapshots = snapshots
        self.phases: list[str] = []
        self.saved: list[tuple[int, str | None]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(0.001)

    def sample(self) -> None:
        """Look once (the thread does it every millisecond; a test before it asserts)."""
        with self._lock:
            rank = progress.read_progress(str(self.folder)).get(0)
            if rank is None:
                return
            if rank.phase and (not self.phases or self.phases[-1] != rank.phase):
                self.phases.append(rank.phase)
            if rank.saved_step is not None and (
                not self.saved or self.saved[-1][0] != rank.saved_step
            ):
                try:
                    latest = (self.snapshots / "latest").read_text().strip()
                except OSError:
                    latest = None
                self.saved.append((rank.saved_step, latest))

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


@pytest.fixture
def progress_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = tmp_path / "progress"
    folder.mkdir()
    monkeypatch.setenv(progress.PROGRESS_DIR_VAR, str(folder))
    monkeypatch.setenv("RANK", "0")
    yield folder


class Wide(nn.Module):
    """A model with 64 MiB of weights (and 128 MiB of AdamW state): saves take a while."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.zeros(4096, 4096))
        self.head = nn.Linear(8, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(inputs) + self.big[0, 0]


def _trainer(run_dir: Path, max_steps: int, **config: Any) -> Trainer:
    seed_everything(0)
    inputs = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    settings: dict[str, Any] = {
        "run_dir": str(run_dir),
        "batch_size": 8,
        "max_steps": max_steps,
        "snapshot_every": 1,
        "log_every": 1,
        "tensorboard": False,
    }
    settings.update(config)
    return Trainer(
        Wide(),
        lambda params: torch.optim.AdamW(params, lr=1e-3),
        TensorDataset(inputs, inputs.sum(dim=1, keepdim=True)),
        supervised(nn.functional.mse_loss),
        TrainerConfig(**settings),
    )


def test_background_saves_report_their_waits_and_each_commit_after_it_happens(
    progress_dir: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    with Watcher(progress_dir, run_dir / "snapshots") as watcher, _trainer(run_dir, 3) as trainer:
        trainer.fit()
    # A snapshot every step (each first waits for the one before it: nested phases show the
    # outermost), and at the end the wait for the last one to be committed.
    seen = [phase for phase in watcher.phases if phase != "resuming from a snapshot"]  # none
    assert seen == ["saving snapshot", "saving the last snapshot"]
    # Every report came after its commit: `latest` already named that step (or a later one).
    assert [step for step, _ in watcher.saved] == [1, 2, 3]
    for step, latest in watcher.saved:
        assert latest is not None and int(latest.split("-")[1]) >= step, watcher.saved
    assert progress.read_progress(str(progress_dir))[0].saved_step == 3
    assert not (progress_dir / "rank-0.phase").exists()  # every phase ended


def test_a_sync_save_and_a_resume_are_phases(progress_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with Watcher(progress_dir, run_dir / "snapshots") as watcher:
        with _trainer(run_dir, 2, snapshot_async=False) as trainer:
            trainer.fit()
        watcher.sample()
        assert "saving snapshot" in watcher.phases
        assert [step for step, _ in watcher.saved] == [1, 2]
        assert all(latest == f"step-{step}" for step, latest in watcher.saved)

        seen_during_load: list[str | None] = []
        resumed = _trainer(run_dir, 3, snapshot_async=False)
        # The model's load hook runs inside the resume: the phase must be on file then.
        resumed.module.register_load_state_dict_post_hook(
            lambda *_: seen_during_load.append(progress.read_progress(str(progress_dir))[0].phase)
        )
        with resumed:
            resumed.fit()
    assert resumed.resumed_from == 2
    assert seen_during_load == ["resuming from a snapshot"]  # the outermost phase is shown
    assert "resuming from a snapshot" in watcher.phases


def test_a_snapshotter_outside_the_trainer_reports_too(progress_dir: Path, tmp_path: Path) -> None:
    snapshots = tmp_path / "snaps"
    snaps = Snapshotter(snapshots, ctx=CTX)
    with Watcher(progress_dir, snapshots) as watcher:
        snaps.save_async(6, {"w": torch.zeros(4096, 4096)})
        snaps.save_async(7, {"w": torch.ones(4096, 4096)})  # waits for step 6's write first
        snaps.wait()
        assert snaps.load_latest() is not None
        snaps.close()
    assert [saved for saved in watcher.saved] == [(6, "step-6"), (7, "step-7")]
    assert watcher.phases[:2] == [
        "copying snapshot to host memory",
        "waiting for a background snapshot save",
    ]
    assert "loading snapshot" in watcher.phases


def test_outside_herd_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress.PROGRESS_DIR_VAR, raising=False)
    with _trainer(tmp_path / "run", 1) as trainer:
        trainer.fit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_fit_tells_a_stop_for_a_save_from_a_finish(progress_dir: Path, tmp_path: Path) -> None:
    """herd's save request (the file its agent writes) stops fit() at a snapshot: the result
    says stopped, not finished, so code after fit() can tell a partial model."""
    with _trainer(tmp_path / "done", max_steps=4, snapshot_every=100) as trainer:
        done = trainer.fit()
    assert done.finished and not done.stopped and done.step == 4
    (progress_dir / progress.SAVE_REQUEST).write_text("")
    progress._save_seen = False
    progress._last_look = 0.0
    try:
        with _trainer(tmp_path / "asked", max_steps=1000, snapshot_every=100) as trainer:
            asked = trainer.fit()
    finally:
        progress._save_seen = False
    assert asked.stopped and not asked.finished and asked.step < 1000
