"""The node side of ``herd env``: look, receive, build, switch, remove. Standard library only.

A node needs nothing but a Python 3 interpreter: the launcher sends this module and ``envid``
as source over herd's own transport (``BOOTSTRAP`` reads them from stdin) and runs one action.
Everything lives under one node-local root (``~/.herd/envs`` by default)::

    ROOT/cache/wheels/   wheels the launcher sent (kept: the next sync sends only what is new)
    ROOT/cache/uv/       uv's cache; environments hardlink their files from it (same filesystem)
    ROOT/bin/uv-VERSION  the uv binary, sent once per version
    ROOT/HASH/           one environment per hash; ``.herd-complete`` once built and verified
    ROOT/current         symlink to the environment jobs use; replaced by a rename, never edited

A new environment is built in its own folder while ``current`` still names the old one; only
when the environment's own python recomputes the expected hash is ``.herd-complete`` written and
``current`` switched (a new symlink renamed over the old, atomic). Ctrl-C, a lost link or a full
disk stop the build at any point with the old environment untouched; a folder without the mark
is an unfinished build, removed by the next one. Every action prints JSON lines on stdout.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
from typing import IO, Any

try:
    from . import envid
except ImportError:  # sent as source: the bootstrap put envid in sys.modules first
    import envid  # type: ignore[no-redef]

COMPLETE = ".herd-complete"
PLATFORM_FILE = "platform"
"""``ROOT/platform``, when present, names this node's machine for wheel choice (``aarch64``):
for nodes whose interpreter reports the wrong one (emulation, some containers)."""

BOOTSTRAP = (
    "import json,sys,types\n"
    "mods=json.loads(sys.stdin.buffer.readline())\n"
    "for name,src in mods.items():\n"
    "    m=types.ModuleType(name);m.__source__=src;sys.modules[name]=m\n"
    "    exec(compile(src,name+'.py','exec'),m.__dict__)\n"
    "code=sys.modules['envnode'].main(sys.argv[1:],sys.stdin.buffer)\n"
    "sys.stdout.flush();import os;os._exit(code)\n"
)
"""``python3 -c BOOTSTRAP ACTION JSON``: stdin's first line is ``{"envid": SRC, "envnode":
SRC}``, the rest is the action's input (a tar stream of wheels for ``receive``). It ends with
``os._exit``: a build's stdin watcher may still be blocked in a read, which a normal
interpreter shutdown would wait on."""


def say(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem that holds ``path`` (or its nearest existing parent)."""
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def site_packages(env: str) -> list[str]:
    lib = os.path.join(env, "lib")
    try:
        return [
            os.path.join(lib, name, "site-packages")
            for name in sorted(os.listdir(lib))
            if name.startswith("python")
        ]
    except OSError:
        return []


def machine(root: str) -> str:
    try:
        with open(os.path.join(root, PLATFORM_FILE)) as told:
            return told.read().strip() or platform.machine()
    except OSError:
        return platform.machine()


def look(root: str) -> dict[str, Any]:
    """What this node has: interpreter, platform, free space, cached wheels, environments."""
    glibc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    wheels_dir = os.path.join(root, "cache", "wheels")
    try:
        cache = {
            name: os.path.getsize(os.path.join(wheels_dir, name))
            for name in os.listdir(wheels_dir)
            if name.endswith(".whl")
        }
    except OSError:
        cache = {}
    try:
        uvs = sorted(
            name[3:] for name in os.listdir(os.path.join(root, "bin")) if name.startswith("uv-")
        )
    except OSError:
        uvs = []
    envs: dict[str, Any] = {}
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    for name in names:
        path = os.path.join(root, name)
        if len(name) != envid.HASH_LENGTH or not os.path.isdir(path) or os.path.islink(path):
            continue
        complete = os.path.exists(os.path.join(path, COMPLETE))
        packages = envid.installed(site_packages(path))
        envs[name] = {
            "complete": complete,
            "hash": envid.identity(packages, _env_python(path)),
            "packages": packages,
        }
    current = None
    try:
        current = os.path.basename(os.readlink(os.path.join(root, "current")))
    except OSError:
        pass
    return {
        "python": sys.executable,
        "python_version": ".".join(str(v) for v in sys.version_info[:3]),
        "python_tag": f"cp{sys.version_info[0]}{sys.version_info[1]}",
        "machine": machine(root),
        "glibc": glibc.split()[-1] if glibc else None,
        "root": root,
        "free_bytes": free_bytes(root),
        "cache": cache,
        "uv": uvs,
        "envs": envs,
        "current": current,
    }


