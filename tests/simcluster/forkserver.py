"""The nodes' agents (and torchrun's stand-ins), forked from one process that imported them.

A simulated node's agent is herd's real agent (``python -m torchherd.agent COMMAND``), one
process per node; what the fork server saves is what a thousand of them cost on one machine.
Started the usual way, every agent is an interpreter of its own that imports the agent's
modules: ~13 MB of memory of its own and ~0.1 s of CPU per node, so 1,000 nodes take 13 GB
and minutes of both cores before the launcher is measured. Forked from a process that
imported them once (and froze them out of the garbage collector, which would otherwise write
to every object and unshare its page), an agent starts in a few milliseconds and keeps
~8 MB of its own (CPython's reference counts still unshare every page the agent's code
touches). It then runs the same code with the same arguments, variables, working directory
and standard streams as the interpreter it stands for.

How a node's shim (cluster.py) asks for one, with nothing but the shell (no interpreter of
its own, which would cost what is saved): it opens an answer FIFO of its own (read-write, so
that neither side ever waits for the other to open it), writes its pid and its node's index
to the server's request FIFO, and waits on the answer. The server reads the rest from /proc:
the shim's command line (what follows ``-m torchherd.agent``), environment and working
directory, and its standard streams (its copies at /proc/PID/fd/5-7 open the same pipes the
launcher holds, so the agent reads and writes them as the shim would). The agent is forked
in a session of its own; the server answers with its pid (the shim passes SIGTERM, SIGINT
and SIGHUP on to it), and when it ends, with its exit status (128 + N for signal N, as a
shell says it); the shim exits with that. The shim stands where the interpreter stood: the
launcher's link and the node's agent are the same pipes and the same exit code; only the
agent's pid differs from the shim's, and the launcher never reads a link's pid.

torchrun's stand-in (standin.py, ``-m torchherd.agent.elastic``) is forked the same way, at
the lowest CPU priority: the agent's child is then the shim, which passes the agent's
signals on, and a shim killed outright (SIGKILL to its process group) ends the stand-in at
its next tick; the ranks' workers are the stand-in's children, as torchrun's are.

    python -m tests.simcluster.forkserver ROOT     (run by the simulated launcher, launcher.py)

SIGTERM: no new agents (the request FIFO goes); the server exits once its children have,
and the orphans it took in (a tree's relays, which leave their session) too.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import resource
import selectors
import signal
import sys
from pathlib import Path

AGENT_MODULE = "torchherd.agent"
WRAPPER_MODULE = "torchherd.agent.elastic"  # torchrun's wrapper: the stand-in (standin.py)
# A tree's (tests/simcluster/transport.py): an inner node's fan-out, a subtree node's relay.
FANOUT_MODULE = "torchherd.agent.fanout"
RELAY_MODULE = "torchherd.agent.relay"
FORKED_MODULES = (AGENT_MODULE, WRAPPER_MODULE, FANOUT_MODULE, RELAY_MODULE)
# The shim's copies of its standard streams (0, 1, 2 at 5, 6, 7): fixed while it waits.
SHIM_STREAMS = 5


def requests_fifo(root: Path) -> Path:
    return root / "forkserver" / "requests"


def answer_fifo(root: Path, pid: int) -> Path:
    return root / "forkserver" / str(pid)


def read_proc(pid: int, name: str) -> list[bytes]:
    with open(f"/proc/{pid}/{name}", "rb") as handle:
        return handle.read().split(b"\0")


def module_arguments(cmdline: list[bytes]) -> tuple[str, list[str]] | None:
    """(module, what follows it) for ``-m MODULE`` on the shim's command line, MODULE one of
    FORKED_MODULES; None for anything else."""
    words = [w.decode(errors="surrogateescape") for w in cmdline if w]
    for index in range(len(words) - 1):
        if words[index] == "-m" and words[index + 1] in FORKED_MODULES:
            return words[index + 1], words[index + 2 :]
    return None


def preload() -> None:
    """The modules every agent command and the stand-in need, imported once, before any
    fork."""
    import torchherd.agent.__main__
    import torchherd.agent.control
    import torchherd.agent.fanout
    import torchherd.agent.probe
    import torchherd.agent.relay
    import torchherd.agent.runner  # noqa: F401

    from . import standin  # noqa: F401


def become_subreaper() -> None:
    """Orphans of this process's descendants become its children (Linux's
    PR_SET_CHILD_SUBREAPER)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reopen(path: str, mode: int) -> int:
    """The pipe (or file) behind one of the shim's descriptors, opened anew. A pipe opened by
    name waits for the other end as a FIFO does (a read for a writer that may have closed
    already): it is opened without waiting, then made blocking. A pipe whose reader has gone
    is a pipe whose writes fail (EPIPE), as the shim's would."""
    try:
        fd = os.open(path, mode | os.O_NONBLOCK)
    except OSError as exc:
        if mode != os.O_WRONLY or exc.errno != errno.ENXIO:
            raise
        reader, fd = os.pipe()
        os.close(reader)
    os.set_blocking(fd, True)
    return fd


def without_py_spy() -> None:
    """This node has no py-spy: neither beside its interpreter nor on its PATH."""
    import torchherd.agent.stacks

    torchherd.agent.stacks.py_spy = lambda: None


