"""Metrics files: appended JSON lines, read back whole or from the tail."""

from __future__ import annotations

from pathlib import Path

from psctl.runtime.metrics import MetricsFile, TrainingMeter, last_record, metric_text, metrics_text, read_metrics


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


def test_a_metric_reads_with_4_decimals_or_4_significant_digits_where_those_would_show_nothing() -> None:
    assert [metric_text(v) for v in (0.98333, 0.0690, 12.5, 0.0, 3.2154e-05, -4e-4, 0.001)] == [
        "0.9833", "0.0690", "12.5000", "0.0000", "3.215e-05", "-4.000e-04", "0.0010"]
    assert metrics_text({"loss": 0.1208, "examples": 360.0, "accuracy": 0.9833}) == "loss 0.1208, accuracy 0.9833"
    assert metrics_text({"cpu": 0.2, "loss": 1e-6}, skip=("cpu",)) == "loss 1.000e-06"


def test_the_final_report_gives_the_whole_run_s_rates_not_its_last_interval() -> None:
    """The last interval holds the end's evaluation and checkpoint: a status of 136 steps/s showed 6.4."""
    now = [100.0]
    meter = TrainingMeter(get_time=lambda: now[0])
    for step in range(1, 101):  # 10 steps/s, reported every second
        now[0] += 0.1
        meter.record(loss=0.5, examples=32, global_step=step)
        if step % 10 == 0:
            assert abs(meter.report()["steps_per_sec"] - 10.0) < 1e-6
    now[0] += 5.0  # the final evaluation
    final = meter.report(final=True)
    assert abs(final["steps_per_sec"] - 99 / 9.9) < 1e-6 and abs(final["examples_per_sec"] - 32 * 99 / 9.9) < 1e-6
    assert final["global_step"] == 100


def test_synchronous_training_reports_global_steps_per_second_not_the_workers_batches() -> None:
    """A synchronous round computes N batches (3 here, a backup among them) for one global step: status, top,
    the metrics and the chief's log showed 3x the global step's rate. A resumed run's first result (at global
    step 5000) is where it starts, not 5000 steps done."""
    now = [100.0]
    meter = TrainingMeter(get_time=lambda: now[0], by_global_step=True)
    meter.record(loss=0.5, examples=32, global_step=5000)
    assert meter.report()["steps_per_sec"] == 0.0  # (where it starts)
    for step in range(5001, 5101):  # 10 global steps/s, three workers' results each
        for _ in range(3):
            now[0] += 0.1 / 3
            meter.record(loss=0.5, examples=32, global_step=step - 1 if _ < 2 else step)
        if step % 10 == 0:
            report = meter.report()
            assert abs(report["steps_per_sec"] - 10.0) < 1e-6, report
            assert abs(report["examples_per_sec"] - 3 * 32 * 10.0) < 1e-6  # (the batches computed)
    meter.reset(4900)  # restored from a checkpoint: the steps trained again count again
    for step in range(4901, 4911):
        now[0] += 0.1
        meter.record(loss=0.5, examples=32, global_step=step)
    assert abs(meter.report()["steps_per_sec"] - 10.0) < 1e-6
    final = meter.report(final=True)
    assert abs(final["steps_per_sec"] - 110 / 11.0) < 1e-6 and final["global_step"] == 4910
