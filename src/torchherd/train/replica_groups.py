"""Replica groups inside a training script: torchft's Manager from the variables herd sets.

Under ``herd launch --replica-groups`` every node (or every ``--group-nodes K`` nodes) runs its
own group (its own torchrun, its own store) and the groups keep each other's weights equal
through torchft: each step starts a
quorum with the live groups (a group that is behind heals, by copying a live peer's
state), the gradients are averaged over the groups that take part, and a step is committed
only where every all-reduce of it succeeded. A group that dies mid-step makes the survivors
drop that one step and go on without it; nothing restarts.

Why not ``torchft.DistributedDataParallel``: in torchft 0.2.0 its communication hook crashes
every survivor when a peer dies during the gradient all-reduce (``assert fut._fut``). This
module uses the Manager's own ``allreduce``, which turns such an error into a step that is not
committed (``should_commit()`` is False), the documented lower-level path.

A group of several workers: inside it the Trainer's own DDP averages the gradients over the
group's ranks (torchrun's process group, as in any job), then each rank averages its result with
the same rank of the other groups (the Manager's all-reduce; torchft's Manager makes one
per rank, with the group's store and rank from torchrun's variables), so every rank ends with
the mean over all groups' ranks. Each group's rank 0 talks to the lighthouse; a rank that is
behind heals from the same rank of a live group; a step is committed only when every rank of
every group in the quorum says so.

Variables herd provides (plain scripts read the same, see the README's recipe):
    TORCHFT_LIGHTHOUSE   http://ADDR:PORT of the lighthouse herd runs and restarts
    TORCHFT_QUORUM_RETRIES  so that a group waits for a restarted lighthouse
    HERD_REPLICA_GROUP   this group's number, 0 .. HERD_REPLICA_GROUPS - 1 (also
                         REPLICA_GROUP_ID / NUM_REPLICA_GROUPS, the names torchft's examples use)
    HERD_GROUP_ADDR      the address this node is reached at (advertised to the other groups,
                         instead of a hostname that may resolve to a loopback address)

Only scripts run by herd import this (it needs torch and torchft: ``pip install
'torchherd[ft]'``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp

from .errors import TrainError

GROUP_VAR = "HERD_REPLICA_GROUP"
GROUPS_VAR = "HERD_REPLICA_GROUPS"
ADDR_VAR = "HERD_GROUP_ADDR"
LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"

__all__ = ["GroupEnv", "ReplicaGroups", "group_env"]


@dataclass(frozen=True, slots=True)
class GroupEnv:
    """Where this process sits among the replica groups (from herd's variables)."""

    group: int
    """This group's number: its data shard."""
    groups: int
    """How many groups the job started with: the number of data shards."""
    lighthouse: str
    addr: str | None
    """The address the other groups reach this node at (None: torchft's hostname)."""


def group_env(environ: dict[str, str] | None = None) -> GroupEnv | None:
    """This process's replica group, or None when the job does not run as replica groups."""
    env = os.environ if environ is None else environ
    if not env.get(GROUPS_VAR) or not env.get(LIGHTHOUSE_VAR):
        return None
    return GroupEnv(
        group=int(env.get(GROUP_VAR, "0")),
        groups=int(env[GROUPS_VAR]),
        lighthouse=env[LIGHTHOUSE_VAR],
        addr=env.get(ADDR_VAR) or None,
    )


class ReplicaGroups:
    """torchft's Manager for one worker of a group, with a step API the Trainer calls:
    ``begin()`` before the forward pass, ``commit(params)`` after the backward pass (True:
    step the optimizer)."""

    def __init__(
        self,
        where: GroupEnv,
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        timeout: timedelta = timedelta(seconds=30),
    ) -> None:
        try:
            from torchft import Manager, ProcessGroupGloo
        except ImportError:
            raise TrainError(
                "this job runs as replica groups, but torchft is not installed on this node",
                remedy="pip install 'torchherd[ft]' on every node (herd exec -- pip install ...)",
            ) from None
        self.where = where
        extra = {"hostname": where.addr} if where.addr else {}
        # Collectives wait TORCHFT_TIMEOUT_SEC (herd sets a short one: a quorum formed just
        # after a loss may still name the dead group, and setting up its process group waits
        # that long); the weights a rejoining group copies keep ``timeout``.
        collective = timedelta(
            seconds=float(os.environ.get("TORCHFT_TIMEOUT_SEC", timeout.total_seconds()))
        )
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=collective),
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=1,
            # Asynchronous quorum (torchft's default): a group that is behind copies a live
            # group's state in the background, takes part in that step's all-reduce with zeros,
            # and loads the state at should_commit. A synchronous heal would wait for the live
            # groups' state while they wait for it in the all-reduce, until the timeout.
            use_async_quorum=True,
            # torchft's own start (init_sync) copies a "primary" group's state at step 0, but
            # it picks that group by the worker's rank (rank 0 from group 0, rank 1 from group
            # 1, ...), and the copying workers add zeros to that step's all-reduce: with
            # several workers per group, a group's workers end with different weights. The
            # groups agree on their start weights in ``commit`` instead.
            init_sync=False,
            timeout=timeout,
            replica_id=f"group{where.group}",
            **extra,
        )

    def resume_at(self, step: int) -> None:
        """After a snapshot was loaded: the quorum compares steps, so a group resumed from
        herd's snapshot (every group had died) counts from there, never from step 0."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin(self) -> None:
        """Join this step's quorum (a group that is behind heals during the step)."""
        self.manager.start_quorum()

    def commit(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Average the gradients over the groups of this step's quorum; True when the step
        may be taken (every all-reduce succeeded everywhere), False when it is dropped
        (the gradients are zeroed: they may hold a partial sum).

        Until the first step is committed, the groups also take the first group's weights
        (``_first_weights``), so groups that started from different weights train one model.
        """
        params = list(params)
        grads = [p.grad for p in params if p.grad is not None]
        first = self._first_weights(params)
        works = [self.manager.allreduce(g) for g in grads]
        for work in works:
            work.wait()
        if self.manager.should_commit():
            if first is not None:
                with torch.no_grad():
                    for param, weights in zip(params, first, strict=True):
                        param.copy_(weights)
            return True
        for g in grads:
            g.zero_()
        return False

    def _first_weights(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor] | None:
        """At the start (every group of the quorum at step 0), the weights of the quorum's
        first group, for every worker of every group: its workers add their weights, the
        others zeros, to one sum. None once a step has been committed.

        Every group of a quorum makes the same choice: a group at step 0 that is not healing
        is at the quorum's highest step, so all of them are at 0; a group that heals instead
        copies a live group's whole state (torchft). The result is applied only when the step
        commits, so a group lost during the sum leaves nobody with a partial one."""
        self.manager.wait_quorum()
        if self.manager.current_step() != 0 or not self.manager.is_participating():
            return None
        source = self.manager.participating_rank() == 0
        weights = [p.detach().clone() if source else torch.zeros_like(p) for p in params]
        for work in [self.manager.allreduce(w, reduce_op=ReduceOp.SUM) for w in weights]:
            work.wait()
        return weights

    @property
    def step(self) -> int:
        """The last committed step, as the groups agree on it."""
        return self.manager.current_step()

    def takes_snapshots(self) -> bool:
        """One live group writes herd's snapshots: the first of this step's quorum."""
        return self.manager.participating_rank() == 0

    def close(self) -> None:
        self.manager.shutdown(wait=False)
