"""Slurm hostlists (``gpu[01-04,07]``, ``a[1-2]-b[3-4]``) and PBS nodefiles, read into host names.

The expander follows Slurm's own rules: a comma or white space outside brackets separates
entries, each bracket holds numbers and ranges separated by commas, a range keeps the zero
padding of its lower bound, and several brackets in one entry give every combination (left
bracket varying slowest). Anything it cannot read falls back to ``scontrol show hostnames``,
Slurm's own expander.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

from .errors import ConfigError

_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def expand_hostlist(text: str) -> list[str]:
    """``gpu[01-03,07],cpu1`` -> gpu01 gpu02 gpu03 gpu07 cpu1 (duplicates kept, in order)."""
    hosts: list[str] = []
    for entry in _split_entries(text):
        hosts.extend(_expand_entry(entry, text))
    return hosts


def _split_entries(text: str) -> list[str]:
    entries: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _bad(text, "a ']' without its '['")
        if (char == "," or char.isspace()) and depth == 0:
            entries.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise _bad(text, "a '[' without its ']'")
    entries.append("".join(current).strip())
    return [entry for entry in entries if entry]


def _expand_entry(entry: str, text: str) -> list[str]:
    literals = _BRACKET.split(entry)  # literal, bracket, literal, bracket, ..., literal
    if any("[" in part or "]" in part for part in literals[::2]):
        raise _bad(text, f"nested brackets in {entry!r}")
    choices: list[list[str]] = []
    for index, part in enumerate(literals):
        choices.append([part] if index % 2 == 0 else _expand_bracket(part, text))
    return ["".join(combination) for combination in itertools.product(*choices)]


def _expand_bracket(inside: str, text: str) -> list[str]:
    values: list[str] = []
    for piece in inside.split(","):
        piece = piece.strip()
        low, dash, high = piece.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise _bad(text, f"cannot read {piece!r} (ranges look like 01-04)")
        if not dash:
            values.append(low)
            continue
        if int(high) < int(low):
            raise _bad(text, f"range {piece!r} runs backwards")
        width = len(low) if low.startswith("0") else 0
        values.extend(f"{number:0{width}d}" for number in range(int(low), int(high) + 1))
    return values


def _bad(text: str, why: str) -> ConfigError:
    return ConfigError(
        f"node list {text!r}: {why}", "node lists look like gpu[01-04,07] or a[1-2]-b[3-4]"
    )


def slurm_hostnames(text: str) -> list[str]:
    """Expand a hostlist here; where that fails, ask ``scontrol show hostnames``."""
    try:
        return expand_hostlist(text)
    except ConfigError:
        scontrol = shutil.which("scontrol")
        if scontrol is None:
            raise
        result = subprocess.run(
            [scontrol, "show", "hostnames", text], capture_output=True, text=True, timeout=30
        )
        if result.returncode != 0 or not result.stdout.split():
            raise
        return result.stdout.split()


def parse_nodefile(text: str) -> list[str]:
    """A PBS nodefile (one line per MPI process, so hosts repeat) -> each host once, in the
    order first seen. Names are kept as written (fully qualified ones too)."""
    seen: dict[str, None] = {}
    for line in text.splitlines():
        host = line.split("#", 1)[0].strip()
        if host:
            seen.setdefault(host.split()[0], None)
    return list(seen)


def read_nodefile(path: str | Path) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(
            f"cannot read the PBS nodefile {path}: {exc}",
            "run herd inside the PBS job (PBS_NODEFILE is set there), or unset PBS_JOBID",
        ) from None
    hosts = parse_nodefile(text)
    if not hosts:
        raise ConfigError(f"the PBS nodefile {path} lists no host", "check the job's select=")
    return hosts
