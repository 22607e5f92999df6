"""Which StrictHostKeyChecking herd passes to ssh for a node: the user's own, where it is theirs.

herd runs ssh with BatchMode, under which ssh's default ``ask`` turns every unknown host key
into a failure. Only there does herd say ``accept-new`` (record a new key, refuse a changed
one). A user who wrote ``StrictHostKeyChecking yes`` (or anything else) keeps it: herd passes
nothing and ssh applies their config. The effective setting comes from ``ssh -G HOST``, asked
once per node and remembered for the life of the transport.

It is asked only where it matters: a node whose key is known connects the same under every
setting, so the first connection passes nothing, and only one refused for its host key makes
herd ask (one ``ssh -G`` less per node on every launch after the first).
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import local_output

# ssh -G prints the setting under this key: ask (the default), true (yes), false (no), accept-new.
SETTING = "stricthostkeychecking"
DEFAULT = "ask"


def parse_setting(ssh_g_output: str) -> str:
    """The StrictHostKeyChecking value in ``ssh -G`` output (ssh's default when absent)."""
    for line in ssh_g_output.splitlines():
        key, _, value = line.strip().partition(" ")
        if key.lower() == SETTING:
            return value.strip().lower() or DEFAULT
    return DEFAULT


def option_for(setting: str) -> dict[str, str]:
    """The -o option herd adds for a node whose effective setting is ``setting``."""
    return {"StrictHostKeyChecking": "accept-new"} if setting == DEFAULT else {}


class HostKeyPolicy:
    """Remembers each node's effective setting; ``config_argv`` is ssh plus its -F, if any."""

    def __init__(self, config_argv: Sequence[str]) -> None:
        self._config_argv = list(config_argv)
        self._settings: dict[str, str] = {}

    def _argv(self, host: str) -> list[str]:
        return [*self._config_argv, "-G", "--", host]

    async def learn(self, host: str) -> None:
        """Ask ssh (without blocking the event loop) for this node's setting, once."""
        if host in self._settings:
            return
        out = await local_output(self._argv(host), 10)
        self._remember(host, out is not None, (out or b"").decode(errors="replace"))

    def learned(self, host: str) -> bool:
        return host in self._settings

    def option(self, host: str) -> dict[str, str]:
        """The option to add for ``host``: none until its setting was learned (``learn``)."""
        if host not in self._settings:
            return {}
        return option_for(self._settings[host])

    def _remember(self, host: str, ok: bool, output: str) -> None:
        # When ssh cannot say (a config error it will report itself at connect), keep the
        # default behaviour rather than guess at something stricter or looser.
        self._settings[host] = parse_setting(output) if ok else DEFAULT
