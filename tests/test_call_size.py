"""Steps per call from the chief (training.steps_per_execution): a fixed number, or sized from the steps' time."""

from __future__ import annotations

import pytest

from psctl.runtime.call_size import AUTO, CALL_SECONDS, MAX_STEPS, CallSizer


def test_a_fixed_setting_is_kept_but_never_schedules_more_than_remain() -> None:
    sizer = CallSizer(10)
    sizer.observe(1, 0.0001)  # what the steps take does not matter then
    assert sizer.steps(1000, workers=2) == 10
    assert sizer.steps(7, workers=2) == 7
    assert sizer.last == 7
    assert sizer.steps(0, workers=2) == 0
    assert sizer.mean() == (10 + 7) / 2  # a call of no steps is no call


def test_auto_runs_one_step_per_call_until_a_step_was_measured() -> None:
    sizer = CallSizer(AUTO)
    assert sizer.mean() == 0.0
    assert sizer.steps(1000, workers=2) == 1
    sizer.observe(0, 1.0)  # not a measurement: no steps
    sizer.observe(3, 0.0)  # nor this: no time
    assert sizer.steps(1000, workers=2) == 1


@pytest.mark.parametrize(("step_seconds", "expected"), [
    (CALL_SECONDS / 5, 5),  # fast steps share a call ...
    (CALL_SECONDS / 1000, MAX_STEPS),  # ... up to MAX_STEPS
    (CALL_SECONDS * 3, 1),  # slow ones keep a call each
])  # fmt: skip
def test_auto_sizes_calls_to_last_about_call_seconds(step_seconds: float, expected: int) -> None:
    sizer = CallSizer(AUTO)
    sizer.observe(4, 4 * step_seconds * 1.01)  # a call's time is the sum of its steps'
    assert sizer.steps(100_000, workers=2) == expected


def test_auto_follows_a_change_of_step_time_smoothly() -> None:
    sizer = CallSizer(AUTO)
    sizer.observe(1, CALL_SECONDS / 20)
    assert sizer.steps(100_000, workers=1) == 20
    sizer.observe(20, CALL_SECONDS * 2)  # the steps got 2x slower (a tenth of a call's time each)
    after_one = sizer.steps(100_000, workers=1)
    assert 10 < after_one < 20  # one slow call moves the estimate part of the way, not all of it
    for _ in range(30):
        sizer.observe(10, CALL_SECONDS)
    assert sizer.steps(100_000, workers=1) == 10


def test_auto_shrinks_the_last_calls_so_that_workers_finish_together() -> None:
    sizer = CallSizer(AUTO)
    sizer.observe(1, CALL_SECONDS / 1000)
    assert sizer.steps(10_000, workers=4) == MAX_STEPS
    # 40 steps left among 4 workers with two calls queued each: 5 per call, not one worker taking all 32
    assert sizer.steps(40, workers=4) == 5
    assert sizer.steps(3, workers=4) == 1
    assert sizer.last == 1


@pytest.mark.parametrize("setting", [0, -1, "8", "fast", True, 2.5])
def test_a_bad_setting_is_refused(setting: object) -> None:
    with pytest.raises(ValueError, match="steps_per_execution must be auto or an integer >= 1"):
        CallSizer(setting)  # type: ignore[arg-type]


def test_auto_shrinks_calls_towards_a_checkpoint_and_grows_again_after_it() -> None:
    sizer = CallSizer(AUTO)
    sizer.observe(1, CALL_SECONDS / 1000)
    assert sizer.steps(10_000, workers=2, until_boundary=1_000) == MAX_STEPS
    assert sizer.steps(10_000, workers=2, until_boundary=40) == 10  # 40 steps to it: 4 calls of 10 in flight
    assert sizer.steps(10_000, workers=2, until_boundary=0) == 1  # past it: single steps until it is taken
    assert sizer.steps(10_000, workers=2, until_boundary=None) == MAX_STEPS
    fixed = CallSizer(8)
    assert fixed.steps(10_000, workers=2, until_boundary=0) == 8  # a fixed size is the user's to keep
