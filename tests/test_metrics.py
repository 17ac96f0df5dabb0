"""Metrics files: appended JSON lines, read back whole or from the tail."""

from __future__ import annotations

from pathlib import Path

from psctl.runtime.metrics import MetricsFile, last_record, read_metrics


def test_last_record_finds_the_newest_of_an_event_from_the_tail(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    out = MetricsFile(path)
    for step in range(5000):  # far more than the tail that is read
        out.write({"event": "progress", "global_step": step, "loss": float("nan") if step == 3 else 1.0})
        if step % 1000 == 0:
            out.write({"event": "final", "global_step": step})
    out.close()
    assert path.stat().st_size > 64 << 10
    assert last_record(path, "progress")["global_step"] == 4999
    assert last_record(path, "final", tail_bytes=1 << 30)["global_step"] == 4000
    assert last_record(path, "final", tail_bytes=1024) is None  # only the tail is read
    progress = [r for r in read_metrics(path) if r["event"] == "progress"]
    assert len(progress) == 5000
    assert progress[3]["loss"] is None  # non-finite values are written as null


def test_last_record_skips_a_torn_last_line_and_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "progress", "global_step": 7}\n{"event": "progress", "glob')
    assert last_record(path, "progress") == {"event": "progress", "global_step": 7}
    assert last_record(tmp_path / "none.jsonl", "progress") is None
