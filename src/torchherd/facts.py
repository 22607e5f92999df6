"""NodeFacts: what the quick probe found on one node, as a typed value."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Interface:
    name: str
    addr: str
    prefixlen: int
    up: bool = True
    loopback: bool = False

    @property
    def network(self) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        return ipaddress.ip_network(f"{self.addr}/{self.prefixlen}", strict=False)


@dataclass(frozen=True)
class Route:
    iface: str
    dest: str
    gateway: str = "0.0.0.0"
    metric: int = 0


@dataclass(frozen=True)
class NodeFacts:
    """Facts about one node, from `python -m torchherd.agent probe`."""

    host: str
    hostname: str = ""
    hostname_addresses: tuple[str, ...] = ()
    ssh_server_addr: str | None = None
    interfaces: tuple[Interface, ...] = ()
    """IPv4 addresses, one per interface."""
    ipv6: tuple[Interface, ...] = ()
    """IPv6 addresses (an interface may have several)."""
    routes: tuple[Route, ...] = ()
    python: str = ""
    python_version: str = ""
    torch_version: str | None = None
    torchherd_version: str | None = None
    env_hash: str | None = None
    """The hash of every installed distribution and the Python minor (``agent/envid.py``)."""
    gpu_count: int = 0
    cpu_count: int = 1
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    workdir_exists: bool | None = None
    port: int | None = None
    port_free: bool | None = None
    entry: dict[str, Any] = field(default_factory=dict)
    """The job's script or module as seen from the workdir: ``{"script": PATH, "path": ...,
    "found": bool}`` or ``{"module": NAME, "found": bool}``; empty when the probe was not asked."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Facts of the full probe (doctor), kept as they came."""

    @classmethod
    def from_probe(cls, host: str, data: dict[str, Any]) -> NodeFacts:
        known = {
            "hostname",
            "hostname_addresses",
            "ssh_server_addr",
            "interfaces",
            "ipv6",
            "routes",
            "python",
            "python_version",
            "torch_version",
            "torchherd_version",
            "env_hash",
            "gpu_count",
            "cpu_count",
            "env",
            "workdir",
            "workdir_exists",
            "port",
            "entry",
        }
        port = data.get("port") or {}
        return cls(
            host=host,
            hostname=data.get("hostname", ""),
            hostname_addresses=tuple(data.get("hostname_addresses", ())),
            ssh_server_addr=data.get("ssh_server_addr"),
            interfaces=tuple(Interface(**i) for i in data.get("interfaces", ())),
            ipv6=tuple(Interface(**i) for i in data.get("ipv6", ())),
            routes=tuple(Route(**r) for r in data.get("routes", ())),
            python=data.get("python", ""),
            python_version=data.get("python_version", ""),
            torch_version=data.get("torch_version"),
            torchherd_version=data.get("torchherd_version"),
            env_hash=data.get("env_hash"),
            gpu_count=int(data.get("gpu_count", 0)),
            cpu_count=int(data.get("cpu_count", 1)),
            env=dict(data.get("env", {})),
            workdir=data.get("workdir"),
            workdir_exists=data.get("workdir_exists"),
            port=port.get("port"),
            port_free=port.get("free"),
            entry=dict(data.get("entry") or {}),
            extra={k: v for k, v in data.items() if k not in known and k != "pid"},
        )

    def addresses(self) -> list[str]:
        """Every address of this node, IPv4 (interfaces that are up) and IPv6."""
        return [i.addr for i in self.interfaces if i.up] + [i.addr for i in self.ipv6]

    def interface_with(self, addr: str) -> Interface | None:
        for interface in self.interfaces:
            if interface.addr == addr:
                return interface
        return None

    def route_to(self, dest: str) -> tuple[str, str] | None:
        """(interface, source address) this node would use to reach ``dest``; None if unknown.

        Longest-prefix match over the node's routing table (as the kernel does for IPv4),
        falling back to the interface whose subnet holds ``dest``.
        """
        try:
            target = ipaddress.ip_address(dest)
        except ValueError:
            return None
        own = self.interface_with(dest)
        if own is not None:
            return own.name, own.addr
        best: tuple[int, int, str] | None = None
        for route in self.routes:
            network = ipaddress.ip_network(route.dest, strict=False)
            if target.version == network.version and target in network:
                key = (network.prefixlen, -route.metric, route.iface)
                if best is None or key[:2] > best[:2]:
                    best = key
        names = [best[2]] if best else []
        names += [i.name for i in self.interfaces if target.version == 4 and target in i.network]
        for name in names:
            for interface in self.interfaces:
                if interface.name == name and not interface.loopback:
                    return interface.name, interface.addr
        return None