def _env_python(env: str) -> str:
    """The ``X.Y`` of an environment's interpreter, from its pyvenv.cfg (no process started)."""
    try:
        with open(os.path.join(env, "pyvenv.cfg")) as cfg:
            for line in cfg:
                key, _, value = line.partition("=")
                if key.strip() in ("version_info", "version"):
                    return value.strip()
    except OSError:
        pass
    return "0.0"


RELAY_WAIT = 120.0
"""Seconds a relayed node waits for the node before it to connect, and for each read."""


class _Tee:
    """A stream that forwards every byte read from it to the next node of a relay."""

    def __init__(self, stream: IO[bytes], out: socket.socket | None) -> None:
        self.stream, self.out = stream, out

    def read(self, size: int = -1) -> bytes:
        chunk = self.stream.read(size)
        if chunk and self.out is not None:
            self.out.sendall(chunk)
        return chunk


def _relay_streams(
    stream: IO[bytes], listen: bool
) -> tuple[IO[bytes], socket.socket | None, socket.socket | None]:
    """Where a relayed ``receive`` reads its tar stream from, and where it passes it on.

    With ``listen``, a TCP port is opened first and said on stdout (with the address this
    node was reached at, from ssh); the launcher then writes one line on stdin: the token the
    node before must present, and the next node's address, if any. Without, that line comes
    first on stdin and the tar stream follows it there."""
    server = None
    if listen:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.bind(("0.0.0.0", 0))
        server.listen(4)
        reached = os.environ.get("SSH_CONNECTION", "").split()
        say(listening=server.getsockname()[1], addr=reached[2] if len(reached) > 2 else None)
    told = json.loads(stream.readline() or b"{}")
    out = None
    nxt = told.get("forward")
    if nxt:
        out = socket.create_connection((nxt["addr"], int(nxt["port"])), timeout=RELAY_WAIT)
        out.sendall(str(nxt["token"]).encode() + b"\n")
    if server is None:
        return stream, out, None
    server.settimeout(RELAY_WAIT)
    while True:
        conn, _ = server.accept()
        conn.settimeout(RELAY_WAIT)
        source = conn.makefile("rb")
        if source.readline().strip() == str(told.get("token", "")).encode():
            server.close()
            return source, out, conn
        conn.close()  # not the node before this one: keep waiting for it


def receive(root: str, stream: IO[bytes], relay: dict[str, Any] | None = None) -> dict[str, Any]:
    """Wheels (and a uv binary, ``uv-VERSION``) from a tar stream, each written under a
    temporary name and renamed when whole: a cut stream leaves no half wheel behind.

    With ``relay`` (``{"listen": bool}``), the node is a link of a chain: the stream comes
    from stdin or from the node before (``listen``), and every byte is passed on to the node
    after as it arrives, so the launcher sends one copy for the whole chain."""
    closing: list[socket.socket] = []
    if relay is not None:
        stream, out, conn = _relay_streams(stream, bool(relay.get("listen")))
        closing = [s for s in (out, conn) if s is not None]
        stream = _Tee(stream, out)  # type: ignore[assignment]
    try:
        result = _receive(root, stream)
        while stream.read(1 << 16):
            pass  # the stream's end (tar padding): the next node needs it too
    finally:
        for sock in closing:
            sock.close()
    return result


