"""`scripts/gpu-check`: prove herd's GPU path on this machine in one command.

    scripts/gpu-check [-o DIR] [--only PART ...] [--skip PART ...] [--json]
                      [--gpt-steps N] [--gpt-batch B] [--snapshot-gb G] [--scratch DIR]

Parts, in this order (``--only``/``--skip`` take their names):
  tests      pytest tests/gpu: doctor vs nvidia-smi, one worker per GPU, NCCL through herd
             launch, CUDA errors and out-of-memory in words, flight-recorder variables, a hang
             in a CUDA kernel detected with stacks, FSDP/bf16/compile in examples/gpt.py
  allreduce  `herd bench allreduce` on the GPUs (one GPU: the local copy bandwidth instead)
  snapshot   a 4 GB GPU state: sync save, async stall, DCP async_save's stall
  gpt        examples/gpt.py at GPT-2-small size in bf16, eager and compiled, next to a
             hand-written loop: tokens/s, MFU, the Trainer's overhead

Writes report.json (and each part's files) to DIR (default ~/.herd/gpu-check/<time>/, or under
$HERD_HOME) and prints a table. Exit 0 when nothing failed (targets not met are shown, not
failures), 1 when something failed, 2 for a bad option. Without a GPU: one line, exit 0.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from torchherd.records import herd_home

from .allreduce import run_allreduce
from .gpt import GptSettings, run_gpt
from .machine import (
    NEWEST_TESTED,
    OLDEST_TORCH,
    TorchFeatures,
    cannot_check,
    no_gpu,
    read_torch,
    torch_note,
)
from .report import Report, Row, failed, render
from .smi import SmiReport, read_smi
from .snapshots import run_snapshots
from .suite import run_suite

PARTS = ("tests", "allreduce", "snapshot", "gpt")


def _parts_help() -> str:
    """The docstring's list of parts, for --help."""
    listed = (__doc__ or "").split("Parts, in this order", 1)[-1].split("\nWrites", 1)[0]
    return "parts, in this order" + listed.replace("``", "")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-check",
        description="Prove herd's GPU path on this machine: tests/gpu, all-reduce, snapshots "
        "of a GPU state, examples/gpt.py's throughput and MFU. One JSON report and a table.",
        epilog=_parts_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-o", "--output", type=Path, help="report folder")
    parser.add_argument("--only", action="append", choices=PARTS, help="run only this part")
    parser.add_argument("--skip", action="append", choices=PARTS, default=[], help="skip part")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--gpt-steps", type=int, default=80, help="steps per GPT run (the first 30 warm up)"
    )
    parser.add_argument(
        "--gpt-batch", type=int, default=16, help="sequences of 1,024 tokens per GPU per step"
    )
    parser.add_argument(
        "--snapshot-gb", type=float, default=4.0, help="size of the GPU state to snapshot"
    )
    parser.add_argument("--scratch", type=Path, help="where snapshots are written (default: -o)")
    args = parser.parse_args(argv)
    if args.gpt_steps < 40:
        parser.error("--gpt-steps must be at least 40 (30 warm-up steps, then the timed ones)")
    if args.gpt_batch < 1:
        parser.error("--gpt-batch must be at least 1")
    if args.snapshot_gb <= 0:
        parser.error("--snapshot-gb must be above 0")
    return args


def machine_facts(smi: SmiReport, torch: TorchFeatures) -> dict[str, object]:
    oldest, newest = (".".join(map(str, v)) for v in (OLDEST_TORCH, NEWEST_TESTED))
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "nvidia_smi": smi.to_dict(),
        "torch": torch.to_dict(),
        "torch_supported": f">= {oldest} (written against {newest})",
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def headline(smi: SmiReport, torch: TorchFeatures) -> str:
    names = sorted({g.name for g in smi.gpus}) or list(torch.devices[:1])
    count = len(smi.gpus) or torch.device_count
    return (
        f"{count} x {', '.join(names)}, driver {smi.driver}, driver CUDA {smi.cuda}; "
        f"torch {torch.version} (CUDA {torch.cuda}, NCCL {torch.nccl})"
    )


def run_parts(
    args: argparse.Namespace, out_dir: Path, torch: TorchFeatures, say: Callable[[str], None]
) -> tuple[list[Row], dict[str, float]]:
    gpus = torch.device_count
    gpu_memory = float(torch.memory[0]) if torch.memory else None
    chosen = [p for p in PARTS if (not args.only or p in args.only) and p not in args.skip]
    work: dict[str, Callable[[], list[Row]]] = {
        "tests": lambda: run_suite(out_dir),
        "allreduce": lambda: run_allreduce(out_dir, gpus),
        "snapshot": lambda: run_snapshots(args.scratch or out_dir, args.snapshot_gb, gpu_memory),
        "gpt": lambda: run_gpt(
            out_dir, torch, GptSettings(steps=args.gpt_steps, batch_size=args.gpt_batch)
        ),
    }
    rows: list[Row] = []
    seconds: dict[str, float] = {}
    for number, part in enumerate(chosen, 1):
        say(f"[{number}/{len(chosen)}] {part}")
        started = time.monotonic()
        try:
            rows += work[part]()
        except Exception as exc:  # noqa: BLE001 - one broken part must not hide the others
            (out_dir / f"{part}-error.txt").write_text(traceback.format_exc(), encoding="utf-8")
            rows.append(failed(part, f"the {part} part", f"{type(exc).__name__}: {exc}"))
        seconds[part] = round(time.monotonic() - started, 1)
    return rows, seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    smi = read_smi()
    torch = read_torch()
    why = no_gpu(smi, torch)
    if why is not None:
        print(f"gpu-check: {why}: nothing to check")
        return 0
    started = time.monotonic()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = (args.output or herd_home() / "gpu-check" / stamp).expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    err = Console(stderr=True, highlight=False)
    say = lambda text: err.print(f"gpu-check: {text}", markup=False)  # noqa: E731
    report = Report(machine=machine_facts(smi, torch), started=stamp)
    say(headline(smi, torch))
    problem = cannot_check(smi, torch)
    if problem is not None:
        report.rows.append(failed("machine", "torch can use the GPUs", problem))
    else:
        rows, seconds = run_parts(args, out_dir, torch, say)
        report.add(rows)
        report.machine["part_seconds"] = seconds
    note = torch_note(torch)
    if note:
        report.notes.append(note)
    report.seconds = time.monotonic() - started
    path = out_dir / "report.json"
    report.write(path)
    if args.json:
        sys.stdout.write(path.read_text(encoding="utf-8"))
    else:
        out = Console(highlight=False, width=max(Console().width, 140))
        out.print(headline(smi, torch), markup=False)
        render(report, out)
        out.print(f"report: {path}")
    return report.exit_code
