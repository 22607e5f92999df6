"""`python -m torchherd.agent probe`: facts about this node, as one JSON object on stdout.

The quick probe (what every launch runs) reads only cheap facts with the standard library:
names, addresses, routes, versions from package metadata, a free port, and whether the job's
script (or ``-m`` module) is there. It never imports torch, nor importlib.metadata (which
imports email, zipfile and more, and cost more than the rest of the probe): versions are read
from the names of the installed distributions' metadata directories.
With ``"full": true`` (herd doctor) it adds torch, CUDA, NCCL, GPUs, memory, disk and credential
files from ``probe_full``, which imports torch only in a subprocess.
"""

from __future__ import annotations

import errno
import fcntl
import importlib.machinery
import importlib.util
import ipaddress
import os
import shutil
import socket
import struct
import sys
from typing import Any

from . import envid

# ioctl request numbers from <linux/sockios.h>
_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B
_SIOCGIFFLAGS = 0x8913
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8

# Where a free rendezvous port is looked for: torchrun's usual neighbourhood, away from the
# kernel's ephemeral range (32768+) so an outgoing connection does not take it first.
PORT_RANGE = (29400, 29999)


def collect(request: dict[str, Any]) -> dict[str, Any]:
    """The quick facts; ``request`` may ask for a port check, a workdir check and an entry check
    (``{"entry": {"script": PATH}}`` or ``{"entry": {"module": NAME}}``, seen from the workdir)."""
    facts: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "hostname_addresses": _resolve(socket.gethostname()),
        "ssh_server_addr": _ssh_server_addr(),
        "interfaces": interfaces(),
        "ipv6": ipv6_addresses(),
        "routes": routes(),
        "python": sys.executable,
        "python_version": ".".join(str(v) for v in sys.version_info[:3]),
        "torch_version": _version("torch"),
        "torchherd_version": _version("torchherd"),
        # Replica groups (herd launch --replica-groups) need it; read from metadata, no import.
        "torchft_version": _version("torchft"),
        "gpu_count": gpu_count(),
        "cpu_count": _cpu_count(),
        "env": {
            key: os.environ[key]
            for key in (
                "NCCL_SOCKET_IFNAME",
                "GLOO_SOCKET_IFNAME",
                "CUDA_VISIBLE_DEVICES",
                "OMP_NUM_THREADS",
                "TORCH_NCCL_TRACE_BUFFER_SIZE",
                "TORCH_NCCL_DUMP_ON_TIMEOUT",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "ACCELERATE_USE_CPU",
            )
            if key in os.environ
        },
        "pid": os.getpid(),
    }
    workdir = request.get("workdir")
    if workdir:
        path = os.path.expanduser(workdir)
        facts["workdir"] = path
        facts["workdir_exists"] = os.path.isdir(path)
    entry = request.get("entry")
    if entry:
        facts["entry"] = find_entry(entry, facts.get("workdir") or os.getcwd())
    if "port" in request:
        facts["port"] = check_port(int(request["port"] or 0))
    environment = envid.this_environment()
    facts["env_hash"] = environment["hash"]  # `herd env`: what this python has, hashed
    if request.get("full"):
        from .probe_full import collect_full

        facts.update(collect_full(request, facts.get("workdir")))
        facts["env_packages"] = environment["packages"]  # the doctor names what differs
    return facts


def find_entry(entry: dict[str, str], workdir: str) -> dict[str, Any]:
    """Is the job's script (relative to ``workdir``) or module there, as torchrun would run it?

    A module is looked for as ``python -m`` does from the workdir (the workdir first on the path)
    without importing anything: importing a package's ``__init__`` can import torch, and the
    quick probe must stay cheap.
    """
    if "script" in entry:
        path = os.path.join(workdir, os.path.expanduser(entry["script"]))
        return {"script": entry["script"], "path": path, "found": os.path.isfile(path)}
    if "program" in entry:  # torchrun --no-python: a path from the workdir, else on PATH
        program = os.path.expanduser(entry["program"])
        if "/" in program:
            where = os.path.join(workdir, program)
            found = os.path.isfile(where) and os.access(where, os.X_OK)
            return {"program": entry["program"], "path": where, "found": found}
        on_path = shutil.which(program)
        return {"program": entry["program"], "path": on_path, "found": on_path is not None}
    name = entry["module"]
    return {"module": name, "found": _module_location(name, workdir) is not None}


def _module_location(name: str, workdir: str) -> str | None:
    """Where module ``name`` would be loaded from, found without running any package code."""
    top, *rest = name.split(".")
    sys.path.insert(0, workdir)
    try:
        # A top-level name imports nothing (no parent package); it also sees import hooks such
        # as editable installs.
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path.remove(workdir)
    for part in rest:
        spec = _submodule(spec, part)
    if spec is not None and spec.submodule_search_locations is not None:
        spec = _submodule(spec, "__main__")  # `python -m PACKAGE` runs its __main__
    return None if spec is None else (spec.origin or name)