def _receive(root: str, stream: IO[bytes]) -> dict[str, Any]:
    wheels_dir = os.path.join(root, "cache", "wheels")
    bin_dir = os.path.join(root, "bin")
    os.makedirs(wheels_dir, exist_ok=True)
    os.makedirs(bin_dir, exist_ok=True)
    count = 0
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            name = os.path.basename(member.name)
            if not member.isfile() or not name or name.startswith("."):
                continue
            folder = bin_dir if name.startswith("uv-") else wheels_dir
            final = os.path.join(folder, name)
            part = final + f".part-{os.getpid()}"
            source = tar.extractfile(member)
            assert source is not None
            try:
                with open(part, "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
            except BaseException:
                os.unlink(part)  # a cut stream or a full disk: no half file left
                raise
            if folder == bin_dir:
                os.chmod(part, 0o755)
            os.replace(part, final)
            count += 1
            say(received=name, size=member.size)
    return {"received": count}


_children: list[subprocess.Popen[str]] = []


def _end_with_launcher(stdin: IO[bytes]) -> None:
    """The launcher holds our stdin open while it wants the build: when it closes (Ctrl-C,
    a lost link), stop at once, so no build the user gave up on finishes and switches later."""

    def watch() -> None:
        while stdin.read(1 << 16):
            pass
        for child in list(_children):
            try:
                child.kill()
            except OSError:
                pass
        os._exit(130)

    threading.Thread(target=watch, daemon=True).start()


def build(
    root: str, want: str, wheels: list[str], uv_version: str, python: str, stdin: IO[bytes]
) -> dict[str, Any]:
    """Build environment ``want`` from cached wheels beside the current one, verify its hash
    with its own interpreter, then switch ``current`` to it."""
    target = os.path.join(root, want)
    uv = os.path.join(root, "bin", f"uv-{uv_version}")
    _end_with_launcher(stdin)
    if os.path.exists(os.path.join(target, COMPLETE)) and _listed(target) == want:
        say(step="present")
    else:
        if os.path.exists(target):
            # An unfinished build, or a finished one changed by hand since: built again.
            say(step="removing unfinished or changed build")
            shutil.rmtree(target)
        env = dict(
            os.environ,
            UV_CACHE_DIR=os.path.join(root, "cache", "uv"),
            UV_NO_CONFIG="1",
            UV_PYTHON_DOWNLOADS="never",
        )
        say(step="venv")
        _run([uv, "venv", "--quiet", "--python", python, target], env)
        say(step="install", wheels=len(wheels))
        files = [os.path.join(root, "cache", "wheels", name) for name in wheels]
        told = os.path.exists(os.path.join(root, PLATFORM_FILE))
        platform_args = ["--python-platform", f"{machine(root)}-unknown-linux-gnu"] if told else []
        _run(
            [
                uv,
                "pip",
                "install",
                "--quiet",
                "--offline",
                "--no-index",
                "--no-deps",
                "--link-mode",
                "hardlink",
                "--python",
                os.path.join(target, "bin", "python"),
                *platform_args,
                *files,
            ],
            env,
        )
        say(step="verify")
        got = _verify(target)
        if got != want:
            raise BuildFailed(f"built environment hashes to {got}, not {want}")
        with open(os.path.join(target, COMPLETE), "w") as mark:
            mark.write(want + "\n")
    switch(root, want)
    return {"current": want}


def _listed(env: str) -> str:
    """The hash of what an environment's folders hold (no interpreter started)."""
    return envid.identity(envid.installed(site_packages(env)), _env_python(env))


def _verify(env: str) -> str:
    """The hash the environment's own interpreter computes for itself (isolated mode)."""
    source = getattr(envid, "__source__", None)
    if source is None:
        with open(envid.__file__) as own:
            source = own.read()
    out = subprocess.run(
        [os.path.join(env, "bin", "python"), "-I", "-c", source],
        capture_output=True,
        text=True,
        cwd="/",
        check=False,
    )
    if out.returncode != 0:
        raise BuildFailed(f"the new environment's python failed: {out.stderr.strip()[-300:]}")
    return str(json.loads(out.stdout)["hash"])


def switch(root: str, want: str) -> None:
    """Point ``current`` at a complete environment: a new symlink renamed over the old one."""
    if not os.path.exists(os.path.join(root, want, COMPLETE)):
        raise BuildFailed(f"no complete environment {want} here")
    link = os.path.join(root, "current")
    staged = f"{link}.new-{os.getpid()}"
    os.symlink(want, staged)
    os.replace(staged, link)
    say(step="switched", current=want)


def remove(root: str, want: str) -> dict[str, Any]:
    link = os.path.join(root, "current")
    if os.path.islink(link) and os.path.basename(os.readlink(link)) == want:
        raise BuildFailed(f"{want} is the current environment here; switch to another first")
    path = os.path.join(root, want)
    existed = os.path.isdir(path)
    if existed:
        shutil.rmtree(path)
    return {"removed": existed}


class BuildFailed(Exception):
    pass


def _run(argv: list[str], env: dict[str, str]) -> None:
    child = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    _children.append(child)
    _, err = child.communicate()
    _children.remove(child)
    if child.returncode != 0:
        raise BuildFailed(f"{os.path.basename(argv[0])} {argv[1]} failed: {err.strip()[-600:]}")


def main(argv: list[str], stdin: IO[bytes]) -> int:
    action, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    root = os.path.expanduser(args["root"])
    try:
        if action == "look":
            result = look(root)
        elif action == "receive":
            result = receive(root, stdin, args.get("relay"))
        elif action == "build":
            result = build(
                root,
                args["hash"],
                args["wheels"],
                args["uv"],
                args.get("python") or sys.executable,
                stdin,
            )
        elif action == "use":
            switch(root, args["hash"])
            result = {"current": args["hash"]}
        elif action == "rm":
            result = remove(root, args["hash"])
        else:
            raise BuildFailed(f"unknown action {action}")
    except BuildFailed as exc:
        say(error=str(exc))
        return 1
    except OSError as exc:
        say(error=f"{exc.strerror or exc} ({exc.filename or root})", errno=exc.errno)
        return 1
    say(done=result)
    return 0
