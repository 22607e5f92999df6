"""Checks over one node's facts: ssh, python, torch, workdir, workers, GPUs, NIC, name, disk,
credential files. Each returns one CheckResult with a one-line remedy when it is not a pass.

They run on facts already gathered, so they are pure and cheap; the doctor calls all of them,
`herd launch` only the fast subset (see ``fast_checks`` in ``__init__``).
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from typing import Any

from ..facts import NodeFacts
from ..plan import NodePlan
from ..spec import NodeSpec
from .findings import Findings, PlanOutcome
from .report import CheckResult, Status

GIB = 1 << 30
# NICs that carry no traffic between machines, or carry it slowly and only by accident.
VIRTUAL_NIC = re.compile(r"^(lo|docker\d*|br-|virbr|veth|cni|flannel|vxlan|lxc|lxd|podman|kube)")


def _result(
    check: str, host: str, status: Status, summary: str, remedy: str = "", **data: Any
) -> CheckResult:
    return CheckResult(check, host, status, summary, remedy, data)


def torch_facts(facts: NodeFacts) -> dict[str, Any]:
    """The full probe's torch import result ({} from a quick probe)."""
    value = facts.extra.get("torch")
    return value if isinstance(value, dict) else {}


def ssh(node: NodeSpec, findings: Findings) -> CheckResult:
    failure = findings.unreachable.get(node.host)
    if failure is None:
        return _result("ssh", node.host, Status.PASS, "reachable, key accepted")
    return _result(
        "ssh",
        node.host,
        Status.FAIL,
        failure.describe().split(": ", 1)[-1],
        failure.remedy,
        reason=failure.reason,
    )


def python(node: NodeSpec, findings: Findings) -> CheckResult:
    host = node.host
    if host in findings.unreachable:
        return _result("python", host, Status.SKIP, "not reachable")
    failure = findings.probe_failures.get(host)
    if failure is None:
        facts = findings.facts[host]
        return _result(
            "python",
            host,
            Status.PASS,
            f"Python {facts.python_version} ({facts.python}), torchherd {facts.torchherd_version}",
        )
    py = failure.python
    if failure.kind == "no-python":
        return _result(
            "python",
            host,
            Status.FAIL,
            f"{py} not found",
            "install Python 3.11+ there, or set python in [cluster] (or in this "
            "[[node]]) to the interpreter's full path",
        )
    if failure.kind == "old-python":
        return _result(
            "python",
            host,
            Status.FAIL,
            f"{py} is Python {failure.python_version}; torchherd needs 3.11+",
            "point python for this node at a Python 3.11+ environment",
        )
    if failure.kind == "no-torchherd":
        missing = "torchherd" + (" and torch are" if failure.has_torch is False else " is")
        version = f" (Python {failure.python_version})" if failure.python_version else ""
        packages = "torchherd torch" if failure.has_torch is False else "torchherd"
        return _result(
            "python",
            host,
            Status.FAIL,
            f"{missing} not installed for {py}{version}",
            f"install them there (`herd exec -- {py} -m pip install {packages}`), or "
            "point python for this node at an environment that has them",
        )
    if failure.kind == "timeout":
        return _result(
            "python",
            host,
            Status.FAIL,
            f"the probe did not answer: {failure.detail}",
            "check the node's load and disk (`herd exec -- uptime`)",
        )
    return _result(
        "python",
        host,
        Status.FAIL,
        f"the probe failed: {failure.detail}",
        f"see the whole error with `ssh {host} {shlex.quote(py)} -m torchherd.agent probe`",
    )