def _submodule(
    parent: importlib.machinery.ModuleSpec | None, part: str
) -> importlib.machinery.ModuleSpec | None:
    if parent is None or not parent.submodule_search_locations:
        return None
    # PathFinder with an explicit path does not import the parent, unlike importlib.util.find_spec.
    return importlib.machinery.PathFinder.find_spec(
        f"{parent.name}.{part}", list(parent.submodule_search_locations)
    )


def _resolve(name: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return sorted({str(info[4][0]) for info in infos})


def _ssh_server_addr() -> str | None:
    # SSH_CONNECTION = "client_ip client_port server_ip server_port": the address the launcher
    # reached this node at, the best first guess for where other nodes reach it too.
    parts = os.environ.get("SSH_CONNECTION", "").split()
    return parts[2] if len(parts) == 4 else None


def _version(package: str) -> str | None:
    """The version importlib.metadata.version would give (the first distribution of that name
    on sys.path), from its ``NAME-VERSION.dist-info`` directory; importlib.metadata itself
    only where no such directory tells (an egg, a custom finder)."""
    wanted = envid.canonical(package)
    for project, version in envid.distributions(sys.path):
        if envid.canonical(project) == wanted:
            return version or _metadata_version(package)
    return _metadata_version(package)


def _metadata_version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def gpu_count() -> int:
    """NVIDIA GPUs this node's workers would see, without loading CUDA (cheap)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        devices = [
            name for name in os.listdir("/dev") if name[6:].isdigit() and name.startswith("nvidia")
        ]
    except OSError:
        devices = []
    if visible is not None:
        entries = [entry for entry in visible.split(",") if entry.strip() and entry.strip() != "-1"]
        return min(len(entries), len(devices)) if devices else 0
    return len(devices)


def interfaces() -> list[dict[str, Any]]:
    """IPv4 interfaces: name, address, prefix length, up, loopback."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            packed = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, packed)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFNETMASK, packed)[20:24])
                flags = struct.unpack(
                    "H", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, packed)[16:18]
                )[0]
            except OSError:
                continue  # no IPv4 address on this interface
            found.append(
                {
                    "name": name,
                    "addr": addr,
                    "prefixlen": ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen,
                    "up": bool(flags & _IFF_UP),
                    "loopback": bool(flags & _IFF_LOOPBACK),
                }
            )
    return found


def ipv6_addresses() -> list[dict[str, Any]]:
    """IPv6 addresses from /proc/net/if_inet6 (no ioctl gives them): name, address, prefix."""
    found = []
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) < 6 or len(fields[0]) != 32:
                    continue
                addr = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
                found.append(
                    {
                        "name": fields[5],
                        "addr": str(addr),
                        "prefixlen": int(fields[2], 16),
                        "loopback": addr.is_loopback,
                    }
                )
    except (OSError, ValueError):
        pass  # no IPv6 on this node
    return found


def routes() -> list[dict[str, Any]]:
    """The IPv4 routing table from /proc/net/route: iface, destination network, gateway."""
    found = []
    try:
        with open("/proc/net/route") as table:
            next(table)
            for line in table:
                fields = line.split()
                if len(fields) < 8:
                    continue
                dest, gateway, mask = (
                    socket.inet_ntoa(struct.pack("<I", int(value, 16)))
                    for value in (fields[1], fields[2], fields[7])
                )
                prefix = ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen
                metric = int(fields[6])
                found.append(
                    {
                        "iface": fields[0],
                        "dest": f"{dest}/{prefix}",
                        "gateway": gateway,
                        "metric": metric,
                    }
                )
    except OSError:
        pass
    return found


def check_port(port: int) -> dict[str, Any]:
    """Is ``port`` free here? With 0, find a free one in PORT_RANGE."""
    if port:
        return {"port": port, "free": _is_free(port)}
    candidates = list(range(*PORT_RANGE))
    # A random start makes two jobs launched at the same moment unlikely to pick the same port.
    start = int.from_bytes(os.urandom(4), "big") % len(candidates)
    for candidate in candidates[start:] + candidates[:start]:
        if _is_free(candidate):
            return {"port": candidate, "free": True}
    return {"port": 0, "free": False}


def _is_free(port: int) -> bool:
    """Whether the c10d store could listen on ``port``: bound the way it binds (every address,
    IPv6 dual-stack where there is IPv6, SO_REUSEADDR), so a port whose last job's connections
    linger in TIME_WAIT counts as free, as it is for the store, and one another socket listens
    on on either family does not."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this node: the store binds IPv4 only too
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                try:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                except OSError:
                    continue
            try:
                sock.bind((address, port))
            except OSError as exc:
                if family == socket.AF_INET6 and exc.errno == errno.EADDRNOTAVAIL:
                    continue  # IPv6 disabled (no :: address): try IPv4 as the store would
                return False
        return True
    return False
