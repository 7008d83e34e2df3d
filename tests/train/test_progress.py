"""Progress lines: the count, the total, the rate and the time left, one whole line at a time."""

from __future__ import annotations

import logging

from polydraft.train.progress import ProgressLine, duration, number


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_duration_and_number_formats():
    assert [duration(s) for s in (0, 42.4, 187, 7500)] == ["0s", "42s", "3m07s", "2h05m"]
    assert [number(v) for v in (4.44444, 0.0023684, 13020.0, 7, "1/4")] == [
        "4.444",
        "2.37e-03",
        "13.0k",
        "7",
        "1/4",
    ]


def test_a_line_every_n_units_and_at_the_end_with_rate_and_time_left(caplog):
    clock = FakeClock()
    progress = ProgressLine("distill", 10, "sample", every=4, verb="generate", clock=clock)
    with caplog.at_level(logging.INFO, logger="polydraft.train.progress"):
        for _ in range(10):
            clock.now += 0.5
            progress.update()
    assert caplog.messages == [
        "[distill] generate 4/10 samples (40%), 2 samples/s, 3s left",
        "[distill] generate 8/10 samples (80%), 2 samples/s, 1s left",
        "[distill] generate 10/10 samples (100%), 2 samples/s, done",
    ]


def test_a_resumed_count_measures_its_rate_from_this_process_only(caplog):
    clock = FakeClock()
    progress = ProgressLine("pretrain", 100, "step", initial=60, every=10, clock=clock)
    with caplog.at_level(logging.INFO, logger="polydraft.train.progress"):
        for _ in range(10):
            clock.now += 2.0
            progress.update(1, epoch="2/3", loss=4.44444, lr=0.0023684, **{"tokens/s": 13020.0})
    # 10 steps in 20 s: 30 steps left take 60 s (the 60 steps before the resume do not count)
    assert caplog.messages == [
        "[pretrain] step 70/100 (70%), epoch 2/3, loss 4.444, lr 2.37e-03, 13.0k tokens/s, 1m00s left"
    ]


def test_disabled_progress_logs_nothing(caplog):
    progress = ProgressLine("measure", 3, "group", every=1, enabled=False, clock=FakeClock())
    with caplog.at_level(logging.INFO, logger="polydraft.train.progress"):
        progress.update(3)
    assert caplog.messages == []
