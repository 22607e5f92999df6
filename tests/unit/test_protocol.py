"""Rebuilding worker lines from torchrun's teed output, as it really arrives."""

from __future__ import annotations

from torchherd.agent.protocol import RankLines


def test_whole_lines_pass_through() -> None:
    lines = RankLines()
    assert lines.feed("[herd 3 1] hello") == [(3, 1, "hello")]
    assert lines.feed("W1122 torchrun's own warning") == [
        (None, None, "W1122 torchrun's own warning")
    ]


def test_a_line_split_by_the_tee_is_joined_again() -> None:
    # Seen in CI: readline() caught the worker mid-write; the rest came under a second prefix.
    lines = RankLines()
    got = lines.feed("[herd 0 0] RESULT rank=0 sum=10 master=10.0.0.1[herd 0 0] ")
    assert got == [(0, 0, "RESULT rank=0 sum=10 master=10.0.0.1")]


def test_interleaved_ranks_keep_their_own_pieces() -> None:
    lines = RankLines()
    assert lines.feed("[herd 0 0] step 1[herd 1 1] loss 2.5") == [(1, 1, "loss 2.5")]
    assert lines.feed("[herd 0 0]  done") == [(0, 0, "step 1 done")]


def test_unfinished_pieces_come_out_at_the_end() -> None:
    lines = RankLines()
    lines.feed("[herd 2 0] half[herd 3 1] other")
    assert lines.drain() == [(2, None, "half")]
    assert lines.drain() == []