def torch(node: NodeSpec, findings: Findings) -> CheckResult:
    host = node.host
    facts = findings.facts.get(host)
    if facts is None:
        failure = findings.probe_failures.get(host)
        if failure is not None and failure.has_torch is False:
            return _result(
                "torch",
                host,
                Status.FAIL,
                f"torch is not installed for {failure.python}",
                f"install it there (`{failure.python} -m pip install torch`)",
            )
        return _result("torch", host, Status.SKIP, "not probed")
    info = torch_facts(facts)
    if facts.torch_version is None and not info.get("ok"):
        return _result(
            "torch",
            host,
            Status.FAIL,
            f"torch is not installed for {facts.python}",
            "install it there, or point python for this node at an environment that has it",
        )
    if not findings.full_probe:
        return _result("torch", host, Status.PASS, f"torch {facts.torch_version}")
    if not info.get("ok"):
        return _result(
            "torch",
            host,
            Status.FAIL,
            f"torch {facts.torch_version} does not import: {info.get('error')}",
            f"reinstall torch for {facts.python} (`pip install --force-reinstall torch`)",
        )
    if info.get("distributed") is False:
        return _result(
            "torch",
            host,
            Status.FAIL,
            "torch was built without torch.distributed",
            "install an official torch build (pip install torch)",
        )
    gpus = nvidia_gpus(facts)
    if (gpus or facts.gpu_count) and not info.get("cuda_available"):
        why = "a CPU-only build" if not info.get("cuda") else "the driver may be too old for it"
        return _result(
            "torch",
            host,
            Status.FAIL,
            f"the node has GPUs but torch {info.get('version')} cannot use them "
            f"({why}; {info.get('cuda_error', 'cuda unavailable')})",
            "install the torch build for this node's CUDA driver "
            "(https://pytorch.org/get-started/locally/)",
        )
    parts = [f"torch {info.get('version')}"]
    if info.get("cuda"):
        parts.append(f"CUDA {info['cuda']}")
    if info.get("nccl"):
        parts.append(f"NCCL {info['nccl']}")
    parts.append(
        "GPUs: " + str(info.get("device_count", 0)) if info.get("cuda_available") else "Gloo (CPU)"
    )
    return _result("torch", host, Status.PASS, ", ".join(parts), cached=bool(info.get("cached")))


def workdir(node: NodeSpec, findings: Findings) -> CheckResult:
    facts = findings.facts.get(node.host)
    if facts is None or facts.workdir_exists is None:
        why = "no [cluster] workdir" if facts is not None else "not probed"
        return _result("workdir", node.host, Status.SKIP, why)
    if facts.workdir_exists:
        return _result("workdir", node.host, Status.PASS, f"{facts.workdir} exists")
    return _result(
        "workdir",
        node.host,
        Status.FAIL,
        f"working directory {facts.workdir} does not exist",
        "`herd sync` the project there, or set [cluster] workdir",
    )


def entry(node: NodeSpec, findings: Findings) -> CheckResult:
    """The job's script (relative to the workdir), ``-m`` module, or ``--no-python`` program
    (by path, else on the node's PATH), for the node's python."""
    facts = findings.facts.get(node.host)
    if facts is None or not facts.entry or facts.workdir_exists is False:
        return _result("entry", node.host, Status.SKIP, "not asked, or no workdir")
    where = facts.workdir or "the working directory"
    # On this machine alone there is nothing to sync to: the fix is here.
    alone = findings.cluster.transport == "local"
    if "module" in facts.entry:
        name = facts.entry["module"]
        if facts.entry.get("found"):
            return _result("entry", node.host, Status.PASS, f"module {name} found")
        if alone:
            remedy = (
                f"run herd from the directory that holds {name.split('.')[0]}, or install it "
                f"for this python (`{facts.python} -m pip install ...`)"
            )
        else:
            remedy = (
                f"install it for that python (`herd exec -- {facts.python} -m pip install "
                "...`), or `herd sync` the project to the workdir"
            )
        return _result(
            "entry",
            node.host,
            Status.FAIL,
            f"module {name} is not importable by {facts.python} (run from {where})",
            remedy,
        )
    if "program" in facts.entry:
        program = facts.entry["program"]
        if facts.entry.get("found"):
            return _result("entry", node.host, Status.PASS, f"{program} found")
        how = "on the PATH" if "/" not in program else f"as an executable file in {where}"
        return _result(
            "entry",
            node.host,
            Status.FAIL,
            f"program {program} not found {how}",
            "give its path relative to the working directory (and chmod +x it), or install it "
            "on the node",
        )
    script = facts.entry.get("script", "")
    if facts.entry.get("found"):
        return _result("entry", node.host, Status.PASS, f"{script} found in {where}")
    remedy = (
        "give its path relative to this directory"
        if alone
        else "`herd sync` the project there, or set [cluster] workdir to where the script is"
    )
    return _result(
        "entry",
        node.host,
        Status.FAIL,
        f"script {script} not found in {where} ({facts.entry.get('path')} does not exist)",
        remedy,
    )


