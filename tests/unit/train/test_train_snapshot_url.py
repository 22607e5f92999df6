"""Snapshots and metrics at URLs: fsspec's in-memory store, and a real S3 server (moto).

Object stores have no rename: a snapshot is whole once its manifest is written, and only
then named by ``latest``. These tests check that guarantee where it can break: an upload that
never got its manifest, a corrupted newest object, pruning, a background save to S3, and a
Trainer whose run directory is an S3 URL stopped and resumed.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.s3server import S3Server, make_bucket, s3_server
from torchherd.train import (
    SnapshotError,
    Snapshotter,
    Trainer,
    TrainerConfig,
    seed_everything,
    supervised,
)
from torchherd.train.dist import Context

# Its fixture is built once per module: xdist keeps the module's tests on one worker.
pytestmark = pytest.mark.xdist_group("train_snapshot_url")

fsspec = pytest.importorskip("fsspec")
CTX = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def state_for(step: int) -> dict:
    return {"w": torch.full((64, 64), float(step)), "name": f"s{step}"}


@pytest.fixture
def memory_url() -> Iterator[str]:
    url = f"memory://snaps-{uuid.uuid4().hex[:8]}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url[len("memory://") :]):
        fs.rm(url[len("memory://") :], recursive=True)


def test_memory_url_round_trip_layout_and_pruning(memory_url: str) -> None:
    snaps = Snapshotter(memory_url, keep=2, ctx=CTX)
    for step in (1, 2, 3):
        snaps.save(step, state_for(step))
    snaps.close()
    fs = fsspec.filesystem("memory")
    root = memory_url[len("memory://") :]
    assert fs.cat_file(f"{root}/latest") == b"step-3\n"
    assert snaps.steps() == [3, 2]
    manifest = json.loads(fs.cat_file(f"{root}/step-3/manifest.json"))
    assert manifest["files"]["state.pt"]["bytes"] == fs.size(f"{root}/step-3/state.pt")
    step, state = Snapshotter(memory_url, ctx=CTX).load_latest()
    assert step == 3 and state["name"] == "s3"


def test_upload_without_manifest_is_ignored_then_cleared(memory_url: str) -> None:
    snaps = Snapshotter(memory_url, ctx=CTX)
    snaps.save(1, state_for(1))
    fs = fsspec.filesystem("memory")
    root = memory_url[len("memory://") :]
    fs.pipe_file(f"{root}/step-2/state.pt", b"half an upload")  # killed before the manifest
    assert snaps.steps() == [1]
    step, _ = snaps.load_latest()
    assert step == 1 and snaps.problems == []
    snaps.save(3, state_for(3))
    assert not fs.exists(f"{root}/step-2")


def test_node_scope_is_refused_for_a_remote_url(memory_url: str) -> None:
    with pytest.raises(SnapshotError, match="scope='node'"):
        Snapshotter(memory_url, scope="node", ctx=CTX)


def test_missing_s3_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    for scheme in ("s3", "s3a"):  # and as if fsspec had never loaded it
        monkeypatch.delitem(sys.modules["fsspec.registry"]._registry, scheme, raising=False)
    with pytest.raises(SnapshotError) as caught:
        Snapshotter(f"s3://nowhere-{uuid.uuid4().hex[:6]}/x", ctx=CTX)
    assert "pip install 'torchherd[s3]'" in caught.value.remedy


# ------------------------------------------------------------------------------ real S3


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    pytest.importorskip("s3fs")
    with s3_server() as server:
        make_bucket(server, "runs")
        yield server


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    fsspec.config.conf.pop("s3", None)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    return f"s3://runs/{uuid.uuid4().hex[:8]}"


def test_s3_corrupt_newest_object_falls_back_to_the_previous(s3_env: str) -> None:
    snaps = Snapshotter(f"{s3_env}/snaps", ctx=CTX)
    snaps.save(1, state_for(1))
    snaps.save(2, state_for(2))
    fs, root = snaps.store.fs, snaps.store.root  # type: ignore[attr-defined]
    data = bytearray(fs.cat_file(f"{root}/step-2/state.pt"))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(f"{root}/step-2/state.pt", bytes(data))
    fresh = Snapshotter(f"{s3_env}/snaps", ctx=CTX)
    step, state = fresh.load_latest()
    assert step == 1 and state["name"] == "s1"
    assert "SHA-256" in fresh.problems[0].reason
    assert str(fresh.problems[0].path) == f"{s3_env}/snaps/step-2"


def test_s3_background_save_and_pruning(s3_env: str) -> None:
    snaps = Snapshotter(f"{s3_env}/snaps", keep=2, ctx=CTX)
    done: list[object] = []
    for step in (1, 2, 3):
        weight = torch.full((512, 512), float(step))
        snaps.save_async(step, {"w": weight}, on_saved=done.append)
        weight.zero_()
    snaps.close()
    assert done == [f"{s3_env}/snaps/step-{n}" for n in (1, 2, 3)]
    assert snaps.steps() == [3, 2]
    step, state = Snapshotter(f"{s3_env}/snaps", ctx=CTX).load_latest()
    assert step == 3 and float(state["w"][0, 0]) == 3.0


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(64, 8, generator=generator)
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).tanh())


def _fit(run_dir: str, max_steps: int) -> Trainer:
    seed_everything(0)
    config = TrainerConfig(
        run_dir=run_dir, batch_size=8, snapshot_every=3, log_every=2, max_steps=max_steps
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    with Trainer(
        model,
        lambda params: torch.optim.AdamW(params, lr=3e-3),
        _dataset(),
        supervised(nn.functional.mse_loss),
        config,
    ) as trainer:
        trainer.fit()
    return trainer


def test_trainer_with_an_s3_run_dir_resumes_exactly(s3_env: str, tmp_path: Path) -> None:
    straight = _fit(str(tmp_path / "local"), 8)
    _fit(s3_env, 5)
    resumed = _fit(s3_env, 8)
    assert resumed.resumed_from == 5
    fs = fsspec.filesystem("s3")
    root = s3_env[len("s3://") :]
    lines = fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()
    records = [r for r in map(json.loads, lines) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    local = [json.loads(x) for x in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == [r["loss"] for r in local if "loss" in r]
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert fs.exists(f"{root}/snapshots/step-8/manifest.json")
    assert os.environ["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1")


def test_a_state_larger_than_the_memory_spool_goes_through_a_file(
    memory_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchherd.train import _store

    monkeypatch.setattr(_store, "SPOOL_BYTES", 4096)
    monkeypatch.setattr(_store, "UPLOAD_PART_BYTES", 5000)
    snaps = Snapshotter(memory_url, ctx=CTX)
    snaps.save(1, state_for(1))  # 16 KiB of tensor data: spilled to disk, uploaded in parts
    step, state = Snapshotter(memory_url, ctx=CTX).load_latest()
    assert step == 1 and torch.equal(state["w"], state_for(1)["w"])


def test_an_s3_save_lists_the_bucket_once(s3_env: str) -> None:
    # Every request to an object store is a round trip: one listing serves the leftover
    # check, the same-step check and the pruning of a save.
    snaps = Snapshotter(f"{s3_env}/snaps", keep=1, ctx=CTX)
    snaps.save(1, state_for(1))
    fs = snaps.store.fs  # type: ignore[attr-defined]
    listings: list[str] = []
    real_find = fs.find

    def counting_find(path: str, *args: object, **kwargs: object) -> object:
        listings.append(path)
        return real_find(path, *args, **kwargs)

    fs.find = counting_find
    try:
        snaps.save(2, state_for(2))
        snaps.save(2, state_for(2))  # the same step again replaces it
    finally:
        del fs.find
    snaps.close()
    assert len(listings) == 2
    assert snaps.steps() == [2]
    step, state = Snapshotter(f"{s3_env}/snaps", ctx=CTX).load_latest()
    assert step == 2 and state["name"] == "s2"


def test_snapshots_of_changing_sizes_reuse_the_upload_memory_safely(memory_url: str) -> None:
    # The serialised bytes of one save are overwritten by the next: every snapshot must still
    # hold its own state, whether the next one is larger or smaller.
    snaps = Snapshotter(memory_url, keep=None, ctx=CTX)
    sizes = {1: 64, 2: 256, 3: 16, 4: 16}
    for step, side in sizes.items():
        snaps.save(step, {"w": torch.full((side, side), float(step))})
    snaps.close()
    for step, side in sizes.items():
        fresh = Snapshotter(memory_url, keep=None, ctx=CTX)
        assert fresh.verify(step) is None
        state, reason = fresh._read(step)
        assert reason is None and torch.equal(state["w"], torch.full((side, side), float(step)))
