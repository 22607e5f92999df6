"""`python -m torchherd` is the `herd` command."""

from .cli import run

run()
