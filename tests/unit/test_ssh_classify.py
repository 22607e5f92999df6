"""ssh's own error words -> a reason and a fix (recorded output of OpenSSH 9.x)."""

from __future__ import annotations

import pytest

from torchherd.transport.ssh import classify_ssh_failure

CHANGED = """@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @
@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@
Host key for gpu1 has changed and you have requested strict checking.
Host key verification failed."""


@pytest.mark.parametrize(
    ("stderr", "reason", "fix"),
    [
        (
            "ssh: connect to host 10.0.0.9 port 22: Connection timed out",
            "timeout",
            "did not answer",
        ),
        ("ssh: connect to host gpu1 port 22: Connection refused", "refused", "start sshd"),
        ("root@gpu1: Permission denied (publickey,password).", "auth", "herd ssh-setup"),
        (CHANGED, "host-key-changed", "ssh-keygen -R gpu1"),
        (
            "ssh: Could not resolve hostname gpu1: Name or service not known",
            "unknown-name",
            "spelling",
        ),
        ("ssh: connect to host 10.0.0.9 port 22: No route to host", "no-route", "network path"),
        ("kex_exchange_identification: read: Connection reset by peer", "ssh-error", "ssh -v gpu1"),
    ],
)
def test_reasons(stderr: str, reason: str, fix: str) -> None:
    failure = classify_ssh_failure("gpu1", 255, stderr, timeout=10)
    assert failure is not None
    assert failure.reason == reason
    assert fix in failure.remedy
    assert failure.detail and not failure.detail.startswith("@")


def test_remote_command_failure_is_not_unreachable() -> None:
    assert classify_ssh_failure("gpu1", 1, "Traceback ...", timeout=10) is None
