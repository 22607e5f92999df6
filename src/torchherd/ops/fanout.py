"""`herd exec`: one shell command on many nodes in parallel, output streamed with the host's name.

The command runs under a small POSIX sh wrapper on each node, in its own session, so that it
can be ended as a whole: the wrapper watches its stdin (the ssh channel) and, when the launcher
closes it (timeout, Ctrl-C, herd dying), sends SIGTERM to the command's process group, then
SIGKILL after 5 s. Killing only the local ssh client would leave the command running there.
Nothing here needs torchherd on the nodes: `herd exec -- pip install torchherd` must work.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..spec import ClusterSpec, NodeSpec
from ..transport import Transport, for_cluster

# Seconds the wrapper waits after SIGTERM before SIGKILL, and the launcher after that.
KILL_AFTER = 5
EXIT_WAIT = KILL_AFTER + 5

# $1: "strict" (the workdir must exist) or "try" (fall back to the home directory);
# $2: the directory ("" for none); $3: the command, run by sh.
WRAPPER = r"""d=$2
case $d in "~") d=$HOME ;; "~/"*) d=$HOME/${d#"~/"} ;; esac
if [ -n "$d" ]; then
  if [ "$1" = strict ]; then
    cd "$d" 2>/dev/null || { echo "herd: working directory $d does not exist here" >&2; exit 1; }
  else
    cd "$d" 2>/dev/null || cd
  fi
fi
exec 3<&0 </dev/null
if command -v setsid >/dev/null 2>&1; then setsid sh -c "$3" & else sh -c "$3" & fi
p=$!
{ while read -r _ <&3; do :; done
  kill -TERM -"$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null
  sleep KILL_AFTER; kill -KILL -"$p" 2>/dev/null || kill -KILL "$p" 2>/dev/null
} >/dev/null 2>&1 &
w=$!
wait "$p"; c=$?
kill "$w" 2>/dev/null
exit "$c"
""".replace("KILL_AFTER", str(KILL_AFTER))

OnLine = Callable[[str, str, str], None]
"""on_line(host, "o" | "e", text): one line of a node's stdout or stderr."""


@dataclass(frozen=True)
class ExecResult:
    """How the command went on one node."""

    host: str
    status: str
    """ok, failed (non-zero exit), timeout, unreachable, interrupted."""
    exit_code: int | None
    duration: float
    detail: str = ""
    """Why it did not run (unreachable) and what to do."""
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def exec_workdir(cluster: ClusterSpec) -> tuple[str, str]:
    """Where the command runs: [cluster] workdir (must exist), else the launcher's current
    directory where the node has it (shared filesystems), else the home directory."""
    return ("strict", cluster.workdir) if cluster.workdir else ("try", os.getcwd())


def wrapper_argv(command: str, mode: str, workdir: str) -> list[str]:
    return ["sh", "-c", WRAPPER, "herd-exec", mode, workdir, command]


class Fanout:
    """Runs one command on a set of nodes; ``interrupt()`` ends it everywhere."""

    def __init__(
        self,
        cluster: ClusterSpec,
        command: str,
        *,
        timeout: float | None = None,
        on_line: OnLine | None = None,
        capture: bool = False,
        transport: Transport | None = None,
    ) -> None:
        self.cluster = cluster
        self.command = command
        self.timeout = timeout
        self.on_line = on_line
        self.capture = capture
        self.transport = transport or for_cluster(cluster)
        self.interrupted = asyncio.Event()

    def interrupt(self) -> None:
        self.interrupted.set()

    async def run(self) -> list[ExecResult]:
        try:
            return await self.transport.each(self.cluster.nodes, self._one)
        finally:
            await self.transport.close()

    async def _one(self, node: NodeSpec) -> ExecResult:
        started = time.monotonic()
        if self.interrupted.is_set():
            return ExecResult(node.host, "interrupted", None, 0.0)
        unreachable = await self.transport.connect(node)
        if unreachable is not None:
            return ExecResult(
                node.host,
                "unreachable",
                None,
                time.monotonic() - started,
                detail=f"{unreachable.describe()}; fix: {unreachable.remedy}",
            )
        mode, workdir = exec_workdir(self.cluster)
        process = await self.transport.start(node, wrapper_argv(self.command, mode, workdir))
        assert process.stdout is not None and process.stderr is not None
        out: list[str] = []
        err: list[str] = []
        readers = asyncio.gather(
            self._pump(node.host, process.stdout, "o", out),
            self._pump(node.host, process.stderr, "e", err),
        )
        ending = asyncio.ensure_future(process.wait())
        stop = asyncio.ensure_future(self.interrupted.wait())
        done, _ = await asyncio.wait(
            {ending, stop}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED
        )
        status = "ok"
        if ending not in done:
            status = "interrupted" if stop in done else "timeout"
            _close_stdin(process)
            try:
                await asyncio.wait_for(asyncio.shield(ending), EXIT_WAIT)
            except TimeoutError:
                process.kill()
                await ending
        stop.cancel()
        await readers
        code = process.returncode
        stderr = "".join(err)
        if status == "ok":
            unreachable = self.transport.classify_failure(node, code or 0, stderr) if code else None
            if unreachable is not None:
                return ExecResult(
                    node.host,
                    "unreachable",
                    None,
                    time.monotonic() - started,
                    detail=f"{unreachable.describe()}; fix: {unreachable.remedy}",
                )
            status = "ok" if code == 0 else "failed"
        return ExecResult(
            node.host,
            status,
            code,
            time.monotonic() - started,
            stdout="".join(out),
            stderr=stderr,
        )

    async def _pump(
        self, host: str, stream: asyncio.StreamReader, name: str, keep: list[str]
    ) -> None:
        async for raw in stream:
            text = raw.decode(errors="replace")
            if self.capture:
                keep.append(text)
            elif name == "e":
                keep.append(text)
                del keep[:-50]  # the stderr tail, for classifying ssh failures
            if self.on_line is not None:
                self.on_line(host, name, text.rstrip("\r\n"))


def _close_stdin(process: asyncio.subprocess.Process) -> None:
    if process.stdin is not None and not process.stdin.is_closing():
        try:
            process.stdin.close()
        except (ConnectionError, OSError, RuntimeError):
            pass


def run_everywhere(
    cluster: ClusterSpec,
    command: str,
    *,
    timeout: float | None = None,
    on_line: OnLine | None = None,
    capture: bool = False,
    transport: Transport | None = None,
) -> list[ExecResult]:
    """Run ``command`` on every node of ``cluster``; Ctrl-C ends it on every node."""

    async def main() -> list[ExecResult]:
        fanout = Fanout(
            cluster, command, timeout=timeout, on_line=on_line, capture=capture, transport=transport
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, fanout.interrupt)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
        try:
            return await fanout.run()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.remove_signal_handler(sig)
                except (NotImplementedError, RuntimeError, ValueError):
                    pass

    return asyncio.run(main())
