"""Local transport: this machine alone, as plain subprocesses (no ssh)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping

from ..spec import NodeSpec
from .base import Command, Transport, Unreachable, remote_line


class LocalTransport(Transport):
    async def connect(self, node: NodeSpec) -> Unreachable | None:
        return None

    async def start(
        self,
        node: NodeSpec,
        command: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> asyncio.subprocess.Process:
        pipes = {
            "stdin": asyncio.subprocess.PIPE,
            "stdout": asyncio.subprocess.PIPE,
            "stderr": asyncio.subprocess.PIPE,
            "limit": 1 << 24,
            # Like ssh clients: the terminal's Ctrl-C is for herd, which stops the agent itself.
            "start_new_session": True,
        }
        if isinstance(command, str):
            return await asyncio.create_subprocess_exec(
                "/bin/sh",
                "-c",
                remote_line(command, cwd, env),
                **pipes,  # type: ignore[arg-type]
            )
        full_env = {**os.environ, **(env or {})}
        return await asyncio.create_subprocess_exec(
            *command,
            cwd=os.path.expanduser(cwd) if cwd else None,
            env=full_env,
            **pipes,  # type: ignore[arg-type]
        )

    def classify_failure(self, node: NodeSpec, returncode: int, stderr: str) -> Unreachable | None:
        return None
