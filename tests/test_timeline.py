import json

from relayrl.timeline import Timeline


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
