"""`herd top`: every node's load, from the ``top`` agent verb (see ``agent/sample.py``).

``sample_once`` asks each node for one sample (the agent measures CPU and step rate over a
short window); ``follow`` keeps one ssh session per node open, each printing a sample every
interval, so a live view costs no new connection and no interpreter start per refresh.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..agent.protocol import decode
from ..spec import ClusterSpec, NodeSpec
from ..transport import Transport, Unreachable, for_cluster
from ..transport.agent_call import AgentAnswer, agent_argv, call_agent


@dataclass(frozen=True)
class NodeLoad:
    """One node's sample, reduced to what the table shows."""

    host: str
    error: str | None = None
    cpu_percent: float | None = None
    cpu_count: int | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    gpus: tuple[dict[str, Any], ...] = ()
    jobs: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_answer(cls, answer: AgentAnswer) -> NodeLoad:
        if not answer.ok or answer.data is None:
            return cls(answer.host, error=answer.error or "no answer")
        return cls.from_sample(answer.host, answer.data)

    @classmethod
    def from_sample(cls, host: str, data: dict[str, Any]) -> NodeLoad:
        memory = data.get("memory") or {}
        return cls(
            host,
            cpu_percent=data.get("cpu_percent"),
            cpu_count=data.get("cpu_count"),
            mem_used=memory.get("used"),
            mem_total=memory.get("total"),
            gpus=tuple(data.get("gpus") or ()),
            jobs=tuple(data.get("jobs") or ()),
        )

    def gpu_summary(self) -> dict[str, float | int | None]:
        """Mean utilisation, summed memory and power, hottest temperature over the GPUs."""

        def values(key: str) -> list[float]:
            return [float(g[key]) for g in self.gpus if g.get(key) is not None]

        util, temp, power = values("util"), values("temp"), values("power")
        return {
            "count": len(self.gpus),
            "util": sum(util) / len(util) if util else None,
            "mem_used": int(sum(values("mem_used"))) if self.gpus else None,
            "mem_total": int(sum(values("mem_total"))) if self.gpus else None,
            "temp": max(temp) if temp else None,
            "power": sum(power) if power else None,
        }

    def as_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "error": self.error,
            "cpu_percent": self.cpu_percent,
            "cpu_count": self.cpu_count,
            "mem_used": self.mem_used,
            "mem_total": self.mem_total,
            "gpus": list(self.gpus),
            "gpu": self.gpu_summary() if self.gpus else None,
            "jobs": list(self.jobs),
        }


def top_request(cluster: ClusterSpec, node: NodeSpec) -> dict[str, Any]:
    request: dict[str, Any] = {"node": node.name}
    if cluster.env.get("HERD_HOME"):
        request["herd_home"] = cluster.env["HERD_HOME"]
    return request


def sample_once(
    cluster: ClusterSpec, window: float = 1.0, transport: Transport | None = None
) -> list[NodeLoad]:
    """One sample from every node, in parallel."""

    async def main() -> list[NodeLoad]:
        link = transport or for_cluster(cluster)

        async def one(node: NodeSpec) -> NodeLoad:
            unreachable = await link.connect(node)
            if unreachable is not None:
                return NodeLoad(node.host, error=unreachable.describe())
            request = top_request(cluster, node) | {"window": window}
            return NodeLoad.from_answer(await call_agent(link, node, "top", request))

        try:
            return await link.each(cluster.nodes, one)
        finally:
            await link.close()

    return asyncio.run(main())


async def follow(
    cluster: ClusterSpec,
    interval: float,
    on_sample: Callable[[NodeLoad], None],
    transport: Transport | None = None,
) -> None:
    """Stream samples from every node until cancelled (one ssh session per node)."""
    link = transport or for_cluster(cluster)

    async def one(node: NodeSpec, unreachable: Unreachable | None) -> None:
        if unreachable is not None:
            on_sample(NodeLoad(node.host, error=unreachable.describe()))
            return
        process = await link.start(node, agent_argv(cluster, node, "top"))
        assert process.stdin is not None and process.stdout is not None
        request = top_request(cluster, node) | {"follow": True, "interval": interval}
        process.stdin.write(json.dumps(request).encode() + b"\n")
        try:
            async for raw in process.stdout:
                data = decode(raw)
                if data is not None:
                    on_sample(NodeLoad.from_sample(node.host, data))
            code = await process.wait()
            err = (await process.stderr.read()).decode(errors="replace") if process.stderr else ""
            last = err.strip().splitlines()[-1:] or [f"exit code {code}"]
            on_sample(NodeLoad(node.host, error=f"the agent ended: {last[0]}"))
        finally:
            if process.returncode is None:
                process.stdin.close()  # the agent leaves when its stdin closes
                try:
                    await asyncio.wait_for(process.wait(), 5)
                except TimeoutError:
                    process.kill()

    try:
        # Connect in bounded waves; then stream from all at once (a stream never ends, so it
        # must not hold one of the fan-out's slots).
        links = await link.each(cluster.nodes, link.connect)
        await asyncio.gather(*(one(n, u) for n, u in zip(cluster.nodes, links, strict=True)))
    finally:
        await link.close()


def slow_ranks() -> list[str]:
    """ "job JOB: <slow rank line>" for every running job whose launcher named a slow rank
    (from the job records on this machine)."""
    from ..records import list_records

    return [
        f"job {record.id}: slow rank: {record.slow}"
        for record in list_records()
        if record.state in ("starting", "running") and record.slow
    ]


def replica_groups(loads: list[NodeLoad]) -> list[str]:
    """One line per running job run as replica groups (``--replica-groups``): each group's
    node and step (from the samples: its node runs the group's job, ``JOB-gN``), or how long
    it has been down, from the job record the launcher on this machine keeps."""
    import time

    from ..records import list_records

    steps = {
        (load.host, str(job.get("job_id"))): job.get("step") for load in loads for job in load.jobs
    }
    lines = []
    for record in list_records():
        if record.state not in ("starting", "running") or not record.groups:
            continue
        parts = []
        for group in record.groups:
            index, host = group.get("group"), group.get("host")
            outages = group.get("outages") or []
            last = outages[-1] if outages else None
            if group.get("exit_code") == 0:
                state = "finished"
            elif last is not None and last.get("healed_s") is None:
                since = time.time() - float(last.get("down_at") or time.time())
                state = f"down {since:.0f} s (since step {last.get('steps_before')})"
            else:
                first = (group.get("nodes") or [host])[0]  # where its rank 0 logs its steps
                step = steps.get((str(first), f"{record.id}-g{index}"))
                state = f"step {step}" if step is not None else "starting"
            healed = sum(1 for o in outages if o.get("healed_s") is not None)
            back = f", back {healed}x" if healed else ""
            parts.append(f"g{index} {host} {state}{back}")
        lines.append(f"job {record.id}: replica groups: " + "; ".join(parts))
    return lines
