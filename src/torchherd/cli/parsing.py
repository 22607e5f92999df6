"""How herd reads a command line before click does.

Commands that run something (``launch SCRIPT [ARGS]``, ``exec -- COMMAND``, ``submit SCRIPT``)
give everything from the script on to the script. Everything before it is herd's: an option herd
does not know is an error with the closest herd option named, never the script's name (click's
own parser would otherwise take ``--nprocs`` for the script, as ``ignore_unknown_options`` did).

On top of that:

- torchrun's spellings of the options herd shares with it are read as herd's
  (``--nproc-per-node``, ``--nproc_per_node=2``, ``--max_restarts``, ...), and torchrun's
  options that herd does in its own way are refused with what to write instead (``--standalone``,
  ``--nnodes``, ``--rdzv-endpoint``, ...);
- ``-m MODULE`` ends herd's options as a script does: what follows belongs to the module;
- ``--debug`` (tracebacks for errors) is taken anywhere before the script, on every command;
- flags show no ``<bool>`` value in ``--help``.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand, TyperGroup

from ..errors import UsageError
from .state import state

# torchrun's spelling -> herd's, where the meaning is the same.
TORCHRUN_SAME = {
    "--nproc-per-node": "--nproc",
    "--nproc_per_node": "--nproc",
    "--max_restarts": "--max-restarts",
    "--log_dir": "--log-dir",
    "--no_python": "--no-python",
}

_RENDEZVOUS = (
    "herd chooses the rendezvous itself (c10d on the first node, a free port checked there, a "
    "fresh id for every attempt) and gives every node its own address",
    "drop it; to pin them, set rdzv_port in [cluster] or addr in a [[node]] of herd.toml",
)
_OUTPUT = (
    "herd keeps every rank's output in files (herd logs JOB --rank R) and shows it live "
    "prefixed host:rank",
    "drop it; --ranks 0 (or 0,3-5) shows only those ranks live",
)

# torchrun options herd does its own way: (what herd does instead, the fix).
TORCHRUN_OTHERWISE: dict[str, tuple[str, str]] = {
    "--standalone": (
        "herd runs on this machine alone whenever there is no herd.toml (and no -c/-H)",
        "drop --standalone",
    ),
    "--nnodes": (
        "herd takes the nodes from herd.toml, -c FILE or -H HOSTS (inside Slurm or PBS, from "
        "the allocation)",
        "drop --nnodes; --min-nodes M lets a restart go on with at least M of them",
    ),
    "--node-rank": (
        "herd starts torchrun on every node itself, each with its own rank",
        "drop it and run herd once, on this machine, for all the nodes",
    ),
    "--local-ranks-filter": (
        "torchrun's filter counts local ranks; herd's --ranks counts global ranks",
        "use --ranks (e.g. --ranks 0 or --ranks 0,3-5)",
    ),
    "--redirects": _OUTPUT,
    "--tee": _OUTPUT,
    "--role": ("herd starts one role of workers", "drop --role"),
    "--start-method": (
        "torchrun's agent starts the workers the default way (spawn) under herd",
        "drop --start-method",
    ),
    "--monitor-interval": ("herd watches the workers itself", "drop --monitor-interval"),
    "--run-path": ("herd runs torchrun's own launcher", "drop --run-path"),
}
for _name in (
    "--master-addr",
    "--master-port",
    "--rdzv-endpoint",
    "--rdzv-backend",
    "--rdzv-id",
    "--rdzv-conf",
    "--local-addr",
    "--rdzv-timeout",
):
    TORCHRUN_OTHERWISE[_name] = _RENDEZVOUS
# torchrun takes every option with underscores too (--node_rank, --rdzv_endpoint).
for _name, _why in list(TORCHRUN_OTHERWISE.items()):
    TORCHRUN_OTHERWISE["--" + _name[2:].replace("-", "_")] = _why

DEBUG = "--debug"
# torchrun's options that say "this machine alone", taken when there is no cluster.
SINGLE_NODE = ("--standalone", "--nnodes")


def flags_without_values(params: list[Any]) -> list[Any]:
    """A flag takes no value: --help should say `--dry-run`, not `--dry-run <bool>`."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


def unwrapped(text: str) -> str:
    """A docstring's paragraphs as single lines: rich keeps a docstring's line breaks, so text
    wrapped at 96 columns in the source was wrapped again at 80 (an orphan word on every other
    line). A line starting a list item ("- ") or indented stays a line of its own."""
    paragraphs = []
    for paragraph in text.strip().split("\n\n"):
        lines: list[str] = []
        for line in paragraph.splitlines():
            item = line.startswith(("- ", "* ", "  "))
            if lines and not item:
                lines[-1] += " " + line.strip()
            else:
                lines.append(line.rstrip())
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