def become(shim: int, node: str, root: Path, module: str, arguments: list[str]) -> None:
    """In the forked child: take the shim's streams, variables and directory, run the agent
    (or the stand-in), never return."""
    import torchherd.agent.__main__ as agent_main

    from . import standin
    from .cluster import ROOT_VAR, STANDIN_NICE
    from .standin import NODE_INDEX_VAR

    code = 255
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        for fd, mode in ((0, os.O_RDONLY), (1, os.O_WRONLY), (2, os.O_WRONLY)):
            os.dup2(reopen(f"/proc/{shim}/fd/{SHIM_STREAMS + fd}", mode), fd)
        variables = read_proc(shim, "environ")
        os.chdir(os.readlink(f"/proc/{shim}/cwd"))
        os.closerange(3, 1 << 16)  # nothing of the server's (its FIFOs, selector) stays open
        os.environ.clear()
        for item in variables:
            key, sep, value = item.partition(b"=")
            if sep:
                os.environb[key] = value
        os.environ.update({NODE_INDEX_VAR: node, ROOT_VAR: str(root)})  # the shim's own
        if module == WRAPPER_MODULE:
            os.nice(STANDIN_NICE)
            standin.SHIM = shim
            sys.argv = [standin.__file__, *arguments]
            code = standin.main(arguments)
        elif module in (FANOUT_MODULE, RELAY_MODULE):
            import torchherd.agent.fanout
            import torchherd.agent.relay

            tool = torchherd.agent.relay if module == RELAY_MODULE else torchherd.agent.fanout
            if module == FANOUT_MODULE:  # how many fan-outs a tree took (a test counts them)
                standin.append_event(str(root / standin.EVENTS_FILE), "fanout", node)
            sys.argv = [str(tool.__file__), *arguments]
            code = tool.main()
        else:
            if not json.loads((root / "cluster.json").read_text()).get("py_spy", True):
                without_py_spy()
            sys.argv = [agent_main.__file__, *arguments]
            code = agent_main.main(arguments)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - the shim's caller must see why, as python would
        import traceback

        traceback.print_exception(exc)
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


class Server:
    """Forks agents and stand-ins on request; reports each one's exit status to its shim."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, tuple[int, int]] = {}  # agent pid -> (pidfd, shim pid)
        self.pending = b""
        self.stopping = False
        # A descriptor per process it forked (two a node): more than the usual 1,024.
        _, most = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
        wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_write)
        # The wake-up pipe says which (one byte a signal).
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # A tree's relays leave the session that started them (agent/relay.py's detach): their
        # parent exits and they end as orphans, which this server reaps (the machine's first
        # process may not, and a thousand zombies would fill the process table).
        become_subreaper()
        self.selector.register(wake_read, selectors.EVENT_READ, "signal")
        fifo = requests_fifo(root)
        fifo.parent.mkdir(exist_ok=True)
        if not fifo.exists():
            os.mkfifo(fifo, 0o600)
        # Read-write: a shim's write never waits for the server, and the last shim's close is
        # no end of file.
        self.requests = os.open(fifo, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector.register(self.requests, selectors.EVENT_READ, "request")

    def serve(self) -> None:
        gc.collect()
        gc.freeze()  # the imported modules stay in pages every agent shares
        while not (self.stopping and not self.descendants()):
            for key, _ in self.selector.select():
                if key.data == "signal":
                    said = os.read(key.fd, 512)
                    if signal.SIGCHLD in said:
                        self.reap_orphans()
                    if any(sig != signal.SIGCHLD for sig in said):
                        self.stop()
                elif key.data == "request":
                    self.take_requests()
                else:
                    self.reap(key.data)

    def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self.selector.unregister(self.requests)
        os.close(self.requests)
        requests_fifo(self.root).unlink(missing_ok=True)

    def take_requests(self) -> None:
        try:
            self.pending += os.read(self.requests, 1 << 16)
        except BlockingIOError:
            return
        *lines, self.pending = self.pending.split(b"\n")
        for line in lines:
            words = line.split()
            if len(words) == 2 and all(word.isdigit() for word in words):
                self.fork(int(words[0]), words[1].decode())

    def fork(self, shim: int, node: str) -> None:
        try:
            found = module_arguments(read_proc(shim, "cmdline"))
        except OSError:
            return  # the shim is gone already
        if found is None:
            self.answer(shim, "none\n2")  # no process to pass signals to; usage error
            return
        pid = os.fork()
        if pid == 0:
            become(shim, node, self.root, *found)
        pidfd = os.pidfd_open(pid)
        self.children[pid] = (pidfd, shim)
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        self.answer(shim, str(pid), last=False)  # the shim passes its signals on to it

    def reap(self, pid: int) -> None:
        if pid not in self.children:
            return  # reaped already, with the orphans (its pidfd said so in the same select)
        pidfd, shim = self.children.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        self.answer(shim, str(128 - code if code < 0 else code))

    def descendants(self) -> bool:
        """Whether a process this server forked, or an orphan it took in, is left."""
        if self.children:
            return True
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return False
        return True

    def reap_orphans(self) -> None:
        """Every child that has ended: this server's own (its shim is told) and orphans."""
        while True:
            try:
                ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if ended is None:
                return
            if ended.si_pid in self.children:
                self.reap(ended.si_pid)
            else:
                os.waitpid(ended.si_pid, 0)

    def answer(self, shim: int, words: str, last: bool = True) -> None:
        """Tell the shim its process's pid, then (``last``) its exit status."""
        path = answer_fifo(self.root, shim)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return  # the shim is gone (killed), nobody waits for the answer
        try:
            os.write(fd, f"{words}\n".encode())
        except OSError:
            pass
        finally:
            os.close(fd)
            if last:
                path.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    preload()
    Server(Path(argv[0])).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
