"""Keeping secrets out of what herd prints or stores: dry-runs, logs, job records."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
MASK = "********"
# Values this short are too likely to occur by chance to be masked inside free text.
MIN_SECRET_LENGTH = 4


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def redact_env(env: Mapping[str, str], secret_values: Iterable[str] = ()) -> dict[str, str]:
    """A copy of env with secret-looking names and known secret values masked."""
    values = {v for v in secret_values if len(v) >= MIN_SECRET_LENGTH}
    return {
        key: MASK if is_secret_name(key) or value in values else redact_text(value, values)
        for key, value in env.items()
    }


def redact_text(text: str, secret_values: Iterable[str]) -> str:
    """Mask every occurrence of a known secret value inside free text."""
    for value in sorted(
        (v for v in secret_values if len(v) >= MIN_SECRET_LENGTH), key=len, reverse=True
    ):
        text = text.replace(value, MASK)
    return text


def redact_argv(argv: Iterable[str], secret_values: Iterable[str]) -> list[str]:
    """A command line with every known secret value masked, as dry-runs and job records show it."""
    values = list(secret_values)
    return [redact_text(word, values) for word in argv]
