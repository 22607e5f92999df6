"""All-reduce bandwidth: `herd bench allreduce` vs a bare torch.distributed loop started by
hand, on the namespace testbed (needs root, like the integration tests).

  - herd:     `herd bench allreduce` (a herd job: plan, node agents, torchrun, Gloo)
  - baseline: the same all-reduce loop (same sizes, warm-up and timed rounds, slowest rank's
              time) in a plain script, torchrun started on every node with plain ssh and the
              address and interface fixes typed by hand
Runs alternate (baseline, herd, ...); the median bus bandwidth at each size is compared.
Prints `ratio = herd / baseline` at the largest size; the target is >= 0.95.

    python bench/allreduce_overhead.py [--nodes 3] [--max-size 16M] [--iters 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.launch import start_by_hand  # noqa: E402
from tests.testbed import Testbed  # noqa: E402
from torchherd.bench.allreduce import AllreduceOptions, bench_allreduce  # noqa: E402
from torchherd.spec import load_cluster_file  # noqa: E402

BARE = """\
import json, sys, time
import torch
import torch.distributed as dist

sizes, iters = [int(s) for s in sys.argv[1].split(",")], int(sys.argv[2])
dist.init_process_group("gloo")
world = dist.get_world_size()
rows = []
for size in sizes:
    tensor = torch.zeros(size // 4)
    for _ in range(2):
        dist.all_reduce(tensor)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    elapsed = torch.tensor([(time.perf_counter() - started) / iters])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    algbw = size / float(elapsed.item()) / 1e9
    rows.append({"size_bytes": size, "busbw_gbytes": algbw * 2 * (world - 1) / world})
if dist.get_rank() == 0:
    print("BARE " + json.dumps(rows), flush=True)
dist.destroy_process_group()
"""


def run_baseline(
    bed: Testbed, nodes: int, workdir: Path, sizes: list[int], iters: int, port: int
) -> dict[int, float]:
    script = f"bare.py {','.join(map(str, sizes))} {iters}"
    processes = start_by_hand(bed, nodes, 1, workdir, port, f"bare{port}", script)
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    if any(p.returncode for p in processes):
        raise RuntimeError("the bare torchrun loop failed")
    line = next(x for out in outputs for x in out.splitlines() if x.startswith("BARE "))
    return {row["size_bytes"]: row["busbw_gbytes"] for row in json.loads(line[5:])}


def run_herd(cluster_file: Path, options: AllreduceOptions) -> dict[int, float]:
    result = bench_allreduce(load_cluster_file(cluster_file), options)
    if not result.correct:
        raise RuntimeError("herd bench allreduce returned wrong sums")
    return {row.size_bytes: row.busbw_gbytes for row in result.rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--max-size", type=int, default=16 << 20)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    options = AllreduceOptions(
        min_size=1 << 10, max_size=args.max_size, factor=16, iters=args.iters
    )
    sizes = options.sizes()
    with Testbed(args.nodes) as bed, tempfile.TemporaryDirectory(prefix="herd-bench-") as scratch:
        workdir = Path(scratch)
        (workdir / "bare.py").write_text(BARE)
        cluster_file = bed.write_cluster_file(
            workdir / "herd.toml",
            nodes=[n.name for n in bed.nodes[: args.nodes]],
            workdir=str(workdir),
            env={"HERD_HOME": str(workdir / "home")},
        )
        base: dict[int, list[float]] = {s: [] for s in sizes}
        herd: dict[int, list[float]] = {s: [] for s in sizes}
        for repeat in range(args.repeats):
            for size, value in run_baseline(
                bed, args.nodes, workdir, sizes, args.iters, 29450 + repeat
            ).items():
                base[size].append(value)
            for size, value in run_herd(cluster_file, options).items():
                herd[size].append(value)
            largest = sizes[-1]
            print(
                f"run {repeat + 1}: busbw at {largest >> 20} MiB: baseline "
                f"{base[largest][-1]:.3f} GB/s   herd {herd[largest][-1]:.3f} GB/s",
                flush=True,
            )
    print(
        f"\n{args.nodes} nodes x 1 worker, Gloo, {args.iters} timed rounds per size, "
        f"{args.repeats} runs each (median bus bandwidth, GB/s):"
    )
    print(f"  {'size':>10}  {'baseline':>9}  {'herd':>9}  ratio")
    for size in sizes:
        b, h = statistics.median(base[size]), statistics.median(herd[size])
        print(f"  {size:>10}  {b:>9.3f}  {h:>9.3f}  {h / b:.3f}")
    ratio = statistics.median(herd[sizes[-1]]) / statistics.median(base[sizes[-1]])
    print(
        f"ratio at the largest size = {ratio:.3f}  (target >= 0.95: "
        f"{'met' if ratio >= 0.95 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
