"""Slurm hostlists (``gpu[01-04,07]``, ``a[1-2]-b[3-4]``) and PBS nodefiles, read into host names;
and host names written back as one hostlist (``compress_hostlist``), for lines about many nodes.

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
from collections.abc import Iterable
from pathlib import Path

from .errors import ConfigError

_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")


def expand_hostlist(text: str) -> list[str]:
    """``gpu[01-03,07],cpu1`` -> gpu01 gpu02 gpu03 gpu07 cpu1 (duplicates kept, in order)."""
    hosts: list[str] = []
    for entry in _split_entries(text):
        hosts.extend(_expand_entry(entry, text))
    return hosts


def compress_hostlist(hosts: list[str]) -> str:
    """The inverse of expand_hostlist for herd's own lines: ``gpu01 gpu02 gpu03 gpu07 cpu1`` ->
    ``gpu[01-03,07],cpu1``. Hosts that differ only in a trailing number share a bracket (zero
    padding kept: a padded number shares one only with numbers of its width); groups come in
    the order of their first host, numbers in order within a group, duplicates once. Expanded
    again, it gives every host once."""
    groups: dict[tuple[str, int], set[int]] = {}
    for host in dict.fromkeys(hosts):
        found = _TRAILING_NUMBER.match(host)
        if found is None:
            groups[(host, -1)] = set()
            continue
        prefix, digits = found.groups()
        padded = len(digits) > 1 and digits.startswith("0")
        # An unpadded number as wide as a padded group's reads the same written padded.
        width = len(digits) if padded or (prefix, len(digits)) in groups else 0
        groups.setdefault((prefix, width), set()).add(int(digits))
    entries = []
    for (prefix, width), numbers in groups.items():
        if width < 0:
            entries.append(prefix)
        elif len(numbers) == 1:
            entries.append(f"{prefix}{min(numbers):0{width}d}")
        else:
            entries.append(f"{prefix}[{_ranges(sorted(numbers), width)}]")
    return ",".join(entries)


# Up to this many nodes a line names each one; above, one hostlist per worker count.
SPELLED_OUT_NODES = 8


def nodes_in_words(nodes: Iterable[tuple[str, int | None]]) -> str:
    """Nodes as (host, workers) for a line a person reads: ``gpu1×8, gpu2×4`` for a few (a
    node whose worker count is not known yet by its host alone); above SPELLED_OUT_NODES, one
    hostlist per worker count, in the order of each count's first node (``sim[0-999]×8``), so
    a thousand nodes take one entry, not a thousand."""
    pairs = list(nodes)
    if len(pairs) > SPELLED_OUT_NODES:
        groups: dict[int | None, list[str]] = {}
        for host, nproc in pairs:
            groups.setdefault(nproc, []).append(host)
        pairs = [(compress_hostlist(hosts), nproc) for nproc, hosts in groups.items()]
    return ", ".join(f"{host}×{nproc}" if nproc else host for host, nproc in pairs)


def _ranges(numbers: list[int], width: int) -> str:
    """1 2 3 5 7 8 -> 1-3,5,7-8 (each number written ``width`` digits wide, zero-padded)."""
    pieces: list[str] = []
    start = previous = numbers[0]
    for number in [*numbers[1:], None]:
        if number is not None and number == previous + 1:
            previous = number
            continue
        low, high = f"{start:0{width}d}", f"{previous:0{width}d}"
        pieces.append(low if start == previous else f"{low}-{high}")
        if number is not None:
            start = previous = number
    return ",".join(pieces)


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
