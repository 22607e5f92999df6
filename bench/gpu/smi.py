"""What nvidia-smi says about this machine's GPUs, and whether herd's probe says the same.

nvidia-smi is the independent witness here: the doctor's facts come from herd's own probe (its
torch import and its own nvidia-smi query), and this module reads nvidia-smi again, with other
fields and a parser of its own, so the two can be compared (``compare_with_probe``).
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

QUERY_FIELDS = ("index", "uuid", "name", "memory.total", "driver_version", "pci.bus_id")
MEMORY_TOLERANCE = 0.03
"""torch's total_memory leaves out what the driver reserves: about 0.6 % on an H100."""


@dataclass(frozen=True)
class SmiGpu:
    index: int
    uuid: str
    name: str
    memory_mib: int | None
    driver: str
    bus_id: str


@dataclass(frozen=True)
class SmiReport:
    """The GPUs nvidia-smi lists (all of them, whatever CUDA_VISIBLE_DEVICES says)."""

    gpus: tuple[SmiGpu, ...] = ()
    cuda: str | None = None
    """The newest CUDA the driver supports (nvidia-smi's header), not torch's CUDA."""
    error: str | None = None
    """Why nvidia-smi gave nothing: not installed, failed, no answer."""

    @property
    def driver(self) -> str | None:
        return self.gpus[0].driver if self.gpus else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": [asdict(g) for g in self.gpus],
            "cuda": self.cuda,
            "driver": self.driver,
            "error": self.error,
        }


def parse_query(text: str) -> list[SmiGpu]:
    """``nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits`` output."""
    gpus = []
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if len(row) != len(QUERY_FIELDS):
            continue
        values = dict(zip(QUERY_FIELDS, (cell.strip() for cell in row), strict=True))
        if not values["index"].isdigit():
            continue
        memory = values["memory.total"]
        gpus.append(
            SmiGpu(
                index=int(values["index"]),
                uuid=values["uuid"],
                name=values["name"],
                memory_mib=int(memory) if memory.isdigit() else None,  # "[N/A]" on some GPUs
                driver=values["driver_version"],
                bus_id=values["pci.bus_id"],
            )
        )
    return gpus


def parse_cuda_version(header: str) -> str | None:
    """The ``CUDA Version: 12.4`` of nvidia-smi's plain output."""
    match = re.search(r"CUDA Version:\s*([0-9]+(?:\.[0-9]+)*)", header)
    return match[1] if match else None


Runner = Callable[[list[str]], tuple[int, str, str]]


def _run(argv: list[str]) -> tuple[int, str, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return -1, "", "no answer within 30 s"
    except OSError as exc:
        return -1, "", str(exc)
    return done.returncode, done.stdout, done.stderr


def read_smi(run: Runner = _run) -> SmiReport:
    """Ask nvidia-smi; an SmiReport with ``error`` set when it is missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return SmiReport(error="nvidia-smi not found")
    code, out, err = run(
        [smi, f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits"]
    )
    if code != 0:
        why = (err.strip() or out.strip() or f"exit code {code}").splitlines()[0]
        return SmiReport(error=f"nvidia-smi failed: {why}")
    gpus = parse_query(out)
    _, header, _ = run([smi])
    return SmiReport(gpus=tuple(gpus), cuda=parse_cuda_version(header))


def visible(gpus: tuple[SmiGpu, ...], cuda_visible_devices: str | None) -> list[SmiGpu]:
    """The GPUs a CUDA program sees under ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs, in that
    order; the list ends at the first entry that names no GPU, as CUDA's does)."""
    if cuda_visible_devices is None:
        return list(gpus)
    chosen: list[SmiGpu] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        match = [
            g
            for g in gpus
            if (entry.isdigit() and g.index == int(entry))
            or (entry.startswith("GPU-") and g.uuid.startswith(entry))
        ]
        if len(match) != 1 or match[0] in chosen:
            break
        chosen.append(match[0])
    return chosen


@dataclass
class Comparison:
    """What herd's probe (the doctor's facts for one host) and nvidia-smi agree and differ on."""

    agree: list[str] = field(default_factory=list)
    differ: list[str] = field(default_factory=list)


def compare_with_probe(
    facts: Mapping[str, Any], smi: SmiReport, cuda_visible_devices: str | None = None
) -> Comparison:
    """Compare one host's facts from `herd doctor --json` with nvidia-smi's: GPU count (the
    probe's device files, its torch import, its own nvidia-smi query), names, memory, driver,
    and torch's CUDA against the newest the driver supports."""
    result = Comparison()
    seen = visible(smi.gpus, cuda_visible_devices)
    torch_facts = facts.get("torch") or {}
    devices = torch_facts.get("devices") or []

    def check(what: str, ok: bool, detail: str) -> None:
        (result.agree if ok else result.differ).append(f"{what}: {detail}")

    listed = len([g for g in facts.get("gpus") or [] if "error" not in g])
    check("GPUs listed", listed == len(smi.gpus), f"probe {listed}, nvidia-smi {len(smi.gpus)}")
    for source, count in (
        ("device files (gpu_count)", facts.get("gpu_count")),
        ("torch.cuda.device_count()", torch_facts.get("device_count")),
    ):
        check("GPUs visible", count == len(seen), f"{source} {count}, nvidia-smi {len(seen)}")
    names = Counter(str(d.get("name")) for d in devices)
    wanted = Counter(g.name for g in seen)
    # torch orders devices fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID: compare as sets.
    check("GPU names", names == wanted, f"torch {_names(names)}, nvidia-smi {_names(wanted)}")
    torch_memory = sorted(int(d.get("memory") or 0) for d in devices)
    smi_memory = sorted((g.memory_mib or 0) << 20 for g in seen)
    close = len(torch_memory) == len(smi_memory) and all(
        b > 0 and abs(a - b) <= MEMORY_TOLERANCE * b
        for a, b in zip(torch_memory, smi_memory, strict=True)
    )
    check(
        "GPU memory",
        close,
        f"torch {_gib(torch_memory)}, nvidia-smi {_gib(smi_memory)} "
        f"(within {MEMORY_TOLERANCE:.0%})",
    )
    if smi.driver is not None:
        driver = facts.get("driver")
        check("driver", driver == smi.driver, f"probe {driver}, nvidia-smi {smi.driver}")
    build = torch_facts.get("cuda")
    if build and smi.cuda:
        fits = _major(build) <= _major(smi.cuda)
        check(
            "CUDA",
            fits,
            f"torch built for CUDA {build}, driver supports up to {smi.cuda}"
            + ("" if fits else ": a newer CUDA major than the driver has"),
        )
    return result


def _names(counts: Counter[str]) -> str:
    return ", ".join(f"{n} x {name}" for name, n in sorted(counts.items())) or "none"


def _gib(values: list[int]) -> str:
    return "[" + ", ".join(f"{v / 2**30:.1f}" for v in values) + "] GiB"


def _major(version: str) -> int:
    head = version.split(".")[0]
    return int(head) if head.isdigit() else 0
