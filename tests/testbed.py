"""A real multi-node cluster on one Linux machine, for the integration tests.

Each node is a network namespace plugged into a private bridge, with its own IPv4 address, its own
hostname (a UTS namespace), its own /etc/hosts (``/etc/netns/<ns>/hosts``, which ``ip netns exec``
bind-mounts over /etc/hosts) and its own sshd. The launcher (tests, the ``herd`` CLI) stays in the
root namespace and reaches the nodes over the bridge with the real OpenSSH client. Namespaces share
the filesystem and the pid namespace, so the same interpreter works on every node.

Everything a testbed creates carries a run tag that embeds the owner's pid (``hrd<kind><tag>...``),
so ``clean_stale()`` (and ``scripts/testbed-clean``) can remove leftovers of a crashed run without
touching live runs or anything else on the machine. Faults (partition, blocked ports, delay, extra
NICs) are tracked and reverted by ``reset_faults()`` and by ``close()``.

Only stdlib here: this file is also executed as a script inside a node, as the packet delayer used
when the kernel has no ``sch_netem`` (``python testbed.py _nfqueue-delay QUEUE MS``).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import ipaddress
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "TestNode",
    "Testbed",
    "TestbedError",
    "clean_stale",
    "testbed_available",
]

# Every name a testbed creates is "hrd" + kind + tag (+ node number); the tag is the owner pid in
# base 36 (5 chars, enough for pid_max 4194304) + 3 random chars. Interface names stay <= 15 chars.
_PREFIX = "hrd"
_KIND_BRIDGE, _KIND_VETH, _KIND_NS, _KIND_SINK = "b", "v", "n", "s"
_NAME_RE = re.compile(
    rf"^{_PREFIX}[{_KIND_BRIDGE}{_KIND_VETH}{_KIND_NS}{_KIND_SINK}]"
    r"(?P<tag>(?P<pid>[0-9a-z]{5})[0-9a-z]{3})(?:\d{0,3})$"
)
_TMP_PREFIX = "herd-testbed-"
_TMP_RE = re.compile(rf"^{_TMP_PREFIX}(?P<tag>(?P<pid>[0-9a-z]{{5}})[0-9a-z]{{3}})-")
_B36 = "0123456789abcdefghijklmnopqrstuvwxyz"
_NETNS_ETC = Path("/etc/netns")
_RUN_NETNS = Path("/run/netns")
_SSHD_READY_S = 10.0
_NFQUEUE_NUM = 7


class TestbedError(Exception):
    """The testbed could not be built or a fault could not be applied; the message says why."""


@dataclass
class TestNode:
    """One node of the testbed, as the tests and the launcher see it."""

    __test__ = False  # not a pytest test class, despite the name

    name: str
    """Hostname inside the node and its ssh alias: "node1", "node2", ..."""
    ns: str
    """Network namespace name."""
    addr: str
    """IPv4 address on the bridge."""
    iface: str
    """The NIC name inside the namespace."""


# --------------------------------------------------------------------------------------------
# small helpers


def _run(
    argv: list[str], *, check: bool = True, timeout: float = 30, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run a command with text output; on failure, the error carries its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise TestbedError(
            f"`{' '.join(argv)}` exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}"
        )
    return proc


def _b36(n: int, width: int) -> str:
    out = ""
    while n:
        n, r = divmod(n, 36)
        out = _B36[r] + out
    return out.rjust(width, "0")


def _pid_alive(pid: int) -> bool:
    """Whether the pid runs; a zombie (killed, not yet reaped) counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def _netns_names() -> list[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _root_links() -> list[str]:
    proc = _run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in proc.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _pids_in_netns(ns: str) -> list[int]:
    """Pids whose network namespace is `ns` (what `ip netns pids` does, without a fork)."""
    try:
        target = os.stat(_RUN_NETNS / ns)
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            pids.append(int(entry))
    return pids


def _signal_if_in_netns(pid: int, ns: str, sig: int) -> None:
    """Signal `pid` only if it is still a process in `ns`: a pidfd pins the process, so a pid
    reused by someone else's process between listing and signalling is never hit."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if pid in _pids_in_netns(ns):
            signal.pidfd_send_signal(fd, sig)
    except OSError:
        pass
    finally:
        os.close(fd)


def _kill_netns_processes(ns: str, grace: float = 2.0) -> None:
    """SIGTERM everything in the namespace, wait a little, SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace), (signal.SIGKILL, grace)):
        pids = _pids_in_netns(ns)
        if not pids:
            return
        for pid in pids:
            _signal_if_in_netns(pid, ns, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _pids_in_netns(ns):
            time.sleep(0.05)


def _remove_run(tag: str) -> list[str]:
    """Remove everything carrying `tag`: processes, veths, bridge, namespaces, /etc/netns dirs,
    temp dirs. Never raises; returns what it removed (for the cleaner's report)."""
    removed: list[str] = []
    namespaces = [ns for ns in _netns_names() if (m := _NAME_RE.match(ns)) and m["tag"] == tag]
    for ns in namespaces:
        _kill_netns_processes(ns)
    # Root-side veth ends first (that removes both ends at once), then the bridge.
    links = [name for name in _root_links() if (m := _NAME_RE.match(name)) and m["tag"] == tag]
    links.sort(key=lambda name: name[len(_PREFIX)] == _KIND_BRIDGE)
    for name in links:
        if _run(["ip", "link", "del", name], check=False).returncode == 0:
            removed.append(f"link {name}")
    for ns in namespaces:
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(f"netns {ns}")
    if _NETNS_ETC.is_dir():
        for path in _NETNS_ETC.iterdir():
            if (m := _NAME_RE.match(path.name)) and m["tag"] == tag:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(str(path))
        with contextlib.suppress(OSError):
            _NETNS_ETC.rmdir()  # only succeeds when empty: then it was ours to begin with
    for path in Path(tempfile.gettempdir()).glob(f"{_TMP_PREFIX}{tag}-*"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def clean_stale(*, dry_run: bool = False) -> list[str]:
    """Remove the leftovers of testbed runs whose owner process no longer runs.

    Returns a line per removed (or, with dry_run, removable) object. Runs of live owners are
    never touched, so concurrent test sessions do not disturb each other.
    """
    candidates: list[str] = _netns_names() + _root_links()
    if _NETNS_ETC.is_dir():
        candidates += [p.name for p in _NETNS_ETC.iterdir()]
    tags: set[str] = set()
    for name in candidates:
        if (m := _NAME_RE.match(name)) and not _pid_alive(int(m["pid"], 36)):
            tags.add(m["tag"])
    for path in Path(tempfile.gettempdir()).glob(f"{_TMP_PREFIX}*"):
        if (m := _TMP_RE.match(path.name)) and not _pid_alive(int(m["pid"], 36)):
            tags.add(m["tag"])
    if dry_run:
        return sorted(f"stale run {tag} (owner pid {int(tag[:5], 36)})" for tag in tags)
    removed: list[str] = []
    for tag in sorted(tags):
        removed += _remove_run(tag)
    return removed


def testbed_available() -> tuple[bool, str]:
    """Whether a testbed can be built here: (ok, reason). Probes by creating (and deleting) a
    throwaway namespace with a veth pair and a bridge inside it, touching nothing outside it."""
    if sys.platform != "linux":
        return False, "the testbed needs Linux network namespaces"
    if os.geteuid() != 0:
        return False, "the testbed needs root (network namespaces, sshd); run the tests as root"
    for tool in ("ip", "nsenter", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found: apt-get install iproute2 util-linux openssh-client"
    if _sshd_binary() is None:
        return False, "sshd not found: apt-get install openssh-server"
    probe = f"{_PREFIX}{_KIND_NS}{_b36(os.getpid(), 5)}zzz"
    try:
        _run(["ip", "netns", "add", probe])
        _run(
            [
                "ip",
                "-n",
                probe,
                "link",
                "add",
                "name",
                "probe0",
                "type",
                "veth",
                "peer",
                "name",
                "probe1",
            ]
        )
        _run(["ip", "-n", probe, "link", "add", "name", "probebr", "type", "bridge"])
    except (TestbedError, OSError, subprocess.SubprocessError) as exc:
        return False, f"cannot create network namespaces, veths or bridges here: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, "ok"


def _sshd_binary() -> str | None:
    # sshd refuses to re-exec itself unless started by absolute path.
    for path in ("/usr/sbin/sshd", "/usr/local/sbin/sshd"):
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("sshd")
    return str(Path(found).resolve()) if found else None


def _make_neighbour_room(nodes: int) -> None:
    """Raise the kernel's ARP table limits where a full mesh of ``nodes`` needs it (never lower).

    The table is shared by every network namespace: Gloo connects every pair of nodes, so N
    nodes hold about N*(N-1) entries, past the default limit of 1024 from 32 nodes on; the
    kernel then says "neighbour: arp_cache: neighbor table overflow!" and connections fail
    with "No route to host".
    """
    need = 2 * nodes * nodes + 1024
    for name, value in (("gc_thresh3", need), ("gc_thresh2", need // 2)):
        path = Path("/proc/sys/net/ipv4/neigh/default") / name
        with contextlib.suppress(OSError, ValueError):
            if int(path.read_text()) < value:
                path.write_text(f"{value}\n")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_str(key)


def _toml_str(value: str) -> str:
    out = ['"']
    for ch in value:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_value(value: object) -> str:
    """TOML for the few value types a herd.toml needs."""
    if isinstance(value, bool):  # before int: bool is an int
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return _toml_str(str(value))
    if isinstance(value, dict):
        items = ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


# --------------------------------------------------------------------------------------------
# the testbed


class Testbed:
    """A cluster of `nodes` namespaced nodes with real sshd; use as a context manager.

    hosts_loopback=True gives each node the stock Debian /etc/hosts line "127.0.1.1 <own name>",
    which reproduces the classic torchrun failure; the other nodes' names always map to their
    bridge addresses.
    """

    __test__ = False  # not a pytest test class, despite the name

    def __init__(
        self, nodes: int = 2, *, hosts_loopback: bool = True, private_dirs: bool = False
    ) -> None:
        if not 1 <= nodes <= 99:
            raise ValueError(f"nodes must be between 1 and 99, not {nodes}")
        self._count = nodes
        self.hosts_loopback = hosts_loopback
        self.private_dirs = private_dirs
        self.private = Path()
        """With private_dirs: a path that is a different directory on every node (and another
        on the launcher), like a home or workdir on separate machines; see ``private_of``."""
        self.tag = _b36(os.getpid(), 5) + "".join(random.choices(_B36, k=3))
        self.nodes: list[TestNode] = []
        self.tmp = Path()
        self.ssh_config = Path()
        self.subnet: ipaddress.IPv4Network | None = None
        self.bridge = f"{_PREFIX}{_KIND_BRIDGE}{self.tag}"
        self._started = False
        self._closed = False
        self._sshd: dict[str, subprocess.Popen[bytes]] = {}
        self._popens: list[subprocess.Popen[Any]] = []
        self._iptables: str | None = None
        # fault state, so reset_faults()/close() can revert exactly what was done
        self._partitioned: set[str] = set()
        self._blocked: set[tuple[str, int | str]] = set()
        self._delayed: dict[str, subprocess.Popen[str] | None] = {}  # None: netem
        self._limited: set[str] = set()
        self._nics: dict[str, set[str]] = {}
        self._nic_count = 0

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Build the bridge, the namespaces and the sshds; raise TestbedError (after cleaning
        up what was built) if anything fails."""
        if self._started:
            raise TestbedError("this testbed was already started; make a new one")
        self._started = True
        ok, reason = testbed_available()
        if not ok:
            raise TestbedError(reason)
        atexit.register(self.close)
        try:
            clean_stale()  # a crashed run must never poison this one
            self._build()
        except BaseException as exc:
            self.close()
            if isinstance(exc, TestbedError):
                raise
            if isinstance(exc, Exception):
                raise TestbedError(f"testbed start failed: {exc}") from exc
            raise

    def close(self) -> None:
        """Tear everything down; idempotent, never raises, safe on a half-built testbed."""
        if self._closed or not self._started:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._revert_faults(strict=False)
        _remove_run(self.tag)
        for proc in [*self._sshd.values(), *self._popens]:
            with contextlib.suppress(Exception):
                proc.kill()  # already dead via its namespace; this reaps it either way
                proc.wait(timeout=5)
        self._sshd.clear()
        self._popens.clear()
        if self.tmp != Path() and self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def _build(self) -> None:
        _make_neighbour_room(self._count)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{self.tag}-"))
        self.subnet = self._pick_subnet()
        hosts = list(self.subnet.hosts())
        bridge_addr = hosts[0]  # .1: lets the launcher in the root namespace reach the nodes
        self.nodes = [
            TestNode(
                name=f"node{k}",
                ns=f"{_PREFIX}{_KIND_NS}{self.tag}{k}",
                addr=str(hosts[9 + k]),
                iface="eth0",
            )
            for k in range(1, self._count + 1)
        ]
        self._make_keys()
        if self.private_dirs:
            self.private = self.tmp / "private"
            self.private.mkdir()
            for node in self.nodes:
                self.private_of(node).mkdir(parents=True)
        _run(["ip", "link", "add", "name", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{bridge_addr}/{self.subnet.prefixlen}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for k, node in enumerate(self.nodes, start=1):
            self._build_node(k, node)
        self._write_ssh_config()
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation dir
        for node in self.nodes:
            self._start_sshd(node)
        for node in self.nodes:
            self._wait_sshd(node)
        self._check_mesh()

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        """A random 10.a.b.0/24 that overlaps no address or route already on this machine."""
        used: list[ipaddress.IPv4Network] = []
        for line in _run(["ip", "-o", "-4", "addr", "show"]).stdout.splitlines():
            if m := re.search(r"inet (\S+)", line):
                used.append(ipaddress.IPv4Interface(m[1]).network)
        for line in _run(["ip", "-4", "route", "show", "table", "all"]).stdout.splitlines():
            dst = line.split()[0] if line.split() else ""
            if dst in ("broadcast", "local", "unreachable", "blackhole", "prohibit"):
                dst = line.split()[1]
            with contextlib.suppress(ValueError):
                if dst != "default":
                    used.append(ipaddress.IPv4Network(dst, strict=False))
        rng = random.Random()
        for _ in range(200):
            # 10.150-239: away from the usual 10.0/16, 10.96/12 (k8s services), 10.244/16 (flannel)
            net = ipaddress.IPv4Network(f"10.{rng.randrange(150, 240)}.{rng.randrange(256)}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
        raise TestbedError("no free 10.x.y.0/24 subnet for the testbed bridge")

    def _make_keys(self) -> None:
        _run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "herd-testbed-client",
                "-f",
                str(self.tmp / "id_ed25519"),
            ]
        )
        shutil.copy(self.tmp / "id_ed25519.pub", self.tmp / "authorized_keys")
        (self.tmp / "known_hosts").touch()

    def _build_node(self, k: int, node: TestNode) -> None:
        assert self.subnet is not None
        veth = f"{_PREFIX}{_KIND_VETH}{self.tag}{k}"
        etc = _NETNS_ETC / node.ns
        etc.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"]
        for other in self.nodes:
            if other is node and self.hosts_loopback:
                lines.append(f"127.0.1.1 {other.name}")  # stock Debian: the classic trap
            else:
                lines.append(f"{other.addr} {other.name}")
        (etc / "hosts").write_text("\n".join(lines) + "\n")
        # No nameserver: an unknown name fails at once instead of trying the host's DNS.
        (etc / "resolv.conf").write_text("# herd testbed node: no DNS, names come from hosts\n")
        _run(["ip", "netns", "add", node.ns])
        _run(["ip", "-n", node.ns, "link", "set", "lo", "up"])
        _run(
            [
                "ip",
                "link",
                "add",
                "name",
                veth,
                "type",
                "veth",
                "peer",
                "name",
                node.iface,
                "netns",
                node.ns,
            ]
        )
        _run(["ip", "link", "set", veth, "master", self.bridge])
        _run(["ip", "link", "set", veth, "up"])
        # Only the connected /24: no default route, so nothing can leave the testbed.
        _run(
            [
                "ip",
                "-n",
                node.ns,
                "addr",
                "add",
                f"{node.addr}/{self.subnet.prefixlen}",
                "dev",
                node.iface,
            ]
        )
        _run(["ip", "-n", node.ns, "link", "set", node.iface, "up"])
        key = self.tmp / f"{node.name}_host_ed25519"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", node.name, "-f", str(key)])
        config = [
            f"ListenAddress {node.addr}",
            "Port 22",
            "AddressFamily inet",
            f"HostKey {key}",
            f"PidFile {self.tmp / f'{node.name}_sshd.pid'}",
            f"AuthorizedKeysFile {self.tmp / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",  # the keys live in a temp dir whose modes sshd would reject
            "X11Forwarding no",
            "PrintMotd no",
            "Subsystem sftp internal-sftp",
            # tests open many connections at once (fan-out, ControlMaster-less probes)
            "MaxSessions 50",
            "MaxStartups 100:30:200",
        ]
        cfg = self.tmp / f"{node.name}_sshd_config"
        cfg.write_text("\n".join(config) + "\n")
        # OpenSSH >= 9.8 throttles addresses whose connections die early, which fault-injection
        # tests do on purpose; older versions reject the option, so only set it where known.
        sshd = _sshd_binary() or "/usr/sbin/sshd"
        if (
            _run(
                [sshd, "-t", "-f", str(cfg), "-o", "PerSourcePenalties=no"], check=False
            ).returncode
            == 0
        ):
            cfg.write_text("\n".join([*config, "PerSourcePenalties no"]) + "\n")

    def _write_ssh_config(self) -> None:
        key = self.tmp / "id_ed25519"
        blocks = []
        for node in self.nodes:
            # The address is an alias too, so a cluster file naming nodes by address works.
            blocks.append(
                "\n".join(
                    [
                        f"Host {node.name} {node.addr}",
                        f"    HostName {node.addr}",
                        "    User root",
                        f"    IdentityFile {key}",
                        "    IdentitiesOnly yes",
                        f"    UserKnownHostsFile {self.tmp / 'known_hosts'}",
                        "    StrictHostKeyChecking accept-new",
                        "    LogLevel ERROR",
                    ]
                )
            )
        self.ssh_config = self.tmp / "ssh_config"
        self.ssh_config.write_text("\n\n".join(blocks) + "\n")

    def _start_sshd(self, node: TestNode) -> None:
        sshd = _sshd_binary() or "/usr/sbin/sshd"
        cfg = self.tmp / f"{node.name}_sshd_config"
        # With private_dirs, the node's own directory is bound over self.private in the mount
        # namespace `ip netns exec` made for it: only processes of this node see it there.
        private = (
            f"mount --bind {self.private_of(node)} {self.private} && " if self.private_dirs else ""
        )
        # `ip netns exec` mounts a fresh /sys for the namespace, without the cgroup hierarchies
        # a real machine shows there (herd's node agent reads a rank's CPU quota from them):
        # mount the host's hierarchies again inside the node, at the same places.
        cgroups = (
            "{ mount -t tmpfs cgroup_root /sys/fs/cgroup && "
            'awk \'$3 == "cgroup" || $3 == "cgroup2" {print $2, $3, $4}\' /proc/1/mounts | '
            'while read -r dir kind options; do mkdir -p "$dir" && '
            'mount -t "$kind" -o "$options" "$kind" "$dir"; done; } || true; '
        )
        log = open(self.tmp / f"{node.name}_sshd.log", "wb")  # noqa: SIM115 - child owns it
        with log:
            # ip netns exec: network namespace + a mount namespace with /etc/netns/<ns>/* bound
            # over /etc; unshare --uts: the node's own hostname. Each execs the next, so the
            # Popen pid is sshd's, and that pid is the handle ns_run enters.
            self._sshd[node.name] = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    node.ns,
                    "unshare",
                    "--uts",
                    "--",
                    "sh",
                    "-c",
                    f'{cgroups}hostname {node.name} && {private}exec {sshd} -D -e -f "$0"',
                    str(cfg),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # the terminal's Ctrl-C is for pytest, not for sshd
            )

    def _wait_sshd(self, node: TestNode) -> None:
        proc = self._sshd[node.name]
        deadline = time.monotonic() + _SSHD_READY_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                with socket.create_connection((node.addr, 22), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        log = (self.tmp / f"{node.name}_sshd.log").read_text(errors="replace").strip()
        state = (
            f"exited {proc.returncode}"
            if proc.poll() is not None
            else f"not listening after {_SSHD_READY_S:.0f}s"
        )
        raise TestbedError(
            f"sshd on {node.name} ({node.ns}, {node.addr}:22) {state}; its log:\n{log or '(empty)'}"
        )

    def _check_mesh(self) -> None:
        """Node-to-node TCP must work; it does not when the host filters bridged traffic."""
        if len(self.nodes) < 2:
            return
        code = "import socket,sys; socket.create_connection((sys.argv[1], 22), 3).close()"
        for i, node in enumerate(self.nodes):
            peer = self.nodes[(i + 1) % len(self.nodes)]
            proc = self.ns_run(node, [sys.executable, "-c", code, peer.addr], check=False)
            if proc.returncode != 0:
                raise TestbedError(
                    f"{node.name} cannot reach {peer.name} ({peer.addr}:22) across the bridge: "
                    f"{proc.stderr.strip().splitlines()[-1:]}. If net.bridge.bridge-nf-call-"
                    "iptables is 1 and the FORWARD policy is DROP (Docker does this), bridged "
                    "traffic is filtered by the host firewall."
                )

    # ---- access ----------------------------------------------------------------------------

    def node(self, name_or_index: str | int | TestNode) -> TestNode:
        """A node by name ("node2"), by 0-based index into `nodes` (1 -> node2), or itself."""
        if isinstance(name_or_index, TestNode):
            return name_or_index
        if isinstance(name_or_index, int):
            return self.nodes[name_or_index]
        for node in self.nodes:
            if name_or_index in (node.name, node.ns, node.addr):
                return node
        raise KeyError(
            f"no testbed node {name_or_index!r}; nodes: {', '.join(n.name for n in self.nodes)}"
        )

    def _enter(self, node: TestNode, cwd: str | os.PathLike[str] | None) -> list[str]:
        pid = self._sshd[node.name].pid
        # --mount: the sshd's mount namespace is the one `ip netns exec` made, where the node's
        # /etc/hosts is bound; entering it resets the cwd, so --wd restores the caller's.
        return [
            "nsenter",
            f"--target={pid}",
            "--net",
            "--uts",
            "--mount",
            f"--wd={os.fspath(cwd) if cwd is not None else os.getcwd()}",
            "--",
        ]

    def ns_run(
        self,
        node: str | int | TestNode,
        argv: list[str],
        *,
        check: bool = True,
        timeout: float = 30,
        **kw: Any,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv inside the node (its network, UTS and mount namespaces), text output."""
        n = self.node(node)
        if not {"stdout", "stderr", "capture_output"} & kw.keys():
            kw["capture_output"] = True
        kw.setdefault("text", True)
        argv = [*self._enter(n, kw.pop("cwd", None)), *argv]
        try:
            return subprocess.run(argv, check=check, timeout=timeout, **kw)
        except subprocess.CalledProcessError as exc:
            exc.add_note(f"on {n.name}; stderr: {(exc.stderr or '').strip()}")
            raise

    def ns_popen(
        self, node: str | int | TestNode, argv: list[str], **kw: Any
    ) -> subprocess.Popen[Any]:
        """Start argv in the background inside the node; close() ends it if the test does not.
        The returned pid is the process itself (nsenter execs it)."""
        n = self.node(node)
        proc = subprocess.Popen([*self._enter(n, kw.pop("cwd", None)), *argv], **kw)
        self._popens.append(proc)
        return proc

    def ssh(
        self,
        node: str | int | TestNode,
        command: str,
        *,
        timeout: float = 30,
        connect_timeout: int = 5,
    ) -> subprocess.CompletedProcess[str]:
        """Run a shell command on the node over real ssh (rc 255: ssh itself failed)."""
        n = self.node(node)
        return subprocess.run(
            [
                "ssh",
                "-F",
                str(self.ssh_config),
                "-o",
                "BatchMode=yes",
                "-o",
                f"ConnectTimeout={connect_timeout}",
                n.name,
                command,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def write_cluster_file(
        self,
        path: Path | None = None,
        *,
        nodes: list[str | dict[str, Any]] | None = None,
        python: str | None = None,
        **cluster_keys: Any,
    ) -> Path:
        """Write a herd.toml for this testbed (default: self.tmp / "herd.toml")."""
        cluster: dict[str, Any] = {
            "python": python or sys.executable,
            "ssh_config": str(self.ssh_config),
            "connect_timeout": 5,
        }
        cluster.update({k: v for k, v in cluster_keys.items() if v is not None})
        lines = ["[cluster]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in cluster.items()]
        for entry in nodes if nodes is not None else [n.name for n in self.nodes]:
            spec = {"host": entry} if isinstance(entry, str) else dict(entry)
            lines += ["", "[[node]]"]
            lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in spec.items()]
        path = Path(path) if path is not None else self.tmp / "herd.toml"
        path.write_text("\n".join(lines) + "\n")
        return path

    def processes_with_env(self, key: str, value: str) -> list[int]:
        """Pids of live processes (any namespace) whose environment holds KEY=VALUE exactly."""
        wanted = f"{key}={value}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if wanted in environ.split(b"\0"):
                found.append(int(entry))
        return sorted(found)

    def private_of(self, node: str | int | TestNode) -> Path:
        """Where, seen from the launcher, the node's own directory at ``self.private`` lives."""
        return self.tmp / "node-private" / self.node(node).name

    def node_processes(self, node: str | int | TestNode) -> list[int]:
        """Pids running inside the node other than its sshd listener and what this testbed
        started there itself (ns_popen): everything an ssh login (herd) left running there."""
        n = self.node(node)
        ours = {self._sshd[n.name].pid} | {p.pid for p in self._popens if p.poll() is None}
        return sorted(pid for pid in _pids_in_netns(n.ns) if pid not in ours)

    # ---- faults ----------------------------------------------------------------------------

    def _veth(self, node: TestNode) -> str:
        return f"{_PREFIX}{_KIND_VETH}{self.tag}{self.nodes.index(node) + 1}"

    def partition(self, node: str | int | TestNode) -> None:
        """Cut the node off the bridge: its packets vanish, as with a pulled cable."""
        n = self.node(node)
        _run(["ip", "link", "set", self._veth(n), "down"])
        self._partitioned.add(n.name)

    def heal(self, node: str | int | TestNode) -> None:
        n = self.node(node)
        _run(["ip", "link", "set", self._veth(n), "up"])
        self._partitioned.discard(n.name)

    def _iptables_bin(self) -> str:
        """Whichever of iptables / -nft / -legacy works in a node namespace here."""
        if self._iptables is None:
            for candidate in ("iptables", "iptables-nft", "iptables-legacy"):
                if (
                    shutil.which(candidate)
                    and self.ns_run(
                        self.nodes[0], [candidate, "-w", "5", "-S"], check=False
                    ).returncode
                    == 0
                ):
                    self._iptables = candidate
                    break
            else:
                raise TestbedError(
                    "no working iptables (tried iptables, -nft, -legacy): apt-get install iptables"
                )
        return self._iptables

    def _block_rule(self, node: TestNode, port: int | str) -> list[str]:
        # Only on the bridge NIC: like a host firewall, loopback on the node stays open. A range
        # drops only new connections (SYN), as a stateful firewall does: the node's own outgoing
        # connections use ports of that range too, and their replies must still come in.
        syn = ["--syn"] if isinstance(port, str) else []
        return ["INPUT", "-i", node.iface, "-p", "tcp", *syn, "--dport", str(port), "-j", "DROP"]

    def block_port(self, node: str | int | TestNode, port: int | str) -> None:
        """Silently DROP incoming TCP to `port` on the node (no RST: peers hang, then time out).
        A range is written "LOW:HIGH" (e.g. the kernel's ephemeral ports, "32768:60999")."""
        n = self.node(node)
        if (n.name, port) in self._blocked:
            return
        self._ns_check(n, [self._iptables_bin(), "-w", "5", "-A", *self._block_rule(n, port)])
        self._blocked.add((n.name, port))

    def unblock_port(self, node: str | int | TestNode, port: int | str) -> None:
        n = self.node(node)
        if (n.name, port) not in self._blocked:
            return
        self._ns_check(n, [self._iptables_bin(), "-w", "5", "-D", *self._block_rule(n, port)])
        self._blocked.discard((n.name, port))

    def delay(self, node: str | int | TestNode, ms: int) -> None:
        """Delay every packet the node sends on its bridge NIC by `ms` (RTT to it grows by ms).

        tc netem where the kernel has it; otherwise an NFQUEUE rule and a small userspace
        delayer inside the node (slower per packet, but the same observable latency)."""
        n = self.node(node)
        if ms <= 0:
            raise ValueError(f"delay must be positive, not {ms} ms")
        self.undelay(n)
        netem = self.ns_run(
            n,
            ["tc", "qdisc", "replace", "dev", n.iface, "root", "netem", "delay", f"{ms}ms"],
            check=False,
        )
        if netem.returncode == 0:
            self._delayed[n.name] = None
            return
        delayer = self.ns_popen(
            n,
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "_nfqueue-delay",
                str(_NFQUEUE_NUM),
                str(ms),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert delayer.stdout is not None
        ready, _, _ = select.select([delayer.stdout], [], [], 10)
        line = delayer.stdout.readline() if ready else ""
        if line.strip() != "ready":
            delayer.kill()
            err = delayer.communicate(timeout=5)[1]
            raise TestbedError(
                f"cannot delay {n.name}: no netem ({netem.stderr.strip()}) and "
                f"the NFQUEUE delayer failed: {err.strip() or line.strip()}"
            )
        self._delayed[n.name] = delayer
        try:
            self._ns_check(n, [self._iptables_bin(), "-w", "5", "-A", *self._delay_rule(n)])
        except TestbedError:
            self._stop_delayer(delayer)
            del self._delayed[n.name]
            raise

    def _delay_rule(self, node: TestNode) -> list[str]:
        return ["OUTPUT", "-o", node.iface, "-j", "NFQUEUE", "--queue-num", str(_NFQUEUE_NUM)]

    @staticmethod
    def _stop_delayer(proc: subprocess.Popen[str]) -> None:
        proc.terminate()  # it accepts what it still holds before exiting
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)

    def undelay(self, node: str | int | TestNode) -> None:
        n = self.node(node)
        if n.name not in self._delayed:
            return
        delayer = self._delayed.pop(n.name)
        if delayer is None:
            self._ns_check(n, ["tc", "qdisc", "del", "dev", n.iface, "root"])
            return
        # Rule first, delayer second: a queue with no reader would drop the node's packets.
        self._ns_check(n, [self._iptables_bin(), "-w", "5", "-D", *self._delay_rule(n)])
        self._stop_delayer(delayer)

    def rate_limit(self, node: str | int | TestNode, mbit: int) -> None:
        """Cap the node's link at `mbit` Mbit/s both ways (a slow NIC or a bad cable): a tc
        token bucket on the node's NIC (what it sends) and on the bridge side of its veth
        (what it receives). Undone by `unlimit` and by reset_faults."""
        n = self.node(node)
        if mbit <= 0:
            raise ValueError(f"rate must be positive, not {mbit} Mbit/s")
        tbf = ["tbf", "rate", f"{mbit}mbit", "burst", "64kb", "latency", "100ms"]
        self._ns_check(n, ["tc", "qdisc", "replace", "dev", n.iface, "root", *tbf])
        self._limited.add(n.name)
        _run(["tc", "qdisc", "replace", "dev", self._veth(n), "root", *tbf])

    def unlimit(self, node: str | int | TestNode) -> None:
        n = self.node(node)
        if n.name not in self._limited:
            return
        self._ns_check(n, ["tc", "qdisc", "del", "dev", n.iface, "root"])
        _run(["tc", "qdisc", "del", "dev", self._veth(n), "root"], check=False)
        self._limited.discard(n.name)

    def add_nic(
        self, node: str | int | TestNode, name: str = "docker0", addr: str = "172.31.0.1/16"
    ) -> None:
        """Add a second, up NIC with `addr` inside the node (for NIC-choice tests).

        A dummy device where the kernel has one; otherwise a veth whose peer sits in a private
        sink namespace with no address and no route, so nothing sent on it can leave the testbed.
        """
        n = self.node(node)
        if (
            self.ns_run(
                n, ["ip", "link", "add", "name", name, "type", "dummy"], check=False
            ).returncode
            != 0
        ):
            sink = f"{_PREFIX}{_KIND_SINK}{self.tag}"
            if sink not in _netns_names():
                _run(["ip", "netns", "add", sink])
            self._nic_count += 1
            peer = f"p{self._nic_count}"
            _run(
                [
                    "ip",
                    "-n",
                    sink,
                    "link",
                    "add",
                    "name",
                    peer,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    name,
                    "netns",
                    n.ns,
                ]
            )
            _run(["ip", "-n", sink, "link", "set", peer, "up"])
        self._nics.setdefault(n.name, set()).add(name)
        _run(["ip", "-n", n.ns, "addr", "add", addr, "dev", name])
        _run(["ip", "-n", n.ns, "link", "set", name, "up"])

    def remove_nic(self, node: str | int | TestNode, name: str = "docker0") -> None:
        n = self.node(node)
        if name in self._nics.get(n.name, set()):
            _run(["ip", "-n", n.ns, "link", "del", name])  # a veth takes its peer with it
            self._nics[n.name].discard(name)

    def reset_faults(self) -> None:
        """Heal, unblock, undelay, unlimit and remove added NICs on every node."""
        self._revert_faults(strict=True)

    def _revert_faults(self, *, strict: bool) -> None:
        errors: list[str] = []
        actions: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
            (self.heal, (name,)) for name in sorted(self._partitioned)
        ]
        actions += [(self.unblock_port, key) for key in sorted(self._blocked, key=str)]
        actions += [(self.undelay, (name,)) for name in sorted(self._delayed)]
        actions += [(self.unlimit, (name,)) for name in sorted(self._limited)]
        actions += [
            (self.remove_nic, (name, nic))
            for name, nics in sorted(self._nics.items())
            for nic in sorted(nics)
        ]
        for action, args in actions:
            try:
                action(*args)
            except Exception as exc:  # keep reverting the rest, report all at the end
                errors.append(f"{action.__name__}{args}: {exc}")
        if errors and strict:
            raise TestbedError("could not revert faults: " + "; ".join(errors))

    def _ns_check(self, node: TestNode, argv: list[str]) -> None:
        proc = self.ns_run(node, argv, check=False)
        if proc.returncode != 0:
            raise TestbedError(
                f"on {node.name}: `{' '.join(argv)}` exited {proc.returncode}: "
                f"{proc.stderr.strip()}"
            )


# --------------------------------------------------------------------------------------------
# the NFQUEUE delayer (runs inside a node; stdlib only, speaks nfnetlink_queue directly)

_NETLINK_NETFILTER = 12
_NFNL_SUBSYS_QUEUE = 3
_NFQNL_MSG_PACKET, _NFQNL_MSG_CONFIG, _NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
_NFQA_PACKET_HDR, _NFQA_VERDICT_HDR = 1, 2
_NFQA_CFG_CMD, _NFQA_CFG_PARAMS, _NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
_NFQNL_CFG_CMD_BIND, _NFQNL_COPY_META = 1, 1
_NLM_F_REQUEST, _NLM_F_ACK = 1, 4
_NLMSG_ERROR = 2
_NF_ACCEPT = 1
_SO_RCVBUFFORCE = 33


def _nl_attr(kind: int, data: bytes) -> bytes:
    length = 4 + len(data)
    return struct.pack("=HH", length, kind) + data + b"\0" * (-length % 4)


def _nfqueue_delay(queue: int, ms: int) -> int:
    """Hold each packet of NFQUEUE `queue` for `ms` ms, then accept it; until SIGTERM."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER)
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 32 << 20)
    sock.bind((0, 0))
    seq = 0

    def send(msg: int, attrs: bytes, flags: int = _NLM_F_REQUEST) -> None:
        nonlocal seq
        seq += 1
        body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
        header = struct.pack(
            "=IHHII", 16 + len(body), (_NFNL_SUBSYS_QUEUE << 8) | msg, flags, seq, 0
        )
        sock.send(header + body)

    send(
        _NFQNL_MSG_CONFIG,
        _nl_attr(_NFQA_CFG_CMD, struct.pack("!BxH", _NFQNL_CFG_CMD_BIND, socket.AF_INET))
        + _nl_attr(_NFQA_CFG_PARAMS, struct.pack("!IB", 0xFFFF, _NFQNL_COPY_META))
        + _nl_attr(_NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536)),
        _NLM_F_REQUEST | _NLM_F_ACK,
    )
    reply = sock.recv(65536)
    if struct.unpack_from("=H", reply, 4)[0] == _NLMSG_ERROR:
        err = -struct.unpack_from("=i", reply, 16)[0]
        if err:
            print(f"binding NFQUEUE {queue}: {os.strerror(err)}", file=sys.stderr)
            return 1

    def accept_through(packet_id: int) -> None:
        # A batch verdict accepts every queued packet up to this id; ids only grow.
        send(
            _NFQNL_MSG_VERDICT_BATCH,
            _nl_attr(_NFQA_VERDICT_HDR, struct.pack("!II", _NF_ACCEPT, packet_id)),
        )

    def stop(*_: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    pending: collections.deque[tuple[float, int]] = collections.deque()
    delay = ms / 1000
    print("ready", flush=True)
    try:
        while True:
            timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else None
            readable, _, _ = select.select([sock], [], [], timeout)
            if readable:
                try:
                    data = sock.recv(1 << 20)
                except OSError:  # ENOBUFS under a flood: the kernel dropped some; go on
                    data = b""
                offset, now = 0, time.monotonic()
                while offset + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, offset)
                    if length < 16:
                        break
                    if kind == (_NFNL_SUBSYS_QUEUE << 8) | _NFQNL_MSG_PACKET:
                        at = offset + 20  # nlmsghdr + nfgenmsg
                        while at + 4 <= offset + length:
                            alen, akind = struct.unpack_from("=HH", data, at)
                            if alen < 4:
                                break
                            if akind & 0x3FFF == _NFQA_PACKET_HDR:
                                pending.append(
                                    (now + delay, struct.unpack_from("!I", data, at + 4)[0])
                                )
                            at += (alen + 3) & ~3
                    offset += (length + 3) & ~3
            now, due = time.monotonic(), None
            while pending and pending[0][0] <= now:
                due = pending.popleft()[1]
            if due is not None:
                accept_through(due)
    finally:
        if pending:
            accept_through(pending[-1][1])
        sock.close()


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    clean = sub.add_parser("clean", help="remove leftovers of crashed testbed runs")
    clean.add_argument("--dry-run", action="store_true", help="only list them")
    delay = sub.add_parser("_nfqueue-delay", help="internal: the packet delayer")
    delay.add_argument("queue", type=int)
    delay.add_argument("ms", type=int)
    args = parser.parse_args(argv)
    if args.command == "_nfqueue-delay":
        return _nfqueue_delay(args.queue, args.ms)
    if os.geteuid() != 0:
        print("testbed-clean: needs root", file=sys.stderr)
        return 1
    for line in clean_stale(dry_run=args.dry_run):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
