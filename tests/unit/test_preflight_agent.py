"""The doctor's node side on this machine: the agent's TCP tests over loopback (real sockets),
the full probe's pieces, and the launcher-side helpers that need no cluster."""

from __future__ import annotations

import io
import json
import os
import socket
import sys
import threading
from pathlib import Path

import pytest

from torchherd.agent import netcheck, probe, probe_full
from torchherd.bench.collective import parse_output
from torchherd.preflight.report import Status
from torchherd.results import RunResult


def test_check_connects_pings_and_measures_over_loopback() -> None:
    listeners, ports, errors = netcheck.listen({"ephemeral": 0})
    try:
        assert errors == {} and ports["ephemeral"] > 0
        with socket.socket() as closed:  # a port nobody listens on
            closed.bind(("127.0.0.1", 0))
            dead = closed.getsockname()[1]
        results = netcheck.check(
            {
                "timeout": 2,
                "targets": [
                    {
                        "name": "up",
                        "addr": "127.0.0.1",
                        "port": ports["ephemeral"],
                        "pings": 3,
                        "bytes": 8 << 20,
                        "seconds": 1,
                    },
                    {"name": "down", "addr": "127.0.0.1", "port": dead},
                ],
            }
        )
    finally:
        for sock in listeners:
            sock.close()
    up, down = results
    assert up["ok"] and up["rtt_ms"] > 0 and up["bytes"] == 8 << 20 and up["gbits"] > 0
    assert not down["ok"] and down["reason"] == "refused"


def test_listen_reports_a_port_in_use_and_picks_a_free_rdzv_port() -> None:
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        listeners, ports, errors = netcheck.listen({"rdzv": port, "other": 0})
    for sock in listeners:
        sock.close()
    assert "rdzv" not in ports and errors["rdzv"].lower().startswith("address already in use")
    listeners, ports, errors = netcheck.listen({"rdzv": 0})
    for sock in listeners:
        sock.close()
    low, high = netcheck.PORT_RANGE
    assert errors == {} and low <= ports["rdzv"] < high


def test_session_answers_the_probe_then_checks_until_stdin_closes() -> None:
    to_agent_r, to_agent_w = os.pipe()
    stdin = os.fdopen(to_agent_r, "r")
    stdout = io.StringIO()
    request = {"probe": {"full": False}, "ports": {"ephemeral": 0, "rdzv": 0}}
    done = threading.Event()

    def agent() -> None:
        netcheck.session(request, stdin, stdout)
        done.set()

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    with os.fdopen(to_agent_w, "w") as writer:
        deadline = threading.Event()
        while not stdout.getvalue() and not deadline.wait(0.05):
            pass
        hello = json.loads(stdout.getvalue().splitlines()[0])
        assert hello["facts"]["port"] == {"port": hello["ports"]["rdzv"], "free": True}
        target = {"name": "x", "addr": "127.0.0.1", "port": hello["ports"]["ephemeral"]}
        writer.write(json.dumps({"check": {"targets": [target], "timeout": 2}}) + "\n")
    assert done.wait(10)
    answer = json.loads(stdout.getvalue().splitlines()[1])
    assert answer["results"][0]["ok"]


def test_credentials_readable_by_others_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text("[default]\n")
    (tmp_path / ".aws" / "credentials").chmod(0o644)
    (tmp_path / ".netrc").write_text("machine x\n")
    (tmp_path / ".netrc").chmod(0o600)
    found = {f["path"]: f for f in probe_full.credentials()}
    assert found["~/.aws/credentials"]["other_readable"] is True
    assert found["~/.netrc"]["other_readable"] is False and found["~/.netrc"]["mode"] == "0600"


def test_disk_reports_free_space_and_write_speed(tmp_path: Path) -> None:
    info = probe_full.disk(str(tmp_path))
    assert info["path"] == str(tmp_path) and info["free_bytes"] > 0 and info["write_mb_s"] > 0
    assert list(tmp_path.iterdir()) == []  # the test file is gone


def test_torch_cache_round_trip_never_keeps_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probe_full._write_cache("abc", {"ok": True, "version": "2.13.0"})
    assert probe_full._read_cache("abc") == {"ok": True, "version": "2.13.0"}
    probe_full._write_cache("bad", {"ok": False})
    assert probe_full._read_cache("bad") is None
    assert probe_full._read_cache(None) is None


def test_torch_fingerprint_changes_with_what_torch_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    first = probe_full._torch_fingerprint()
    if first is None:
        pytest.skip("torch is not installed here")
    assert probe_full._torch_fingerprint() == first
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert probe_full._torch_fingerprint() != first


def test_gpu_lines_from_nvidia_smi_are_parsed() -> None:
    out = "0, GPU-aa, NVIDIA H100 80GB HBM3, 81559, 1234, 97, 550.54.15\n"
    gpus, driver = probe_full._gpus((0, out, ""))
    assert driver == "550.54.15"
    assert gpus == [
        {
            "index": 0,
            "uuid": "GPU-aa",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_mib": 81559,
            "memory_used_mib": 1234,
            "utilization": 97,
        }
    ]
    apps = probe_full._gpu_apps((0, "GPU-aa, 4242, python, [N/A]\n", ""))
    assert apps == [{"gpu_uuid": "GPU-aa", "pid": 4242, "name": "python", "used_mib": None}]


def test_collective_output_is_read_back() -> None:
    row = {"size_bytes": 4096, "seconds": 0.001, "algbw_gbytes": 0.004, "busbw_gbytes": 0.006}
    line = "node1:0 | HERD_ALLREDUCE " + json.dumps(
        {"backend": "gloo", "world_size": 4, "correct": True, "rows": [row]}
    )
    result, rows = parse_output("hello\n" + line + "\n", RunResult("j", 0))
    assert result.status is Status.PASS and "4 ranks (gloo)" in result.summary
    assert rows[0].busbw_gbytes == 0.006
    failed, none = parse_output("", RunResult("j", 1))
    assert failed.status is Status.FAIL and none == ()


def test_probe_finds_the_script_from_the_workdir_and_modules_without_importing(
    tmp_path: Path,
) -> None:
    (tmp_path / "train.py").write_text("print('hi')\n")
    package = tmp_path / "mypkg"
    (package / "sub").mkdir(parents=True)
    # Importing this package would fail: the probe must find modules without running them.
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "job.py").write_text("")
    (package / "__main__.py").write_text("")
    answers = probe.collect({"workdir": str(tmp_path), "entry": {"script": "train.py"}})["entry"]
    assert answers == {"script": "train.py", "path": str(tmp_path / "train.py"), "found": True}
    assert not probe.find_entry({"script": "other.py"}, str(tmp_path))["found"]
    for module, found in [
        ("mypkg.sub.job", True),
        ("mypkg", True),  # runs its __main__
        ("mypkg.sub", False),  # a package without __main__ cannot be run with -m
        ("mypkg.nope", False),
        ("nope", False),
        ("json.tool", True),
    ]:
        assert probe.find_entry({"module": module}, str(tmp_path))["found"] is found, module
    assert "mypkg" not in sys.modules
