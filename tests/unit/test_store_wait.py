"""The wrapper's wait for the rendezvous host's store (agent/elastic.py): which nodes wait, and
that a real TCPStore still serves its clients after the wait's connection came and went."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest

from torchherd.agent.elastic import store_to_wait_for, wait_for_store

torch_run = pytest.importorskip("torch.distributed.run")
distributed = pytest.importorskip("torch.distributed")


def parsed(*rendezvous: str) -> object:
    """torchrun's own parse of a node's arguments as herd's plan writes them."""
    return torch_run.parse_args(["--nnodes=3", *rendezvous, "--nproc-per-node=1", "job.py"])


@pytest.mark.parametrize(
    ("rendezvous", "waits_for"),
    [
        (["--rdzv-backend=static", "--rdzv-endpoint=10.0.0.1:29500", "--node-rank=0"], None),
        (
            ["--rdzv-backend=static", "--rdzv-endpoint=10.0.0.1:29500", "--node-rank=2"],
            ("10.0.0.1", 29500),
        ),
        (["--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-conf=is_host=1"], None),
        (
            ["--rdzv-backend=c10d", "--rdzv-endpoint=[fd00::1]:29400", "--rdzv-conf=is_host=0"],
            ("fd00::1", 29400),
        ),
        # No word on who hosts the store: herd does not guess, torch's own wait follows.
        (["--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400"], None),
    ],
)
def test_only_a_node_that_joins_the_store_as_a_client_waits(
    rendezvous: list[str], waits_for: tuple[str, int] | None
) -> None:
    assert store_to_wait_for(parsed(*rendezvous)) == waits_for


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_wait_ends_once_the_store_is_up_and_the_store_serves_its_clients_after_it() -> None:
    port = free_port()
    servers: list[object] = []

    def host_later() -> None:
        time.sleep(0.5)  # the host's wrapper still imports torch
        servers.append(
            distributed.TCPStore(
                "127.0.0.1", port, 2, True, datetime.timedelta(seconds=30), wait_for_workers=False
            )
        )

    host = threading.Thread(target=host_later)
    host.start()
    try:
        assert wait_for_store("127.0.0.1", port, within=30) is True
        host.join()
        # The wait's connection came and went: the store still takes a real client.
        client = distributed.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=10))
        client.set("joined", "node2")
        assert servers[0].get("joined") == b"node2"  # type: ignore[attr-defined]
    finally:
        host.join()


def test_a_store_that_never_comes_is_left_to_torchs_own_wait() -> None:
    assert wait_for_store("127.0.0.1", free_port(), within=0.3) is False
