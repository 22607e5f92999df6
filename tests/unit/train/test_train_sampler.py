"""ResumableSampler across simulated ranks: determinism, sharding, mid-epoch resume, and
resume on a different number of ranks."""

from __future__ import annotations

from collections import Counter

import pytest

from torchherd.train import ResumableSampler, TrainError


def ranks(size: int, world: int, **kwargs: object) -> list[ResumableSampler]:
    return [
        ResumableSampler(range(size), rank=r, world_size=world, **kwargs)  # type: ignore[arg-type]
        for r in range(world)
    ]


def take(samplers: list[ResumableSampler], per_rank: int) -> list[int]:
    """Let every rank consume ``per_rank`` samples in lockstep, as DDP training does."""
    taken: list[int] = []
    for sampler in samplers:
        taken += list(sampler)[:per_rank]
        sampler.advance(per_rank)
    return taken


def test_same_seed_same_order_and_new_order_each_epoch() -> None:
    a, b = (
        ResumableSampler(range(100), seed=3, rank=0, world_size=1),
        ResumableSampler(range(100), seed=3, rank=0, world_size=1),
    )
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    assert sorted(list(a)) == list(range(100))
    assert list(ResumableSampler(range(100), seed=4, rank=0, world_size=1)) != first


def test_epoch_order_does_not_depend_on_world_size() -> None:
    orders = {w: ranks(50, w, seed=9)[0].epoch_order(2) for w in (1, 2, 3, 8)}
    assert len({tuple(o) for o in orders.values()}) == 1


def test_no_shuffle_is_in_order() -> None:
    assert list(ResumableSampler(range(6), shuffle=False, rank=1, world_size=2)) == [1, 3, 5]


def test_ranks_partition_the_epoch() -> None:
    shares = [list(s) for s in ranks(100, 4, seed=1)]
    assert all(len(share) == 25 for share in shares)
    assert sorted(sum(shares, [])) == list(range(100))


def test_padding_without_drop_last_and_trimming_with_it() -> None:
    padded = [list(s) for s in ranks(10, 4, seed=0)]
    assert [len(s) for s in padded] == [3, 3, 3, 3]
    counts = Counter(sum(padded, []))
    assert set(counts) == set(range(10)) and sum(counts.values()) == 12
    trimmed = [list(s) for s in ranks(10, 4, seed=0, drop_last=True)]
    assert [len(s) for s in trimmed] == [2, 2, 2, 2]
    assert len(set(sum(trimmed, []))) == 8
    assert len(ranks(10, 4, drop_last=True)[0]) == 2 and len(ranks(10, 4)[0]) == 3


def test_resume_mid_epoch_continues_the_same_order() -> None:
    straight = ranks(120, 3, seed=5)
    expected_rest = [list(s)[10:] for s in straight]
    interrupted = ranks(120, 3, seed=5)
    take(interrupted, 10)
    state = interrupted[0].state_dict()
    assert state["consumed"] == 30 and state["epoch"] == 0
    resumed = ranks(120, 3, seed=5)
    for sampler in resumed:
        sampler.load_state_dict(state)
    assert [list(s) for s in resumed] == expected_rest


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (3, 5), (8, 1)])
def test_changing_world_size_sees_every_sample_exactly_once(before: int, after: int) -> None:
    size = 1000
    first = ranks(size, before, seed=11, drop_last=True)
    seen = take(first, 37)
    state = first[0].state_dict()
    second = ranks(size, after, seed=11, drop_last=True)
    for sampler in second:
        sampler.load_state_dict(state)
    per_rank = len(second[0])
    seen += take(second, per_rank)
    counts = Counter(seen)
    assert max(counts.values()) == 1
    # Only the tail that does not divide among the new ranks is dropped, and only it.
    unseen = set(range(size)) - set(counts)
    assert len(unseen) == (size - 37 * before) % after
    assert unseen == set(second[0].epoch_order()[size - len(unseen) :])


def test_set_epoch_resets_progress_but_not_for_the_same_epoch() -> None:
    sampler = ResumableSampler(range(10), rank=0, world_size=1)
    sampler.advance(4)
    sampler.set_epoch(0)
    assert sampler.consumed == 4 and len(sampler) == 6
    sampler.set_epoch(1)
    assert sampler.consumed == 0 and len(sampler) == 10


def test_state_from_another_dataset_or_seed_is_refused() -> None:
    state = ResumableSampler(range(10), seed=1, rank=0, world_size=1).state_dict()
    with pytest.raises(TrainError, match="dataset of 10"):
        ResumableSampler(range(11), seed=1, rank=0, world_size=1).load_state_dict(state)
    with pytest.raises(TrainError, match="seed"):
        ResumableSampler(range(10), seed=2, rank=0, world_size=1).load_state_dict(state)


def test_impossible_rank_is_refused() -> None:
    with pytest.raises(TrainError):
        ResumableSampler(range(10), rank=2, world_size=2)
