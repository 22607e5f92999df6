"""`herd ssh-setup`: a key, installed on every node, host keys recorded, login verified.

1. The key: the first identity file ssh would offer the first node (``ssh -G``) that exists;
   with none, a new ed25519 key is made at the first ed25519 path ssh would look at.
2. Each node in turn (a password prompt needs the terminal to itself): if key login works,
   nothing to do; if the node refuses the key, the public key is appended to its
   ``~/.ssh/authorized_keys`` over an ssh without BatchMode, so ssh itself asks for the
   password on the terminal (as ssh-copy-id does). Host keys are accepted when new
   (StrictHostKeyChecking=accept-new), never blindly: a changed key stops that node.
3. Every node is then verified in parallel with non-interactive (BatchMode) logins.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..spec import ClusterSpec, NodeSpec
from ..transport.ssh import SshTransport, classify_ssh_failure

# Appends the key read on stdin once, with the modes sshd's StrictModes asks for.
INSTALL_SCRIPT = (
    'umask 077; f="$HOME/.ssh/authorized_keys"; mkdir -p "$HOME/.ssh" && touch "$f" && '
    'chmod 700 "$HOME/.ssh" && chmod 600 "$f" && k=$(cat) && [ -n "$k" ] && '
    '{ grep -qxF -- "$k" "$f" || { if [ -s "$f" ] && [ -n "$(tail -c 1 "$f")" ]; then '
    'echo >> "$f"; fi; printf \'%s\\n\' "$k" >> "$f"; }; }'
)

Say = Callable[[str], None]


@dataclass(frozen=True)
class NodeSetup:
    """What ssh-setup did on one node."""

    host: str
    key: str
    """already (key login worked), installed, failed, skipped."""
    host_key: str
    """recorded (new in known_hosts), known (was there), missing."""
    login: str
    """ok, or why non-interactive login fails (ssh's reason)."""
    fix: str = ""
    """What to do about it."""

    @property
    def ok(self) -> bool:
        return self.login == "ok"


def ssh_binary() -> str:
    found = shutil.which("ssh")
    if found is None:
        raise ConfigError(
            "the OpenSSH client `ssh` is not installed on this machine",
            "install it (Debian/Ubuntu: apt-get install openssh-client)",
        )
    return found


def ssh_options(cluster: ClusterSpec, *, batch: bool) -> list[str]:
    argv = [ssh_binary()]
    if cluster.ssh_config:
        argv += ["-F", os.path.expanduser(cluster.ssh_config)]
    timeout = max(1, round(cluster.connect_timeout))
    options = {
        "StrictHostKeyChecking": "accept-new",
        "ConnectTimeout": str(timeout),
        "ForwardAgent": "no",
        "ForwardX11": "no",
        "ControlMaster": "no",
        "ControlPath": "none",
    }
    if batch:
        options["BatchMode"] = "yes"
    for key, value in options.items():
        argv += ["-o", f"{key}={value}"]
    return argv


def effective_config(cluster: ClusterSpec, node: NodeSpec) -> dict[str, list[str]]:
    """``ssh -G``: the settings ssh would use for this node (all values of repeated keys)."""
    argv = ssh_options(cluster, batch=True) + ["-G", node.host]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise ConfigError(
            f"ssh cannot read its configuration for {node.host}: {out.stderr.strip()}",
            "fix the ssh config file named in the error",
        )
    config: dict[str, list[str]] = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition(" ")
        config.setdefault(key.lower(), []).append(value.strip())
    return config


def choose_key(config: dict[str, list[str]], given: str | None = None) -> tuple[Path, bool]:
    """(private key path, whether it exists): the given one, or the first ssh would offer."""
    if given:
        path = Path(os.path.expanduser(given))
        return path, path.exists()
    candidates = [Path(os.path.expanduser(p)) for p in config.get("identityfile", [])]
    for path in candidates:
        if path.exists():
            return path, True
    for path in candidates:
        if path.name.startswith("id_ed25519") and not path.name.endswith("_sk"):
            return path, False
    return Path.home() / ".ssh" / "id_ed25519", False


def create_key(path: Path) -> None:
    """A new ed25519 key without a passphrase (add one later with `ssh-keygen -p -f PATH`)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    keygen = shutil.which("ssh-keygen")
    if keygen is None:
        raise ConfigError("ssh-keygen is not installed", "install openssh-client")
    comment = f"herd@{socket.gethostname()}"
    result = subprocess.run(
        [keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    if result.returncode != 0:
        raise ConfigError(
            f"ssh-keygen could not create {path}: {result.stderr.strip()}",
            "check that the directory is writable",
        )


def known_host(config: dict[str, list[str]]) -> bool:
    """Whether the node's host key is in one of the known_hosts files ssh reads for it."""
    keygen = shutil.which("ssh-keygen") or "ssh-keygen"
    host = (config.get("hostkeyalias") or config.get("hostname") or [""])[0]
    port = (config.get("port") or ["22"])[0]
    name = host if port == "22" else f"[{host}]:{port}"
    files: list[str] = []
    for entry in config.get("userknownhostsfile", []) + config.get("globalknownhostsfile", []):
        files += entry.split()
    for file in files:
        path = os.path.expanduser(file)
        if not os.path.isfile(path):
            continue
        found = subprocess.run(
            [keygen, "-F", name, "-f", path],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            timeout=30,
        )
        if found.returncode == 0 and found.stdout.strip():
            return True
    return False


def try_login(cluster: ClusterSpec, node: NodeSpec) -> tuple[bool, str]:
    """A non-interactive login: (worked, ssh's stderr)."""
    argv = ssh_options(cluster, batch=True) + [node.host, "true"]
    result = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=cluster.connect_timeout + 30,
    )
    return result.returncode == 0, result.stderr


