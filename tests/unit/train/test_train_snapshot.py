"""Snapshotter on real files: format, pointer, pruning, damage detection and unsafe pickles."""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from train_helpers import JOBS, run_checked, subprocess_env, torchrun_argv

from torchherd.train import SnapshotCorrupt, SnapshotError, Snapshotter
from torchherd.train._files import Digest, HashingWriter, StableMemory, digest_of
from torchherd.train._staging import host_storage_spans
from torchherd.train.dist import Context


def ctx(rank: int = 0, local_rank: int = 0, world_size: int = 1) -> Context:
    return Context(
        rank=rank, local_rank=local_rank, world_size=world_size, device=torch.device("cpu")
    )


def state_for(step: int) -> dict:
    return {"w": torch.full((4, 4), float(step)), "step": step, "name": f"s{step}"}


def saved(tmp_path: Path, steps: list[int], keep: int | None = 3) -> Snapshotter:
    snaps = Snapshotter(tmp_path / "snaps", keep=keep, ctx=ctx())
    for step in steps:
        snaps.save(step, state_for(step))
    return snaps


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    snaps = saved(tmp_path, [5])
    step, state = snaps.load_latest()
    assert step == 5
    assert torch.equal(state["w"], torch.full((4, 4), 5.0))
    assert state["name"] == "s5"


def test_layout_manifest_and_latest_pointer(tmp_path: Path) -> None:
    snaps = saved(tmp_path, [1, 2])
    root = tmp_path / "snaps"
    assert (root / "latest").read_text() == "step-2\n"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1", "step-2"]
    manifest = json.loads((root / "step-2" / "manifest.json").read_text())
    state_file = root / "step-2" / "state.pt"
    assert manifest["step"] == 2
    entry = manifest["files"]["state.pt"]
    assert entry["bytes"] == state_file.stat().st_size
    # One chunk (the file is under 8 MiB): its digest is the file's plain SHA-256.
    assert entry["sha256_chunks"] == [hashlib.sha256(state_file.read_bytes()).hexdigest()]
    assert snaps.latest_step() == 2


def test_keeps_only_the_newest_three(tmp_path: Path) -> None:
    snaps = saved(tmp_path, [10, 20, 30, 40, 50])
    assert snaps.steps() == [50, 40, 30]
    snaps.close()
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == [
        "latest",
        "step-30",
        "step-40",
        "step-50",
    ]
    assert not (tmp_path / "snaps" / "step-10").exists()
    assert snaps.load_latest()[0] == 50


def test_keep_none_keeps_all_and_keep_zero_is_refused(tmp_path: Path) -> None:
    assert saved(tmp_path, [1, 2, 3, 4], keep=None).steps() == [4, 3, 2, 1]
    with pytest.raises(SnapshotError, match="keep=0"):
        Snapshotter(tmp_path / "x", keep=0, ctx=ctx())


