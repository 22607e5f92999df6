"""Snapshots of a GPU state: the program the GPU check's snapshot part runs on one GPU.

    python -m bench.gpu.snapshot_worker --dir SCRATCH [--gigabytes 4] [--rounds 2] [--device cuda]

The state is 64 MiB float32 tensors on the GPU, at least ``--gigabytes`` in all. After one
warm-up of each (first-touch of the pinned host buffers, of the folders), ``--rounds`` times:
``Snapshotter.save`` (synchronous: training waits for the whole write) and the stall of
``Snapshotter.save_async`` (training waits only for the copy to pinned host memory), as
bench/snapshot.py times them. Then PyTorch DCP's ``async_save`` on the same state with its own
buffer reuse, the best this torch has: a ``DefaultStager`` (pinned, reused, blocking staging, so
the call's time is the stall), else ``FileSystemWriter(cache_staged_state_dict=True)`` (it
pins memory: a GPU's torch only), else none; one that fails here is named with its error and
the next is measured. Prints one line ``HERD_GPU_SNAPSHOT {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.snapshot import async_stall, snapshot_save
from torchherd.train import Snapshotter
from torchherd.train.dist import Context

MARKER = "HERD_GPU_SNAPSHOT "
TENSOR_SIDE = 4096  # 4096 x 4096 float32: 64 MiB, a large layer


def make_state(gigabytes: float, device: torch.device) -> dict[str, torch.Tensor]:
    per_tensor = TENSOR_SIDE * TENSOR_SIDE * 4
    count = max(1, math.ceil(gigabytes * 1e9 / per_tensor))
    generator = torch.Generator(device=device).manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(
            TENSOR_SIDE, TENSOR_SIDE, device=device, generator=generator
        )
        for i in range(count)
    }


def measure_ours(state: dict[str, torch.Tensor], scratch: Path, rounds: int) -> dict[str, Any]:
    device = next(iter(state.values())).device
    ctx = Context(rank=0, local_rank=0, world_size=1, device=device)
    snaps = Snapshotter(scratch / "snapshots", keep=1, ctx=ctx)
    syncs: list[float] = []
    stalls: list[float] = []
    try:
        snapshot_save(snaps, 0, state)  # warm-up: folders, allocator
        async_stall(snaps, 1, state)  # and the pinned host buffers
        for index in range(rounds):
            syncs.append(snapshot_save(snaps, 2 * index + 2, state))
            stalls.append(async_stall(snaps, 2 * index + 3, state))
        snaps.close()
        found = snaps.load_latest()
        name = next(iter(state))
        round_trip = (
            found is not None
            and found[0] == 2 * rounds + 1
            and torch.equal(found[1][name], state[name].cpu())
        )
    finally:
        snaps.close()
        shutil.rmtree(scratch / "snapshots", ignore_errors=True)
    return {"sync_s": syncs, "stall_s": stalls, "round_trip": bool(round_trip)}


Saver = tuple[str, Callable[[Any, str], Any], Callable[[], None]]


def _dcp_savers(scratch: Path, gpu: bool) -> list[Saver]:
    """DCP's ways of reusing its staging buffers, best first: each (the buffer reuse used,
    save(state, path) -> what to wait on, close). Pinned memory and non-blocking copies only
    from a GPU (a CPU-only torch refuses them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter, staging

    savers: list[Saver] = []
    if hasattr(staging, "DefaultStager") and hasattr(staging, "StagingOptions"):
        stager = staging.DefaultStager(
            staging.StagingOptions(
                use_pinned_memory=gpu,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=gpu,
            )
        )
        savers.append(
            (
                "DefaultStager (pinned, reused)" if gpu else "DefaultStager (reused)",
                lambda state, path: dcp.async_save(state, checkpoint_id=path, async_stager=stager),
                stager.close,
            )
        )
    try:
        writer = FileSystemWriter(str(scratch / "dcp-first"), cache_staged_state_dict=True)
    except TypeError:
        pass  # this torch has no such cache
    else:

        def cached(state: Any, path: str) -> Any:
            return dcp.async_save(state, checkpoint_id=path, storage_writer=writer)

        savers.append(("FileSystemWriter(cache_staged_state_dict=True)", cached, lambda: None))
    savers.append(
        (
            "none (no buffer reuse)",
            lambda state, path: dcp.async_save(state, checkpoint_id=path),
            lambda: None,
        )
    )
    return savers


def _wait(pending: Any) -> None:
    """async_save returns a Future, or (with async staging) a response holding two."""
    upload = getattr(pending, "upload_completion", pending)
    upload.result()


def measure_dcp(state: dict[str, torch.Tensor], scratch: Path, rounds: int) -> dict[str, Any]:
    """DCP's async_save stalls with the best buffer reuse that works here. One that fails goes
    in ``dcp_fallbacks`` and the next is measured: torch 2.11 (seen on an H200) closes a
    caller's DefaultStager after its first save, and the second fails inside DCP
    (``KeyError: <class 'type'>``, its emptied copy table)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = f"file://{scratch / 'dcp-store'}"
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    gpu = next(iter(state.values())).device.type == "cuda"
    fallbacks: list[str] = []
    try:
        savers = _dcp_savers(scratch, gpu)
        for index, (reuse, save, close) in enumerate(savers):
            try:
                stalls = _dcp_stalls(state, scratch, rounds, save, close)
            except Exception as exc:  # noqa: BLE001 - DCP's failure is reported, not raised
                if index == len(savers) - 1:
                    raise
                fallbacks.append(f"{reuse}: {type(exc).__name__}: {exc}")
                continue
            return {"dcp_stall_s": stalls, "dcp_reuse": reuse, "dcp_fallbacks": fallbacks}
        raise AssertionError("unreachable: the last saver returns or raises")
    finally:
        dist.destroy_process_group()


def _dcp_stalls(
    state: dict[str, torch.Tensor],
    scratch: Path,
    rounds: int,
    save: Callable[[Any, str], Any],
    close: Callable[[], None],
) -> list[float]:
    """Seconds training waits in each of ``rounds`` async saves, after one that warms up."""
    stalls: list[float] = []
    try:
        for index in range(rounds + 1):  # the first round warms DCP up, as ours
            path = scratch / f"dcp-{index}"
            started = time.perf_counter()
            pending = save(state, str(path))
            staging = getattr(pending, "staging_completion", None)
            if staging is not None:
                staging.result()  # training may change the state only after this
            stalls.append(time.perf_counter() - started)
            _wait(pending)
            shutil.rmtree(path, ignore_errors=True)
    finally:
        close()
        for index in range(rounds + 1):  # what a failed round left
            shutil.rmtree(scratch / f"dcp-{index}", ignore_errors=True)
    return stalls[1:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dir", required=True, help="scratch folder (emptied afterwards)")
    parser.add_argument("--gigabytes", type=float, default=4.0, help="size of the state")
    parser.add_argument("--rounds", type=int, default=2, help="timed saves of each kind")
    parser.add_argument("--device", default="cuda", help="where the state lives")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    scratch = Path(args.dir)
    scratch.mkdir(parents=True, exist_ok=True)
    state = make_state(args.gigabytes, device)
    answer: dict[str, Any] = {
        "bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "tensors": len(state),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "rounds": args.rounds,
    }
    answer |= measure_ours(state, scratch, args.rounds)
    try:
        answer |= measure_dcp(state, scratch, args.rounds)
    except Exception as exc:  # noqa: BLE001 - the reference only: say why it is missing
        answer["dcp_error"] = f"{type(exc).__name__}: {exc}"
    answer["sync_median_s"] = statistics.median(answer["sync_s"])
    answer["stall_median_s"] = statistics.median(answer["stall_s"])
    if answer.get("dcp_stall_s"):
        answer["dcp_stall_median_s"] = statistics.median(answer["dcp_stall_s"])
    print(MARKER + json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
