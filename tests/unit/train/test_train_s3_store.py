"""What the README promises about S3, held against a real S3 server (moto, as its own process),
whose request log (moto's recorder) shows the order in which objects were written and deleted:
the manifest is uploaded after the state and before ``latest``; pruning deletes the manifest
first; an unfinished upload is ignored and cleared; a run directory's metrics and TensorBoard
events are uploaded while the job runs, a grown file by its new bytes only, and the local
folder is removed at the end; a failing store is reported once and retried.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.s3server import S3Server, make_bucket, s3_server
from torchherd.train import Snapshotter, Trainer, TrainerConfig, seed_everything, supervised
from torchherd.train._mirror import S3_MIN_PART, RunDirMirror
from torchherd.train.dist import Context

# Its fixture is built once per module: xdist keeps the module's tests on one worker.
pytestmark = pytest.mark.xdist_group("train_s3_store")

fsspec = pytest.importorskip("fsspec")
pytest.importorskip("s3fs")
CTX = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def recorded_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Server, Path]]:
    recording = tmp_path_factory.mktemp("moto") / "requests.jsonl"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOTO_ENABLE_RECORDING", "1")  # read by the server process at its start
        patch.setenv("MOTO_RECORDER_FILEPATH", str(recording))
        with s3_server() as server:
            make_bucket(server, "runs")
            yield server, recording


@pytest.fixture
def s3(recorded_s3: tuple[S3Server, Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    server, recording = recorded_s3
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    recording.write_text("")  # this test's requests only
    yield _S3(f"s3://runs/{uuid.uuid4().hex[:8]}", recording)


class _S3:
    def __init__(self, url: str, recording: Path) -> None:
        self.url = url
        self.recording = recording
        self.fs = fsspec.filesystem("s3")

    def requests(self, method: str) -> list[str]:
        """Paths (``bucket/key``) of the recorded requests with ``method``, in order."""
        found = []
        for line in self.recording.read_text().splitlines():
            entry = json.loads(line)
            if entry["method"] == method:
                path = entry["url"].split("://", 1)[-1].split("/", 1)[-1].split("?", 1)[0]
                found.append(path)
        return found

    def keys(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache()
        return sorted(self.fs.find(f"{self.url[5:]}/{prefix}"))


def test_the_manifest_is_written_after_the_state_and_before_latest(s3: _S3) -> None:
    snaps = Snapshotter(f"{s3.url}/snaps", ctx=CTX)
    snaps.save(1, {"w": torch.ones(256, 256)})
    root = f"{s3.url[5:]}/snaps"
    puts = [p for p in s3.requests("PUT") if p.startswith(root)]
    assert puts == [f"{root}/step-1/state.pt", f"{root}/step-1/manifest.json", f"{root}/latest"]


def test_pruning_deletes_the_manifest_first(s3: _S3) -> None:
    snaps = Snapshotter(f"{s3.url}/snaps", keep=1, ctx=CTX)
    snaps.save(1, {"w": torch.ones(64, 64)})
    s3.recording.write_text("")
    snaps.save(2, {"w": torch.ones(64, 64)})
    snaps.close()
    root = f"{s3.url[5:]}/snaps"
    deletes = [p for p in s3.requests("DELETE") if "step-1" in p]
    # s3fs deletes several keys in one POST ?delete; single keys as DELETE.
    bulk = [p for p in s3.requests("POST") if p.startswith(root)]
    assert deletes[:1] == [f"{root}/step-1/manifest.json"], (deletes, bulk)
    assert s3.keys("snaps") == [
        f"{root}/latest",
        f"{root}/step-2/manifest.json",
        f"{root}/step-2/state.pt",
    ]


def test_an_unfinished_upload_is_ignored_then_cleared(s3: _S3) -> None:
    snaps = Snapshotter(f"{s3.url}/snaps", ctx=CTX)
    snaps.save(1, {"w": torch.full((64, 64), 1.0)})
    root = f"{s3.url[5:]}/snaps"
    s3.fs.pipe_file(f"{root}/step-2/state.pt", b"killed before its manifest")
    fresh = Snapshotter(f"{s3.url}/snaps", ctx=CTX)
    assert fresh.steps() == [1]
    step, state = fresh.load_latest()
    assert step == 1 and float(state["w"][0, 0]) == 1.0 and fresh.problems == []
    fresh.save(3, {"w": torch.full((64, 64), 3.0)})
    assert not any("step-2" in key for key in s3.keys("snaps"))


def test_a_grown_file_is_extended_with_its_new_bytes_only(s3: _S3, tmp_path: Path) -> None:
    mirror = RunDirMirror(f"{s3.url}/run", every=3600)
    log = mirror.local / "metrics.jsonl"
    first = b"".join(b'{"step": %d, "loss": 0.5}\n' % i for i in range(S3_MIN_PART // 20))
    log.write_bytes(first)
    assert mirror.upload()
    sent_before = mirror.bytes_sent
    assert sent_before == len(first)
    with open(log, "ab") as handle:
        handle.write(b'{"step": -1, "loss": 0.25}\n')
    assert mirror.upload()
    assert mirror.bytes_sent - sent_before == len(b'{"step": -1, "loss": 0.25}\n')
    assert s3.fs.cat_file(f"{s3.url[5:]}/run/metrics.jsonl") == log.read_bytes()
    assert "copy" in json.dumps(_multipart_calls(s3)).lower()
    local = mirror.local
    assert mirror.close()
    assert not local.exists()  # the temporary folder is removed


def _multipart_calls(s3: _S3) -> list[str]:
    lines = [json.loads(line) for line in s3.recording.read_text().splitlines()]
    return [
        " ".join(f"{k}:{v}" for k, v in entry["headers"].items() if "copy" in k.lower())
        for entry in lines
        if entry["method"] == "PUT" and "partNumber" in entry["url"]
    ]


def test_metrics_and_tensorboard_are_uploaded_while_the_job_runs(s3: _S3) -> None:
    root = f"{s3.url[5:]}"
    seen: dict[int, list[str]] = {}

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        step = trainer.step + 1
        if step == 12:  # mid-run: wait (bounded) for an upload of what was logged so far
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                keys = s3.keys("")
                metrics = f"{root}/metrics.jsonl"
                events = [k for k in keys if "/tensorboard/events.out.tfevents" in k]
                if metrics in keys and events:
                    lines = s3.fs.cat_file(metrics).decode().splitlines()
                    steps = [json.loads(x)["step"] for x in lines]
                    if steps and max(steps) >= 5:
                        seen[step] = [metrics, *events]
                        break
                time.sleep(0.2)
        return supervised(nn.functional.mse_loss)(model, batch)

    seed_everything(0)
    inputs = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    config = TrainerConfig(
        run_dir=s3.url, max_steps=16, batch_size=4, log_every=1, upload_every=0.5
    )
    trainer = Trainer(
        nn.Linear(8, 1),
        lambda params: torch.optim.SGD(params, lr=0.01),
        TensorDataset(inputs, inputs.sum(dim=1, keepdim=True)),
        loss_fn,
        config,
    )
    mirror = trainer.metrics.mirror
    assert mirror is not None
    local = mirror.local
    with trainer:
        trainer.fit()
    assert 12 in seen, "nothing was uploaded while the job ran"
    lines = s3.fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(1, 17))
    assert not local.exists()  # the temporary folder is removed at the end


def test_a_failing_store_is_reported_once_and_retried(
    s3: _S3, recorded_s3: tuple[S3Server, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """The bucket is missing (a real refusal by the store): every upload fails, one warning
    says so; once the bucket is there, the next upload sends what waited and says so once."""
    bucket = f"late-{uuid.uuid4().hex[:8]}"
    mirror = RunDirMirror(f"s3://{bucket}/run", every=3600)
    (mirror.local / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 0.5}\n')
    with caplog.at_level("WARNING", logger="torchherd.train"):
        assert [mirror.upload() for _ in range(3)] == [False, False, False]
        failed = [r.getMessage() for r in caplog.records]
        assert len(failed) == 1, failed
        assert f"cannot upload the run directory to s3://{bucket}/run" in failed[0]
        assert "training goes on" in failed[0]
        make_bucket(recorded_s3[0], bucket)
        mirror.fs.invalidate_cache()
        assert mirror.upload() and mirror.upload()
        said = [r.getMessage() for r in caplog.records][1:]
    assert said == [f"uploads to s3://{bucket}/run work again"]
    assert s3.fs.cat_file(f"{bucket}/run/metrics.jsonl") == b'{"step": 1, "loss": 0.5}\n'
    assert mirror.close()