def install_key(cluster: ClusterSpec, node: NodeSpec, public_key: str) -> tuple[bool, str]:
    """Append the key on the node; ssh asks for the password on the terminal if it must."""
    argv = ssh_options(cluster, batch=False) + [node.host, "sh -c " + shlex.quote(INSTALL_SCRIPT)]
    # stderr stays on the terminal, beside ssh's prompt ("Permission denied, try again").
    result = subprocess.run(
        argv, input=public_key.strip() + "\n", stdout=subprocess.PIPE, text=True, timeout=300
    )
    return result.returncode == 0, f"ssh exited with {result.returncode}"


def can_prompt() -> bool:
    """Whether ssh can ask for a password: it reads it from /dev/tty."""
    try:
        with open("/dev/tty", "rb"):
            return True
    except OSError:
        return False


def setup(
    cluster: ClusterSpec,
    *,
    key: str | None = None,
    say: Say = print,
    interactive: bool | None = None,
) -> tuple[Path, bool, list[NodeSetup]]:
    """Run the three steps; (key path, whether it was created, one NodeSetup per node)."""
    if cluster.transport != "ssh":
        raise ConfigError(
            "there are no nodes to set up: no cluster file",
            "write one with `herd init HOST...` first",
        )
    first = effective_config(cluster, cluster.nodes[0])
    private, exists = choose_key(first, key)
    created = False
    if not exists:
        say(
            f"creating an ed25519 key at {private} (no passphrase; add one with "
            f"`ssh-keygen -p -f {private}`)"
        )
        create_key(private)
        created = True
    public_path = Path(f"{private}.pub")
    if not public_path.exists():
        raise ConfigError(
            f"{public_path} is missing",
            f"recreate it with `ssh-keygen -y -f {private} > {public_path}`",
        )
    public_key = public_path.read_text().strip()
    prompt = can_prompt() if interactive is None else interactive
    steps = [_install(cluster, node, public_key, prompt, say) for node in cluster.nodes]
    verified = verify(cluster)
    results = []
    for step in steps:
        login, fix = verified[step.host]
        if login.startswith("authentication failed"):
            fix = _auth_fix(step, private)
        results.append(NodeSetup(step.host, step.key, step.host_key, login, fix))
    return private, created, results


def _auth_fix(step: NodeSetup, private: Path) -> str:
    if step.key == "skipped":
        return (
            f"run `herd ssh-setup` in a terminal (it asks for the password), or append "
            f"{private}.pub to ~/.ssh/authorized_keys on {step.host}"
        )
    if step.key == "installed":
        return (
            f"the key is installed but ssh does not offer it to {step.host}: add "
            f"`IdentityFile {private}` to its Host entry in your ssh config"
        )
    return f"check User and IdentityFile for {step.host} in your ssh config"


def _install(
    cluster: ClusterSpec, node: NodeSpec, public_key: str, prompt: bool, say: Say
) -> NodeSetup:
    config = effective_config(cluster, node)
    before = known_host(config)
    worked, stderr = try_login(cluster, node)
    if worked:
        state = "already"
    else:
        failure = classify_ssh_failure(node.host, 255, stderr, cluster.connect_timeout)
        if failure is not None and failure.reason != "auth":
            state = "failed"  # unreachable, or a changed host key: a password will not help
        elif not prompt:
            say(f"{node.host}: key login refused, and no terminal to ask for a password")
            state = "skipped"
        else:
            say(f"{node.host}: installing the key (ssh asks for {node.host}'s password)")
            installed, stderr = install_key(cluster, node, public_key)
            state = "installed" if installed else "failed"
            if not installed:
                say(f"{node.host}: could not install the key ({stderr})")
    after = known_host(config)
    host_key = "known" if before else ("recorded" if after else "missing")
    return NodeSetup(node.host, state, host_key, "")


def verify(cluster: ClusterSpec) -> dict[str, tuple[str, str]]:
    """host -> ("ok", "") or (why non-interactive login fails, the fix); nodes in parallel."""

    async def main() -> dict[str, tuple[str, str]]:
        transport = SshTransport(cluster)

        async def one(node: NodeSpec) -> tuple[str, str]:
            failure = await transport.connect(node)
            if failure is not None:
                return failure.describe().removeprefix(f"{node.host}: "), failure.remedy
            result = await transport.run(node, "true", timeout=cluster.connect_timeout + 30)
            if result.ok:
                return "ok", ""
            return f"login works, but `true` exited {result.returncode}", "check the login shell"

        try:
            answers = await transport.each(cluster.nodes, one)
        finally:
            await transport.close()
        return {n.host: a for n, a in zip(cluster.nodes, answers, strict=True)}

    return asyncio.run(main())


__all__ = ["INSTALL_SCRIPT", "NodeSetup", "choose_key", "setup", "verify"]
