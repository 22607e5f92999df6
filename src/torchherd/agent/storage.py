"""Shared storage, checked on a node (standard library only): does a directory exist here, can
this user write in it, how much is free, and is it the same storage the other nodes see.

The doctor asks over its agent session (``netcheck.session``), in three steps:
  place  {"paths": [...], "base": dir}  every node: look at each path and write a token in it,
         ``.herd-storage-<random>`` holding random text (the write test itself);
  look   {"tokens": [{"path", "name", "content"}], "base": dir}  the other nodes: is that file
         there, with that text? Same storage everywhere means every node finds it;
  clean  {}  every node removes the tokens it wrote (also done when the session ends).
Paths may start with ``~`` (expanded here, for this node's user); relative ones are taken
from ``base`` (the job's working directory), as the job would take them.
"""

from __future__ import annotations

import errno
import os
import secrets
from typing import Any

TOKEN_PREFIX = ".herd-storage-"

_written: list[str] = []
"""Tokens this process wrote and has not removed yet."""


def handle(request: dict[str, Any]) -> dict[str, Any]:
    """One storage request -> its answer (never raises for a path's trouble)."""
    base = str(request.get("base") or "")
    if "place" in request:
        return {"paths": [place(str(p), base) for p in request["place"]]}
    if "look" in request:
        return {"paths": [look(dict(t), base) for t in request["look"]]}
    clean()
    return {"cleaned": True}


def resolve(path: str, base: str) -> str:
    """The path as the job on this node would see it."""
    path = os.path.expanduser(path)
    if not os.path.isabs(path) and base:
        path = os.path.join(os.path.expanduser(base), path)
    return os.path.normpath(path)


def place(path: str, base: str) -> dict[str, Any]:
    """State of ``path`` here (ok, missing, not-a-dir, no-access, unwritable), free space, and
    a token written in it when it is a writable directory."""
    target = resolve(path, base)
    answer: dict[str, Any] = {"path": target}
    try:
        is_dir = os.path.isdir(target)
        os.stat(target)
    except OSError as exc:
        missing = exc.errno in (errno.ENOENT, errno.ENOTDIR)
        answer.update(state="missing" if missing else "no-access", error=_text(exc))
        return answer
    if not is_dir:
        answer.update(state="not-a-dir", error="not a directory")
        return answer
    try:
        stat = os.statvfs(target)
        answer["free_bytes"] = stat.f_bavail * stat.f_frsize
        answer["total_bytes"] = stat.f_blocks * stat.f_frsize
    except OSError as exc:
        answer["space_error"] = _text(exc)
    name = TOKEN_PREFIX + secrets.token_hex(8)
    content = secrets.token_hex(16)
    token = os.path.join(target, name)
    try:
        # Written and fsynced: a network filesystem shows the others what reached its server.
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        _written.append(token)
        try:
            os.write(fd, content.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        answer.update(state="unwritable", error=_text(exc))
        return answer
    answer.update(state="ok", token=name, content=content)
    return answer


def look(token: dict[str, Any], base: str) -> dict[str, Any]:
    """Whether another node's token is here with its text: found, other-content or absent.
    Opened by its name, not listed: a listing may come from a stale directory cache (NFS)."""
    target = resolve(str(token.get("path", "")), base)
    name = os.path.basename(str(token.get("name", "")))
    answer: dict[str, Any] = {"path": target}
    if not name.startswith(TOKEN_PREFIX):
        answer.update(seen="absent", error="not a storage token")
        return answer
    try:
        with open(os.path.join(target, name), "rb") as handle:
            found = handle.read(256).decode(errors="replace")
    except OSError as exc:
        answer.update(seen="absent", error=_text(exc))
        return answer
    answer["seen"] = "found" if found == str(token.get("content")) else "other-content"
    return answer


def clean() -> None:
    """Remove every token this process wrote."""
    while _written:
        try:
            os.unlink(_written.pop())
        except OSError:
            pass


def _text(exc: OSError) -> str:
    return exc.strerror or str(exc)
