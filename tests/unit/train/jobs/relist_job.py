"""Two ranks list one shared snapshot directory while another writer publishes into it.

Rank 0 lists it, then publishes step 120 there (as a replica group that trains on while this
one restarts would), and only then does rank 1 list it: rank 0 saw [100], rank 1 [120, 100].
Writes, per rank, the steps the ranks agreed on (or the error they met) to rank-N.json beside
the directory."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchherd.train import Snapshotter
from torchherd.train.dist import Context
from torchherd.train.errors import SnapshotError

directory = Path(sys.argv[1])
published = directory.parent / "published"
dist.init_process_group("gloo")
rank = dist.get_rank()
# The other writer: a process of its own world (one rank), writing the same directory.
other = Snapshotter(directory, ctx=Context(0, 0, 1, torch.device("cpu")))
if rank == 0:
    other.save(100, {"w": torch.zeros(2)})
dist.barrier()


class OrderedListing(Snapshotter):
    """The first listing of each rank in the order above; the listing itself is the real one."""

    first = True

    def _candidates(self) -> list[int]:
        if self.first and rank == 1:
            while not published.exists():
                time.sleep(0.01)
        found = super()._candidates()
        if self.first and rank == 0:
            other.save(120, {"w": torch.ones(2)})
            published.touch()
        self.first = False
        return found


snapshots = OrderedListing(directory)
try:
    agreed, _ = snapshots._agree_on_candidates(snapshots._candidates())
    said: dict[str, object] = {"agreed": agreed}
except SnapshotError as exc:
    said = {"error": str(exc)}
(directory.parent / f"rank-{rank}.json").write_text(json.dumps(said))
dist.destroy_process_group()
