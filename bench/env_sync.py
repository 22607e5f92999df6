"""`herd env sync` against the by-hand baseline, on fresh testbed nodes with private filesystems.

Each testbed node gets its own directory at ``bed.private`` (a mount namespace), so what herd
builds there exists on that node only. The environment is torch (CPU) + numpy and their
dependencies, from a wheel folder made once with ``pip download`` (``--wheels DIR``; made in a
temporary folder from pip's configured index or cache when not given).

For N fresh nodes:
  herd      ``herd env sync --lock REQ --wheels DIR``: time from the command to every node
            identical (its exit), and the bytes the launcher sent (herd's own count).
  re-sync   the same command again, nothing changed (target: <= 2 s).
  relay     with ``--relay-above N``, more than N nodes to sync pass the wheels on to each other
            (the launcher sends one copy; its bytes are the "sent" column).
  baseline  what people do by hand: on every node in parallel (one ssh each), ``python3 -m venv``
            and ``pip install --no-index --find-links DIR`` of the same pins. The nodes read the
            wheel folder directly (the testbed shares the host's filesystem outside the private
            directory), so the baseline sends nothing over the network: it is flattered.

Targets on this machine: 8 fresh nodes <= 60 s and <= 0.3x the baseline; re-sync <= 2 s.
Needs root.

    python bench/env_sync.py [--nodes 3,8] [--wheels DIR] [--relay-above N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.testbed import Testbed  # noqa: E402
from torchherd.envs.resolve import parse_wheel  # noqa: E402

TARGET_S, TARGET_RATIO, TARGET_RESYNC_S = 60.0, 0.3, 2.0


def wheel_folder(given: str | None) -> Path:
    if given:
        return Path(given)
    import importlib.metadata

    try:  # the torch build this machine runs (the CPU one here), not the index's newest
        torch = f"torch=={importlib.metadata.version('torch')}"
    except importlib.metadata.PackageNotFoundError:
        torch = "torch"
    folder = Path(tempfile.mkdtemp(prefix="herd-env-bench-"))
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", torch, "numpy", "-d", str(folder)],
        check=True,
    )
    return folder


def pins(folder: Path) -> list[str]:
    found = [parse_wheel(path.name) for path in sorted(folder.glob("*.whl"))]
    return [f"{w.name}=={w.version}" for w in found if w is not None]


def herd(args: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "torchherd", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=dict(os.environ, HERD_HOME=str(cwd)),
    )
    return time.monotonic() - started, done


def one(count: int, folder: Path, req: list[str], relay_above: int | None) -> dict[str, float]:
    with Testbed(count, hosts_loopback=False, private_dirs=True) as bed:
        work = bed.tmp / "bench"
        work.mkdir()
        cluster = bed.write_cluster_file(work / "herd.toml")
        (work / "req.txt").write_text("\n".join(req) + "\n")
        args = [
            "env",
            "sync",
            "--lock",
            "req.txt",
            "--wheels",
            str(folder),
            "-c",
            str(cluster),
            "--root",
            f"{bed.private}/herd",
            "--json",
        ]
        if relay_above is not None:
            args += ["--relay-above", str(relay_above)]
        seconds, done = herd(args, work)
        out = json.loads(done.stdout)
        if done.returncode != 0:
            raise SystemExit(f"herd env sync failed: {done.stdout}\n{done.stderr}")
        hashes = {node["after"] for node in out["nodes"]}
        sent = sum(node["bytes_sent"] for node in out["nodes"])
        resync, again = herd(args, work)
        assert {n["state"] for n in json.loads(again.stdout)["nodes"]} == {"same"}
        # Baseline: a fresh venv and pip install on every node, in parallel, same wheels.
        line = (
            f"python3 -m venv {bed.private}/by-hand && {bed.private}/by-hand/bin/pip "
            f"install --quiet --no-index --find-links {folder} " + " ".join(req)
        )
        started = time.monotonic()
        procs = [
            subprocess.Popen(
                ["ssh", "-F", str(bed.ssh_config), "-o", "BatchMode=yes", node.name, line],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for node in bed.nodes
        ]
        for proc in procs:
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"baseline failed: {err[-500:]}")
        baseline = time.monotonic() - started
        return {
            "nodes": count,
            "herd_s": seconds,
            "identical": float(len(hashes) == 1),
            "sent_mib": sent / (1 << 20),
            "resync_s": resync,
            "baseline_s": baseline,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="3,8")
    parser.add_argument("--wheels")
    parser.add_argument(
        "--relay-above",
        type=int,
        help="herd env sync --relay-above N (default: herd's own threshold)",
    )
    args = parser.parse_args()
    folder = wheel_folder(args.wheels)
    req = pins(folder)
    size = sum(p.stat().st_size for p in folder.glob("*.whl")) / (1 << 20)
    print(f"environment: {len(req)} wheels, {size:.0f} MiB ({', '.join(req[:3])}, ...)")
    rows = [one(int(n), folder, req, args.relay_above) for n in args.nodes.split(",")]
    print(
        f"{'nodes':>5} {'herd s':>8} {'identical':>9} {'sent MiB':>9} {'re-sync s':>9} "
        f"{'baseline s':>10} {'ratio':>6}"
    )
    ok = True
    for row in rows:
        ratio = row["herd_s"] / row["baseline_s"]
        print(
            f"{row['nodes']:>5} {row['herd_s']:>8.1f} {'yes' if row['identical'] else 'NO':>9} "
            f"{row['sent_mib']:>9.0f} {row['resync_s']:>9.2f} {row['baseline_s']:>10.1f} "
            f"{ratio:>6.2f}"
        )
        if row["nodes"] == 8:
            met = row["herd_s"] <= TARGET_S and ratio <= TARGET_RATIO
            print(
                f"target (8 nodes <= {TARGET_S:.0f} s and <= {TARGET_RATIO}x baseline): "
                f"{'met' if met else 'not met'}"
            )
            ok &= met
        met = row["resync_s"] <= TARGET_RESYNC_S
        print(
            f"target (re-sync of {row['nodes']} nodes <= {TARGET_RESYNC_S:.0f} s): "
            f"{'met' if met else 'not met'}"
        )
        ok &= met
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