def planned_nproc(node: NodeSpec, findings: Findings, facts: NodeFacts) -> int:
    """Workers the plan would start here: --nproc, else the node's nproc, else its GPUs, else 1."""
    return findings.nproc or node.nproc or facts.gpu_count or 1


def _fewer_workers(findings: Findings, node: NodeSpec, most: int) -> str:
    """The fix for too many workers, where the number came from: --nproc on the command
    line, else the node's nproc in the cluster file."""
    if findings.nproc:
        return f"use --nproc {most} (or fewer)"
    return f"set nproc = {most} (or fewer) for {node.host} in {findings.cluster.source}"


def workers(node: NodeSpec, findings: Findings) -> CheckResult:
    host = node.host
    facts = findings.facts.get(host)
    if facts is None:
        return _result("workers", host, Status.SKIP, "not probed")
    nproc = planned_nproc(node, findings, facts)
    info = torch_facts(facts)
    gpus = int(info["device_count"]) if info.get("cuda_available") else facts.gpu_count
    where = "--nproc" if findings.nproc else ("nproc in the cluster file" if node.nproc else "")
    if gpus:
        if nproc > gpus:
            return _result(
                "workers",
                host,
                Status.FAIL,
                f"{nproc} workers asked ({where}) but only {gpus} GPU(s) visible: two "
                "ranks on one GPU fail in NCCL",
                f"{_fewer_workers(findings, node, gpus)}, or check CUDA_VISIBLE_DEVICES there",
                nproc=nproc,
                gpus=gpus,
            )
        return _result(
            "workers",
            host,
            Status.PASS,
            f"{nproc} worker(s) on {gpus} GPU(s)",
            nproc=nproc,
            gpus=gpus,
        )
    cores = facts.cpu_count
    if nproc > cores:
        return _result(
            "workers",
            host,
            Status.WARN,
            f"{nproc} workers asked ({where or 'default'}) but only {cores} CPU "
            "core(s): workers will fight over the cores",
            _fewer_workers(findings, node, cores),
            nproc=nproc,
            cores=cores,
        )
    return _result(
        "workers",
        host,
        Status.PASS,
        f"{nproc} worker(s) on {cores} CPU core(s)",
        nproc=nproc,
        cores=cores,
    )


def nvidia_gpus(facts: NodeFacts) -> list[dict[str, Any]]:
    """GPUs nvidia-smi listed that this node's workers would see (CUDA_VISIBLE_DEVICES)."""
    gpus = [g for g in facts.extra.get("gpus") or [] if "error" not in g]
    visible = facts.env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    wanted = {entry.strip() for entry in visible.split(",") if entry.strip()}
    return [g for g in gpus if str(g.get("index")) in wanted or g.get("uuid") in wanted]