class FlagsAsFlags:
    """Shows a command's or group's flags (its -h/--help too) without a value in --help."""

    params: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        flags_without_values(self.params)
        text = getattr(self, "help", None)
        if text:
            setattr(self, "help", unwrapped(text))  # noqa: B010 - a click attribute

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        return flags_without_values([option])[0] if option is not None else None


class InterruptedCommand(Exception):
    """Ctrl-C while a command ran (its imports are lazy: often during them). typer would turn
    it into a silent exit 130; dispatch says "herd: interrupted" instead."""


class HerdGroup(FlagsAsFlags, TyperGroup):
    """The root command and `herd bench`: flags shown without a value, as on commands."""


class HerdCommand(FlagsAsFlags, TyperCommand):
    """A typer command whose options end where the script (or ``--``) begins, with torchrun's
    spellings read (``torchrun_style``) and ``--debug`` taken on every command."""

    torchrun_style = False
    """Read torchrun's spellings and refuse its options herd does otherwise (herd launch)."""
    ends_options: tuple[str, ...] = ()
    """Options after whose value the rest belongs to what runs (``-m MODULE`` of launch)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self.herd_options_first(args))

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise InterruptedCommand() from None

    def herd_options_first(self, args: list[str]) -> list[str]:
        """``args`` with torchrun's spellings made herd's, ``--debug`` taken out, and ``--``
        inserted where an option like ``-m MODULE`` hands the rest to what runs."""
        takes_value = self._options_with_values()
        state.single_node = None
        # Commands that run something end herd's options at it; others take options anywhere.
        interspersed = self.context_settings.get(
            "allow_interspersed_args", self.allow_interspersed_args
        )
        out: list[str] = []
        i = 0
        while i < len(args):
            word = args[i]
            if word == "--":
                return out + args[i:]
            if not word.startswith("-") or word == "-":
                if not interspersed:
                    return out + args[i:]  # the script (or the command) and its own arguments
                out.append(word)
                i += 1
                continue
            name, eq, value = word.partition("=") if word.startswith("--") else (word, "", "")
            if name == DEBUG:
                state.debug = True
                i += 1
                continue
            if self.torchrun_style and name in SINGLE_NODE:
                # this machine alone: what herd does with no cluster; judged once it is known
                given = (
                    value
                    if eq
                    else (args[i + 1] if name != "--standalone" and i + 1 < len(args) else "")
                )
                if name == "--standalone" or given in ("1", "1:1"):
                    state.single_node = f"{name} {given}".strip()
                    i += 1 if name == "--standalone" or eq else 2
                    continue
            if self.torchrun_style:
                name = self._herd_spelling(name)
                word = name + eq + value
            attached = (
                not word.startswith("--") and len(word) > 2 and word[:2] in takes_value
            )  # -mpkg.train, -c/path
            short = word[:2] if attached else name
            out.append(word)
            i += 1
            if short in takes_value and not eq and not attached and i < len(args):
                out.append(args[i])
                i += 1
            if short in self.ends_options:
                return [*out, "--", *args[i:]] if i < len(args) else out
        return out

    def _herd_spelling(self, name: str) -> str:
        if name in TORCHRUN_SAME:
            return TORCHRUN_SAME[name]
        if name in TORCHRUN_OTHERWISE:
            what, fix = TORCHRUN_OTHERWISE[name]
            raise UsageError(f"{name} is torchrun's option: {what}", fix)
        return name

    def _options_with_values(self) -> set[str]:
        names: set[str] = set()
        for param in self.params:
            if param.param_type_name != "option":
                continue
            if getattr(param, "is_flag", False) or getattr(param, "count", False):
                continue
            names.update(param.opts)
            names.update(param.secondary_opts)
        return names


class LaunchCommand(HerdCommand):
    """`herd launch`: torchrun's spellings, and -m MODULE ends herd's options."""

    torchrun_style = True
    ends_options = ("-m", "--module")


# Context settings for commands that run something: unknown options before it are errors
# (HerdCommand ends herd's options at the script), arguments after it go to the script.
RUNS_SOMETHING: dict[str, Any] = {
    "allow_extra_args": True,
    "ignore_unknown_options": False,
    "allow_interspersed_args": False,
}
