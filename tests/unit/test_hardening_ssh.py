"""The user's StrictHostKeyChecking: read from real `ssh -G` output, kept unless it is ssh's
default, and only asked once learned is needed; an unknown key under `yes` is named as such
(recorded OpenSSH 9.x words)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from torchherd.transport.host_keys import HostKeyPolicy, option_for, parse_setting
from torchherd.transport.ssh import classify_ssh_failure

UNKNOWN = (
    "No ED25519 host key is known for 10.0.0.9 and you have requested strict checking.\n"
    "Host key verification failed."
)


def test_an_unknown_key_under_strict_checking_is_not_called_changed() -> None:
    failure = classify_ssh_failure("gpu1", 255, UNKNOWN, timeout=10)
    assert failure is not None and failure.reason == "host-key-unknown"
    assert "ssh gpu1 true" in failure.remedy and "ssh-keygen -R" not in failure.remedy
    assert failure.describe().startswith("gpu1: host key not known")


def test_only_the_default_gets_accept_new() -> None:
    assert parse_setting("user root\nstricthostkeychecking ask\nbatchmode no\n") == "ask"
    assert option_for("ask") == {"StrictHostKeyChecking": "accept-new"}
    for theirs in ("true", "false", "accept-new"):
        assert option_for(parse_setting(f"stricthostkeychecking {theirs}\n")) == {}


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client here")
def test_the_policy_asks_ssh_once_per_node(tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(
        "Host strict\n    StrictHostKeyChecking yes\n\n"
        "Host new\n    StrictHostKeyChecking accept-new\n"
    )
    ssh = shutil.which("ssh")
    assert ssh is not None
    policy = HostKeyPolicy([ssh, "-F", str(config)])
    # Not learned yet: nothing is passed, so the user's own config applies as it is.
    assert policy.option("plain") == {} and not policy.learned("plain")

    async def learn_all() -> None:
        for host in ("strict", "new", "plain"):
            await policy.learn(host)

    asyncio.run(learn_all())
    assert policy.option("strict") == {}
    assert policy.option("new") == {}
    assert policy.option("plain") == {"StrictHostKeyChecking": "accept-new"}
    config.write_text("Host plain\n    StrictHostKeyChecking yes\n")
    asyncio.run(policy.learn("plain"))
    assert policy.option("plain") == {"StrictHostKeyChecking": "accept-new"}  # remembered
