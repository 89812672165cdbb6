"""vkmoe.warmup.WarmUp, the benchmark tools' warm-up: untimed submissions until both the count and the time are
reached, then exactly `iters` timed ones."""
from vkmoe import warmup


def _run(count, seconds, iters, clock, monkeypatch):
    monkeypatch.setattr(warmup.time, "monotonic", lambda: clock[0])
    warm = warmup.WarmUp(count, seconds, iters)
    made, i = [], 0
    while warm.more(i):
        made.append(warm.begin(i))
        clock[0] += 0.25  # each submission takes a quarter of a second
        i += 1
    return warm, made


def test_count_alone_when_no_time_is_asked(monkeypatch):
    warm, made = _run(3, 0.0, 4, [100.0], monkeypatch)
    assert made == [False] * 3 + [True] * 4 and warm.first_timed == 3
    assert [warm.timed(j) for j in range(7)] == made


def test_time_outlasts_the_count(monkeypatch):
    warm, made = _run(2, 1.0, 3, [100.0], monkeypatch)
    assert made == [False] * 4 + [True] * 3 and warm.first_timed == 4  # 4 x 0.25 s before the first timed one


def test_count_outlasts_the_time(monkeypatch):
    warm, made = _run(6, 0.5, 2, [100.0], monkeypatch)
    assert made == [False] * 6 + [True] * 2
