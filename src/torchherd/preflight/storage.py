"""The doctor's shared-storage test: is each ``--path`` there, writable, and the same everywhere.

Through the agent sessions already open (one per node; ``agent/storage.py`` does the work):
  1. every node looks at each path and writes a token there (random name, random text);
  2. the first node in cluster order where the path is a writable directory is the writer:
     every other such node looks for the writer's token by name and compares its text;
  3. every node removes its tokens.
A node that does not find the writer's token sees other storage under the same name (a local
disk, another mount). fsspec URLs (s3://...) are not paths: the nodes are not asked about them.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .findings import PathOnNode, StorageFindings
from .network import Session

Say = Callable[[str], None]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str) -> bool:
    """An fsspec URL (``s3://bucket/prefix``); ``file://`` counts as the plain path it names."""
    return bool(_URL.match(path)) and not path.startswith("file://")


def plain(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


async def storage_tests(
    paths: Sequence[str],
    sessions: Mapping[str, Session],
    order: Sequence[str],
    base: str,
    *,
    timeout: float = 60.0,
    say: Say | None = None,
) -> tuple[StorageFindings, ...]:
    """Run the three steps over ``sessions`` (hosts in cluster ``order``) for every path."""
    say = say or (lambda _: None)
    files = [plain(p) for p in paths if not is_url(p)]
    hosts = [h for h in order if h in sessions]
    placed: dict[str, list[dict[str, Any]]] = {}
    if files and hosts:
        say(f"checking {len(files)} path(s) on {len(hosts)} node(s)")
        placed = await _ask_all(
            sessions, {h: {"place": files, "base": base} for h in hosts}, timeout
        )
    writers: dict[str, tuple[str, dict[str, Any]]] = {}
    for index, path in enumerate(files):
        for host in hosts:
            answer = _nth(placed.get(host), index)
            if answer.get("state") == "ok":
                writers[path] = (host, answer)
                break
    lookups: dict[str, list[dict[str, Any]]] = {}
    asked: dict[str, list[int]] = {}
    for index, path in enumerate(files):
        if path not in writers:
            continue
        writer, token = writers[path]
        for host in hosts:
            if host != writer and _nth(placed.get(host), index).get("state") == "ok":
                lookups.setdefault(host, []).append(
                    {"path": path, "name": token["token"], "content": token["content"]}
                )
                asked.setdefault(host, []).append(index)
    seen: dict[str, list[dict[str, Any]]] = {}
    if lookups:
        seen = await _ask_all(
            sessions, {h: {"look": t, "base": base} for h, t in lookups.items()}, timeout
        )
    if placed:
        await _ask_all(sessions, {h: {} for h in hosts if placed.get(h) is not None}, timeout)
    found: list[StorageFindings] = []
    index = 0
    for path in paths:
        if is_url(path):
            found.append(StorageFindings(path, url=True))
            continue
        nodes = {}
        for host in hosts:
            answers = placed.get(host)
            if answers is None:
                why = (
                    f"no answer within {timeout:g} s"
                    if sessions[host].timed_out
                    else "the node's agent session had ended"
                )
                nodes[host] = PathOnNode("", "no-answer", why)
                continue
            looked = dict(zip(asked.get(host, []), seen.get(host) or [], strict=False))
            nodes[host] = _on_node(_nth(answers, index), looked.get(index))
        chosen = writers.get(files[index])
        found.append(StorageFindings(path, nodes, chosen[0] if chosen else None))
        index += 1
    return tuple(found)


async def _ask_all(
    sessions: Mapping[str, Session], requests: Mapping[str, dict[str, Any]], timeout: float
) -> dict[str, list[dict[str, Any]]]:
    """One storage request per host, all at once; a host without an answer is left out."""

    async def ask(host: str) -> tuple[str, list[dict[str, Any]] | None]:
        answer = await sessions[host].ask({"storage": requests[host]}, timeout)
        storage = (answer or {}).get("storage")
        paths = storage.get("paths", []) if isinstance(storage, dict) else None
        return host, paths if isinstance(paths, list) else None

    answers = await asyncio.gather(*(ask(host) for host in requests))
    return {host: paths for host, paths in answers if paths is not None}


def _nth(answers: list[dict[str, Any]] | None, index: int) -> dict[str, Any]:
    if answers is None or index >= len(answers) or not isinstance(answers[index], dict):
        return {}
    return answers[index]


def _on_node(placed: dict[str, Any], looked: dict[str, Any] | None) -> PathOnNode:
    def number(key: str) -> int | None:
        value = placed.get(key)
        return int(value) if isinstance(value, int | float) else None

    return PathOnNode(
        path=str(placed.get("path", "")),
        state=str(placed.get("state", "no-answer")),
        error=str(placed.get("error", "")),
        free_bytes=number("free_bytes"),
        total_bytes=number("total_bytes"),
        seen=str(looked.get("seen")) if looked else None,
    )