def gpus_busy(node: NodeSpec, findings: Findings) -> CheckResult:
    host = node.host
    facts = findings.facts.get(host)
    if facts is None:
        return _result("gpus", host, Status.SKIP, "not probed")
    errors = [g["error"] for g in facts.extra.get("gpus") or [] if "error" in g]
    if errors:
        return _result(
            "gpus",
            host,
            Status.WARN,
            f"nvidia-smi failed: {errors[0]}",
            "run nvidia-smi on the node; reinstall or reload the NVIDIA driver",
        )
    gpus = nvidia_gpus(facts)
    if not gpus:
        return _result("gpus", host, Status.SKIP, "no NVIDIA GPUs")
    uuids = {g.get("uuid") for g in gpus}
    apps = [a for a in facts.extra.get("gpu_processes") or [] if a.get("gpu_uuid") in uuids]
    busy = [g for g in gpus if (g.get("utilization") or 0) >= findings.limits.busy_utilization]
    if apps or busy:
        shown = ", ".join(
            f"{a['name']} (pid {a['pid']}, {a.get('used_mib') or '?'} MiB)" for a in apps[:3]
        )
        loaded = ", ".join(f"GPU {g['index']} {g['utilization']}%" for g in busy)
        what = "; ".join(part for part in (shown and f"in use by {shown}", loaded) if part)
        return _result(
            "gpus",
            host,
            Status.WARN,
            f"GPUs busy: {what}",
            "wait for those processes, or choose free GPUs with CUDA_VISIBLE_DEVICES "
            "in [cluster] env",
            processes=len(apps),
        )
    name = gpus[0].get("name", "GPU")
    return _result("gpus", host, Status.PASS, f"{len(gpus)} x {name} idle")


def nic(node: NodeSpec, findings: Findings, outcome: PlanOutcome) -> CheckResult:
    """The NIC NCCL/Gloo would use here (the plan's choice), and whether it can carry the job."""
    host = node.host
    facts = findings.facts.get(host)
    if facts is None:
        return _result("nic", host, Status.SKIP, "not probed")
    if findings.cluster.transport == "local":
        return _result("nic", host, Status.SKIP, "standalone: no traffic between machines")
    if host in outcome.no_route:
        return _result(
            "nic",
            host,
            Status.FAIL,
            outcome.no_route[host],
            "give this node an addr (and iface) in the cluster file, or fix its routes",
        )
    planned = node_plan(outcome, host)
    if planned is None:
        return _result("nic", host, Status.SKIP, outcome.error or "no plan")
    configured = {**findings.cluster.env, **facts.env}
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = configured.get(var)
        if value and not _ifname_matches(value, [i.name for i in facts.interfaces]):
            return _result(
                "nic",
                host,
                Status.FAIL,
                f"{var}={value} matches no interface here "
                f"({', '.join(i.name for i in facts.interfaces)})",
                f"unset {var} and let herd choose per node, or set iface for this node",
            )
    iface = planned.iface or "?"
    interface = next((i for i in facts.interfaces if i.name == iface), None)
    summary = f"{iface} {planned.local_addr}"
    if (interface is not None and interface.loopback) or VIRTUAL_NIC.match(iface):
        return _result(
            "nic",
            host,
            Status.WARN,
            f"{summary}: a loopback or virtual bridge NIC, slow or unreachable from other machines",
            f"set iface (and addr) for {host} in the cluster file to its real network NIC",
            iface=iface,
        )
    return _result("nic", host, Status.PASS, summary, iface=iface, addr=planned.local_addr)


def _ifname_matches(value: str, names: list[str]) -> bool:
    """NCCL_SOCKET_IFNAME semantics: comma-separated prefixes, =exact, ^exclusions (not judged)."""
    if value.startswith("^"):
        return True
    for entry in value.split(","):
        exact = entry.startswith("=")
        wanted = entry.lstrip("=")
        if any(name == wanted if exact else name.startswith(wanted) for name in names):
            return True
    return False


def node_plan(outcome: PlanOutcome, host: str) -> NodePlan | None:
    if outcome.plan is None:
        return None
    return next((n for n in outcome.plan.nodes if n.host == host), None)


