"""What `herd submit` may write into a job script, checked against the scheduler's own rules.

Every value lands in a ``#SBATCH``/``#PBS`` directive line, and the job name also in a file
name: a newline would end the directive block and run the rest as shell, a space would split
the directive, ``/`` or ``..`` would put the script outside ``~/.herd/submitted/``. So each
value must match what the scheduler itself accepts (a conservative reading of sbatch(1) and
qsub(1) / the PBS Professional reference), or it is a usage error naming the option, the rule
and an example. Nothing is escaped or "cleaned": a value is taken as is, or refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class Rule:
    pattern: re.Pattern[str]
    says: str
    """The rule in words, for the error."""
    example: str


# PBS: a job name starts with a letter, up to 236 printable characters without white space
# (qsub -N); Slurm takes more, so the PBS rule, limited to characters that are safe in a file
# name, serves both (and the name is part of the kept script's file name).
NAME = Rule(
    re.compile(r"[A-Za-z][A-Za-z0-9._+-]{0,199}"),
    "a letter, then up to 199 letters, digits, '.', '_', '+' or '-'",
    "--name train-gpt2",
)
# Slurm: partition names from slurm.conf, several allowed as a comma-separated list.
PARTITION = Rule(
    re.compile(r"[A-Za-z0-9._-]+(,[A-Za-z0-9._-]+)*"),
    "partition names (letters, digits, '.', '_', '-'), comma-separated",
    "--partition gpu or --partition gpu,gpu-long",
)
# PBS: a queue name starts with a letter (letters, digits, '_', '-'), optionally @server.
QUEUE = Rule(
    re.compile(r"[A-Za-z][A-Za-z0-9_-]*(@[A-Za-z0-9.-]+)?"),
    "a queue name (a letter, then letters, digits, '_' or '-'), optionally @server",
    "--queue workq or --queue gpu@pbs1",
)
ACCOUNT = Rule(
    re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*"),
    "letters, digits, '.', '_', '+' or '-', starting with a letter or digit",
    "--account myproj",
)
# Output files: a path without white space or quotes; Slurm's %j, %x, %N... patterns allowed.
OUTPUT = Rule(
    re.compile(r"[A-Za-z0-9._/%~+@:-]+"),
    "a path of letters, digits and . _ / % ~ + @ : - (no spaces, quotes or newlines)",
    "--output logs/train-%j.out",
)
# PBS: a (custom) resource name in select=, as defined by the site.
GPU_RESOURCE = Rule(
    re.compile(r"[A-Za-z][A-Za-z0-9_]*"),
    "a resource name (a letter, then letters, digits or '_')",
    "--gpu-resource ngpus",
)


def check(option: str, value: str | None, rule: Rule, scheduler: str) -> None:
    """UsageError unless ``value`` (when given) is one the scheduler accepts."""
    if value is None or rule.pattern.fullmatch(value):
        return
    raise UsageError(
        f"{option} {value!r} cannot go into a {scheduler} job script: it must be {rule.says}",
        f"write it like {rule.example}",
    )


def check_submit_values(
    scheduler: str,
    *,
    name: str,
    partition: str | None,
    account: str | None,
    output: str | None,
    gpu_resource: str,
) -> None:
    """Check every value `herd submit` writes into the script (and the name into a path)."""
    check("--name", name, NAME, scheduler)
    if scheduler == "slurm":
        check("--partition", partition, PARTITION, scheduler)
    else:
        check("--queue", partition, QUEUE, scheduler)
    check("--account", account, ACCOUNT, scheduler)
    check("--output", output, OUTPUT, scheduler)
    if scheduler == "pbs":
        check("--gpu-resource", gpu_resource, GPU_RESOURCE, scheduler)
