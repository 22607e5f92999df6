"""A node's step times as the job record keeps them: the measure, and a bounded series that
keeps its shape and its end."""

from __future__ import annotations

from torchherd.step_times import COMPUTE, WALL, WORK, StepSeries, beat_seconds, limit_for


def test_a_beats_work_is_its_step_less_its_wait_else_its_compute() -> None:
    assert beat_seconds(0.05, 0.03, 0.18) == (0.15, WORK)
    assert beat_seconds(0.05, None, None) == (0.05, COMPUTE)
    assert beat_seconds(None, 0.2, 0.18) == (0.0, WORK)  # a clock's jitter is no negative work
    assert beat_seconds(None, None, None) is None


def test_a_long_run_stays_bounded_keeps_its_shape_and_its_last_step() -> None:
    series = StepSeries(limit=10)
    # 1000 reports: 0.1 s per step, then 0.3 s for the last 250 (a node slowed).
    for i in range(1000):
        series.add(i + 1, float(i), 1000.0 + i, (0.3 if i >= 750 else 0.1, WORK))
    points = series.points()
    assert 5 <= len(points) <= 10, points
    assert points[-1][0] == 1000 and points[-1][2] == 1999.0  # the end is never dropped
    steps = [p[0] for p in points]
    assert steps == sorted(steps)
    assert points[0][1] == 0.1 and points[-1][1] == 0.3  # the slowdown is still there
    # Every point but the newest covers the same number of reports: windows sum to all.
    assert sum(w.count for w in series.windows) == 1000
    assert len({w.count for w in series.windows[:-1]}) == 1


def test_a_script_that_beats_only_its_step_gets_seconds_per_step_from_its_count() -> None:
    series = StepSeries()
    series.add(10, 100.0, 0.0, None)  # the first report: no rate yet
    series.add(20, 102.0, 2.0, None)
    series.add(20, 103.0, 3.0, None)  # no step since: nothing to say
    series.add(30, 106.0, 6.0, None)
    assert series.measure == WALL
    assert series.points() == [[20, 0.2, 2.0], [30, 0.4, 6.0]]
    # Timings arrive (a Trainer's beats): from then on they are the measure, not mixed in.
    series.add(31, 106.5, 6.5, (0.05, WORK))
    series.add(40, 109.0, 9.0, None)
    assert series.measure == WORK
    assert series.points() == [[31, 0.05, 6.5]]


def test_a_halving_with_an_odd_point_out_keeps_it() -> None:
    series = StepSeries(limit=3)
    for step in range(1, 5):
        series.add(step, float(step), float(step), (0.1 * step, WORK))
    assert series.points() == [[2, 0.15, 2.0], [4, 0.35, 4.0]]


def test_a_large_job_keeps_fewer_points_per_node_and_never_too_few() -> None:
    assert limit_for(2) == 240
    assert limit_for(1000) == 48  # 48,000 points in all: the record stays a few megabytes
    assert limit_for(100_000) == 24