def hostname(node: NodeSpec, findings: Findings, outcome: PlanOutcome) -> CheckResult:
    host = node.host
    facts = findings.facts.get(host)
    if facts is None:
        return _result("hostname", host, Status.SKIP, "not probed")
    if findings.cluster.transport == "local":
        return _result("hostname", host, Status.SKIP, "standalone: no other node looks it up")
    name = facts.hostname
    addresses = facts.hostname_addresses
    planned = node_plan(outcome, host)
    addr = planned.local_addr if planned else None
    loopback = [a for a in addresses if _is_loopback(a)]
    if loopback:
        instead = f"--local-addr={addr}" if addr else "--local-addr"
        return _result(
            "hostname",
            host,
            Status.WARN,
            f"own name {name} resolves to {loopback[0]}: plain torchrun would "
            "advertise that as MASTER_ADDR and the other nodes would hang; herd's "
            f"plan avoids it with {instead}",
            "nothing to do for herd; for plain torchrun and other tools, map each "
            f"node's name to its LAN address in /etc/hosts instead of {loopback[0]}",
            addresses=list(addresses),
        )
    if not addresses:
        return _result(
            "hostname",
            host,
            Status.WARN,
            f"its own name {name} does not resolve",
            f"add {name} to /etc/hosts with its LAN address",
        )
    return _result("hostname", host, Status.PASS, f"{name} -> {', '.join(addresses)}")


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def disk(node: NodeSpec, findings: Findings) -> CheckResult:
    host = node.host
    facts = findings.facts.get(host)
    info = facts.extra.get("disk") if facts is not None else None
    if not isinstance(info, dict):
        return _result("disk", host, Status.SKIP, "not probed")
    path = info.get("path", "?")
    if "error" in info:
        return _result(
            "disk",
            host,
            Status.WARN,
            f"cannot read free space of {path}: {info['error']}",
            "check the working directory exists and is readable",
        )
    free_gb = info.get("free_bytes", 0) / 1e9
    speed = info.get("write_mb_s")
    summary = f"{free_gb:,.0f} GB free in {path}" + (f", writes {speed:,.0f} MB/s" if speed else "")
    limits = findings.limits
    if free_gb < 1:
        return _result(
            "disk",
            host,
            Status.FAIL,
            f"only {free_gb:.2f} GB free in {path}",
            "free space there: logs and snapshots will fail to write",
            free_gb=free_gb,
        )
    if "write_error" in info:
        return _result(
            "disk",
            host,
            Status.FAIL,
            f"cannot write in {path}: {info['write_error']}",
            "make the working directory writable for the ssh user",
            free_gb=free_gb,
        )
    if free_gb < limits.min_disk_gb:
        return _result(
            "disk",
            host,
            Status.WARN,
            f"{summary} (below {limits.min_disk_gb:g} GB)",
            "free space for logs and snapshots",
            free_gb=free_gb,
        )
    if speed is not None and speed < limits.min_write_mb_s:
        return _result(
            "disk",
            host,
            Status.WARN,
            f"{summary} (slow)",
            "put the workdir or snapshot dir on a faster local disk",
            free_gb=free_gb,
            write_mb_s=speed,
        )
    return _result("disk", host, Status.PASS, summary, free_gb=free_gb, write_mb_s=speed)


def credentials(node: NodeSpec, findings: Findings) -> CheckResult:
    host = node.host
    facts = findings.facts.get(host)
    files = facts.extra.get("credentials") if facts is not None else None
    if not isinstance(files, list):
        return _result("credentials", host, Status.SKIP, "not probed")
    exposed = [f for f in files if f.get("other_readable") or f.get("group_readable")]
    if exposed:
        shown = ", ".join(f"{f['path']} ({f['mode']})" for f in exposed)
        s3fs = " (s3fs refuses such a file)" if any("s3fs" in f["path"] for f in exposed) else ""
        return _result(
            "credentials",
            host,
            Status.WARN,
            f"credential files readable by other users: {shown}{s3fs}",
            "chmod 600 " + " ".join(f["path"] for f in exposed),
            files=[f["path"] for f in exposed],
        )
    found = f"{len(files)} credential file(s), all private" if files else "no credential files"
    return _result("credentials", host, Status.PASS, found)
