import json

from relayrl.tracking.timeline import Timeline


def test_busy_between_clips_intervals_and_writes_picture(tmp_path):
    tl = Timeline()
    tl.intervals = [("engine", 0.0, 2.0), ("trainer", 2.0, 3.0), ("engine", 2.5, 4.0)]
    assert tl.busy_between("engine", 1.0, 3.0) == 1.5  # 1..2 and 2.5..3
    assert tl.busy_between("trainer", 0.0, 10.0) == 1.0
    assert tl.busy_seconds("engine") == 3.5
    png = tl.save(tmp_path)
    assert png.exists() and png.stat().st_size > 1000
    assert len(json.loads((tmp_path / "timeline.json").read_text())) == 3


def test_busy_context_records_lane():
    tl = Timeline()
    with tl.busy("engine"):
        pass
    (lane, start, end), = tl.intervals
    assert lane == "engine" and 0 <= start <= end


def test_idle_fraction_stays_right_after_hours_of_small_pieces():
    """The async engine lane is recorded in 0.1 s pieces: after ~33 minutes the old cap dropped
    every new interval, so a busy engine read as 100% idle."""
    tl = Timeline()
    t = 0.0
    for _ in range(40_000):  # 4,000 s of continuous busy pieces, then a gap, then pieces with gaps
        tl.record("engine", t, t + 0.1)
        t += 0.1
    for k in range(30_000):
        tl.record("engine", t + 0.05, t + 0.1)  # busy half of every 0.1 s
        tl.record("trainer", t, t + 0.05)
        t += 0.1
    assert len(tl.intervals) <= 20_001
    assert abs(tl.busy_between("engine", t - 1.0, t) - 0.5) < 1e-6
    assert abs(tl.busy_between("engine", 100.0, 200.0) - 100.0) < 1e-6