def test_empty_directory_loads_nothing(tmp_path: Path) -> None:
    assert Snapshotter(tmp_path / "none", ctx=ctx()).load_latest() is None


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    snaps = saved(tmp_path, [3])
    snaps.save(3, {"w": torch.ones(2), "step": 3, "name": "again"})
    assert snaps.load_latest()[1]["name"] == "again"
    assert snaps.steps() == [3]


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_manifest"])
def test_damaged_latest_falls_back_to_the_previous_one(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    snaps = saved(tmp_path, [1, 2])
    newest = tmp_path / "snaps" / "step-2"
    state_file = newest / "state.pt"
    if damage == "truncate":
        os.truncate(state_file, state_file.stat().st_size // 2)
    elif damage == "flip":
        _flip_byte(state_file, state_file.stat().st_size // 2)
    else:
        (newest / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING, logger="torchherd.train"):
        step, state = snaps.load_latest()
    assert step == 1
    assert state["name"] == "s1"
    assert [p.path.name for p in snaps.problems] == ["step-2"]
    expected = {"truncate": "truncated", "flip": "SHA-256", "delete_manifest": "no manifest"}
    assert expected[damage] in snaps.problems[0].reason
    assert "step-2 is unusable" in caplog.text
    assert "resuming from" in caplog.text and "step-1" in caplog.text


def test_all_damaged_is_an_error_listing_each(tmp_path: Path) -> None:
    snaps = saved(tmp_path, [1, 2])
    for step in (1, 2):
        _flip_byte(tmp_path / "snaps" / f"step-{step}" / "state.pt", 100)
    with pytest.raises(SnapshotCorrupt) as caught:
        snaps.load_latest()
    assert len(caught.value.problems) == 2
    assert "step-2" in str(caught.value) and "step-1" in str(caught.value)
    assert caught.value.remedy


def test_unpublished_snapshot_newer_than_latest_is_ignored(tmp_path: Path) -> None:
    snaps = saved(tmp_path, [1, 2])
    # A save that died between the rename and the pointer update.
    (tmp_path / "snaps" / "latest").write_text("step-1\n")
    assert snaps.load_latest()[0] == 1


def test_missing_pointer_falls_back_to_scanning(tmp_path: Path) -> None:
    snaps = saved(tmp_path, [1, 2])
    (tmp_path / "snaps" / "latest").unlink()
    assert snaps.load_latest()[0] == 2


def test_only_the_writer_rank_writes(tmp_path: Path) -> None:
    shared = Snapshotter(tmp_path / "shared", scope="shared", ctx=ctx(rank=2, local_rank=0))
    node = Snapshotter(tmp_path / "node", scope="node", ctx=ctx(rank=2, local_rank=0))
    other = Snapshotter(tmp_path / "node2", scope="node", ctx=ctx(rank=3, local_rank=1))
    assert shared.save(1, state_for(1)) is None
    assert node.save(1, state_for(1)) == tmp_path / "node" / "step-1"
    assert other.save(1, state_for(1)) is None
    assert not (tmp_path / "shared").exists() and not (tmp_path / "node2").exists()


class _Marker:
    """Unpickling this runs a shell command; a safe loader must never do it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def _plant_malicious(root: Path, step: int, marker: Path) -> None:
    """A snapshot with a valid manifest whose state.pt is a torch zip carrying an evil pickle."""
    folder = root / f"step-{step}"
    folder.mkdir(parents=True)
    torch.save({"w": torch.zeros(1)}, folder / "state.pt")
    with zipfile.ZipFile(folder / "state.pt") as original:
        entries = {info.filename: original.read(info) for info in original.infolist()}
    data_pkl = next(name for name in entries if name.endswith("data.pkl"))
    entries[data_pkl] = pickle.dumps({"w": _Marker(marker)}, protocol=2)
    with zipfile.ZipFile(folder / "state.pt", "w") as evil:
        for name, payload in entries.items():
            evil.writestr(name, payload)
    content = (folder / "state.pt").read_bytes()
    # An attacker can write a matching manifest: the digest proves integrity, not safety.
    entry = {
        "bytes": len(content),
        "chunk_bytes": 8 << 20,
        "sha256_chunks": [hashlib.sha256(content).hexdigest()],
    }
    manifest = {"format": 1, "step": step, "files": {"state.pt": entry}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (root / "latest").write_text(f"step-{step}\n")


def test_malicious_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    snaps = saved(tmp_path, [1])
    _plant_malicious(tmp_path / "snaps", 2, marker)
    step, state = snaps.load_latest()
    assert step == 1 and state["name"] == "s1"
    assert "unsafe" in snaps.problems[0].reason
    assert not marker.exists()


def test_malicious_pickle_alone_raises(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _plant_malicious(tmp_path / "snaps", 7, marker)
    with pytest.raises(SnapshotCorrupt, match="unsafe"):
        Snapshotter(tmp_path / "snaps", ctx=ctx()).load_latest()
    assert not marker.exists()


_SLOW_SAVER = """
import sys, torch
from torchherd.train import Snapshotter
from torchherd.train.dist import Context
ctx = Context(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
snaps = Snapshotter(sys.argv[1], ctx=ctx)
snaps.save(1, {"w": torch.ones(8), "name": "small"})
print("first saved", flush=True)
snaps.save(2, {"w": torch.ones(96 * 1024 * 1024), "name": "big"})  # 384 MB: takes a while
print("second saved", flush=True)
"""


def test_sigkill_during_save_leaves_latest_loadable(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SAVER, str(root)],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "first saved"
        deadline = time.monotonic() + 60
        while not (root / f".tmp-step-2-{proc.pid}" / "state.pt").exists():
            assert time.monotonic() < deadline, "the second save never started"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    # Killed mid-save: the temporary folder is still there and was never published.
    assert (root / f".tmp-step-2-{proc.pid}").exists()
    assert not (root / "step-2").exists()
    snaps = Snapshotter(root, ctx=ctx())
    step, state = snaps.load_latest()
    assert step == 1 and state["name"] == "small"
    assert snaps.problems == []
    # The next save clears the leftover.
    snaps.save(3, state_for(3))
    snaps.close()
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())


@pytest.mark.parametrize("size", [0, 1, 64, 65, 640, 1000])
def test_chunk_digests_agree_between_writer_and_reader(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "file"
    with ThreadPoolExecutor(2) as pool, open(path, "xb") as raw:
        writer = HashingWriter(raw, pool, chunk_bytes=64)
        for start in range(0, size, 37):  # pieces that straddle chunk boundaries
            writer.write(data[start : start + 37])
        written = writer.chunk_digests()
    expected = [hashlib.sha256(data[i : i + 64]).hexdigest() for i in range(0, max(size, 1), 64)]
    assert written == expected
    assert digest_of(path, 64) == Digest(size, 64, tuple(expected))


def _address(buffer: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


def test_stable_memory_is_hashed_in_place_and_other_bytes_are_copied(tmp_path: Path) -> None:
    # Hashing is held back until both buffers were changed after their writes: the stable one
    # must be hashed as it is then (in place, no copy), the other as it was when written.
    stable = bytearray(os.urandom(128))
    scratch = bytearray(os.urandom(128))
    before = bytes(stable) + bytes(scratch)
    go = threading.Event()
    with ThreadPoolExecutor(1) as pool, open(tmp_path / "file", "xb") as raw:
        pool.submit(go.wait)
        memory = StableMemory([(_address(stable), len(stable))])
        writer = HashingWriter(raw, pool, chunk_bytes=64, stable=memory)
        writer.write(memoryview(stable))
        writer.write(scratch)
        stable[0] ^= 0xFF
        scratch[0] ^= 0xFF
        go.set()
        digests = writer.chunk_digests()
    hashed = bytes(stable) + before[128:]
    assert digests == [hashlib.sha256(hashed[i : i + 64]).hexdigest() for i in range(0, 256, 64)]
    assert (tmp_path / "file").read_bytes() == before  # the file got the bytes as written


def test_stable_memory_holds_only_views_wholly_inside_one_range() -> None:
    block = bytearray(256)
    base = _address(block)
    view = memoryview(block)
    memory = StableMemory([(base, 64), (base + 64, 64), (base + 192, 64), (base + 300, 0)])
    assert memory.holds(view[:128])  # two touching ranges merge
    assert memory.holds(view[200:256])
    assert not memory.holds(view[100:200])  # runs into the gap
    assert not memory.holds(view[128:129])
    assert not StableMemory([]).holds(view)


def test_host_storage_spans_cover_every_tensor_of_a_nested_state() -> None:
    weight = torch.randn(8, 8)
    state = {"model": {"w": weight, "view": weight[2:4]}, "opt": [torch.ones(3), (torch.zeros(2),)]}
    spans = host_storage_spans(state)
    storages = {weight.untyped_storage().data_ptr(), state["opt"][0].untyped_storage().data_ptr()}
    assert storages <= {address for address, _ in spans}
    assert (weight.untyped_storage().data_ptr(), 8 * 8 * 4) in spans
    assert len(spans) == 4  # one per tensor; the view's span is its base's whole storage
    assert spans.count((weight.untyped_storage().data_ptr(), 8 * 8 * 4)) == 2


def test_ranks_that_list_a_shared_directory_while_another_writer_publishes_agree(
    tmp_path: Path,
) -> None:
    """Under real torchrun (2 ranks, Gloo): a snapshot published between two ranks' listings
    (another replica group that trains on, writing the same directory) makes the lists differ
    once; the ranks list again together and agree on [120, 100] instead of calling the
    directory "not shared" (which failed a restarted replica group in CI)."""
    job = JOBS / "relist_job.py"
    run_checked(torchrun_argv(2, job, [str(tmp_path / "snapshots")]))
    said = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert said == [{"agreed": [120, 100]}, {"agreed": [120, 100]}], said
