"""``logs --tail`` reads only the end of a long log, and gives the same lines as reading all of it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from psctl import observe
from psctl.home import ClusterDir
from psctl.launch.hostset import placements
from psctl.launch.local import LocalRunner
from psctl.supervisor.state import RoleRecord


class CountingRunner(LocalRunner):
    """The local runner, counting the bytes it hands out."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read = 0
        self.largest_read = 0

    def read_file(self, path: str, offset: int = 0, size: int = -1) -> bytes:
        data = super().read_file(path, offset, size)
        self.bytes_read += len(data)
        self.largest_read = max(self.largest_read, len(data))
        return data

    def read_end(self, path: str, nbytes: int) -> tuple[bytes, int]:
        data, size = super().read_end(path, nbytes)
        self.bytes_read += len(data)
        return data, size


@pytest.fixture
def log(tmp_path: Path) -> tuple[observe.RoleLog, CountingRunner, Path]:
    cdir = ClusterDir(tmp_path / "c")
    cdir.create()
    runner = CountingRunner()
    places = placements(cdir, {}, {"localhost": runner}, cwd=str(tmp_path))
    record = RoleRecord("worker-0", "worker", 0, "localhost", "127.0.0.1", 1)
    path = Path(cdir.role_log("worker-0", 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    return observe.RoleLog("worker-0", places, record), runner, path


@pytest.mark.parametrize("n", [1, 3, 50, 5000])
def test_the_last_lines_of_a_long_log_without_reading_all_of_it(log, n: int) -> None:
    role_log, runner, path = log
    lines = [f"line {i} " + "x" * (i % 300) for i in range(20_000)]  # ~3 MB, lines of varied length
    path.write_text("\n".join(lines) + "\n")
    got = observe.tail_log(role_log, 1, n)
    assert list(got) == lines[-n:]
    assert got.offset == path.stat().st_size  # following goes on from the end
    # Only the end was read: the chunks grow 4x, so at most ~5x what the lines hold (plus the first chunk).
    needed = sum(len(line) + 1 for line in lines[-n:])
    assert runner.bytes_read <= 6 * needed + observe.TAIL_CHUNK
    assert runner.bytes_read < path.stat().st_size


def test_a_short_log_a_long_last_line_and_a_missing_log(log) -> None:
    role_log, _runner, path = log
    long_line = "y" * (3 * observe.TAIL_CHUNK)
    path.write_text(f"first\n{long_line}\nlast")
    two = observe.tail_log(role_log, 1, 2)
    assert (list(two), two.offset) == ([long_line, "last"], path.stat().st_size)
    assert list(observe.tail_log(role_log, 1, 10)) == ["first", long_line, "last"]
    assert list(observe.tail_log(role_log, 2, 5)) == []


def test_a_whole_log_is_read_a_chunk_at_a_time_and_gives_every_line(log, monkeypatch: pytest.MonkeyPatch) -> None:
    """`logs ROLE` (no --tail) and `logs -f` read all of a log: a chunk at a time as it is printed (a log of 2 GB
    was read whole first: 141 s and 7.5 GB), the same lines, a character cut between two chunks whole, and a
    last line without its newline printed, with the follower going on after it."""
    role_log, runner, path = log
    monkeypatch.setattr(observe, "READ_CHUNK", 7)  # many chunk ends, in the middle of lines and characters
    lines = ["", "élan ☃ ü", "x" * 30, "a\r", "naïve", "end without newline"]
    path.write_bytes("\n".join(lines).encode())
    whole = observe.tail_log(role_log, 1, 0)
    assert list(whole) == "\n".join(lines).splitlines()
    assert whole.offset == path.stat().st_size
    assert runner.largest_read == 7 and runner.bytes_read == path.stat().st_size
    assert list(observe.tail_log(role_log, 2, 0)) == []  # (a missing log: nothing)


def test_events_reads_only_the_end_of_a_long_file_and_all_of_it_a_chunk_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "events.jsonl"
    lines = [f'{{"n": {i}, "pad": "{"p" * (i % 200)}"}}' for i in range(50_000)]  # ~5 MB
    path.write_text("\n".join(lines) + "\n")
    reads: list[int] = []
    real_end, real_file = LocalRunner.read_end, LocalRunner.read_file
    monkeypatch.setattr(LocalRunner, "read_end", lambda self, p, n: reads.append(n) or real_end(self, p, n))
    monkeypatch.setattr(LocalRunner, "read_file",
                        lambda self, p, offset=0, size=-1: reads.append(size) or real_file(self, p, offset, size))
    assert list(observe.tail_lines(path, 20)) == lines[-20:]
    assert reads == [observe.TAIL_CHUNK]
    reads.clear()
    assert list(observe.tail_lines(path, 0)) == lines
    assert reads and set(reads) == {observe.READ_CHUNK}
    assert list(observe.tail_lines(tmp_path / "none.jsonl", 5)) == list(observe.tail_lines(tmp_path / "no", 0)) == []


def test_every_role_s_log_merged_in_time_order_with_its_role_as_prefix(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from psctl.cli import cli
    from psctl.supervisor.state import ClusterRecord, save_state

    home = tmp_path / "home"
    cdir = ClusterDir(home / "merge")
    cdir.create()
    roles = [RoleRecord(n, n.split("-")[0], 0, "localhost", "127.0.0.1", 1, attempt=a) for n, a in
             (("chief-0", 1), ("worker-0", 2))]
    save_state(cdir.state_file, ClusterRecord(name="merge", cluster_id="merge-1", roles=roles))
    Path(cdir.role_log("chief-0", 1)).write_text(
        "2026-11-25 10:00:01,000 INFO chief starting\n"
        "2026-11-25 10:00:03,500 ERROR step failed\nTraceback (most recent call last):\n  boom\n"
        "2026-11-25 10:00:05,000 INFO chief done\n")
    Path(cdir.role_log("worker-0", 1)).write_text("2026-11-25 09:00:00,000 INFO an earlier attempt\n")
    Path(cdir.role_log("worker-0", 2)).write_text(  # (a TensorFlow program's: its C++ log's time, its prints)
        "2026-11-25 10:00:02.000123: I tensorflow/core/server.cc:42] worker serving\nworker step 7 of 9\n"
        "2026-11-25 10:00:04,000 INFO worker step 7\n")
    runner = CliRunner()
    result = runner.invoke(cli, ["logs", "--all", "merge"], env={"PSCTL_HOME": str(home)})
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        # an earlier attempt's lines too (why the role restarted is what one looks for), marked as such
        "worker-0 (attempt 1): 2026-11-25 09:00:00,000 INFO an earlier attempt",
        "chief-0: 2026-11-25 10:00:01,000 INFO chief starting",
        "worker-0: 2026-11-25 10:00:02.000123: I tensorflow/core/server.cc:42] worker serving",
        "worker-0: worker step 7 of 9",  # keeps the time of the line above
        "chief-0: 2026-11-25 10:00:03,500 ERROR step failed",
        "chief-0: Traceback (most recent call last):",  # keeps the time of the line above: stays with it
        "chief-0:   boom",
        "worker-0: 2026-11-25 10:00:04,000 INFO worker step 7",
        "chief-0: 2026-11-25 10:00:05,000 INFO chief done",
    ]
    last = runner.invoke(cli, ["logs", "--all", "merge", "-n", "2"], env={"PSCTL_HOME": str(home)})
    assert last.output.splitlines() == ["worker-0: 2026-11-25 10:00:04,000 INFO worker step 7",
                                        "chief-0: 2026-11-25 10:00:05,000 INFO chief done"]
    Path(cdir.role_log("worker-0", 1)).unlink()  # an earlier attempt's log gone (or never started): warned of
    earlier = runner.invoke(cli, ["logs", "--all", "merge", "-n", "1"], env={"PSCTL_HOME": str(home)})
    assert earlier.exit_code == 0, earlier.output
    assert earlier.stdout.splitlines() == ["chief-0: 2026-11-25 10:00:05,000 INFO chief done"]
    assert f"warning: a log is missing: {cdir.role_log('worker-0', 1)} (deleted or moved, or the attempt never " \
           "started?)" in " ".join(earlier.stderr.split()), earlier.stderr
    Path(cdir.role_log("chief-0", 1)).unlink()  # a role's latest log deleted: said, the others shown, exit 4
    gone = runner.invoke(cli, ["logs", "--all", "merge", "-n", "1"], env={"PSCTL_HOME": str(home)})
    assert gone.exit_code == 4, gone.output
    assert gone.stdout.splitlines() == ["worker-0: 2026-11-25 10:00:04,000 INFO worker step 7"]
    assert f"a log is missing: {cdir.role_log('chief-0', 1)} (deleted or moved?)" in " ".join(gone.stderr.split())
    assert "1 log(s) of 'merge' missing" in " ".join(gone.stderr.split()), gone.stderr
    bad = runner.invoke(cli, ["logs", "--all", "worker-0", "merge"], env={"PSCTL_HOME": str(home)})
    assert bad.exit_code == 2 and "with --all, give only the cluster's name" in bad.output
    missing = runner.invoke(cli, ["logs"], env={"PSCTL_HOME": str(home)})
    assert missing.exit_code == 2 and "or use --all for every role" in missing.output


def test_a_role_is_named_by_its_name_its_task_or_a_kind_only_one_role_has(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from psctl.cli import cli
    from psctl.supervisor.state import ClusterRecord, save_state

    home = tmp_path / "home"
    cdir = ClusterDir(home / "names")
    cdir.create()
    names = ("chief-0", "worker-0", "worker-1", "ps-0")
    save_state(cdir.state_file, ClusterRecord(name="names", cluster_id="names-1", roles=[
        RoleRecord(n, n.split("-")[0], int(n[-1]), "localhost", "127.0.0.1", 1, attempt=1) for n in names]))
    for name in names:
        Path(cdir.role_log(name, 1)).write_text(f"2026-11-27 10:00:00,000 INFO I am {name}\n")

    def logs(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli, ["logs", *args], env={"PSCTL_HOME": str(home)})
        return result.exit_code, result.output.strip()

    assert logs("chief", "names") == (0, "2026-11-27 10:00:00,000 INFO I am chief-0")
    assert logs("worker:1", "names") == (0, "2026-11-27 10:00:00,000 INFO I am worker-1")
    assert logs("ps", "names", "--attempt", "1") == (0, "2026-11-27 10:00:00,000 INFO I am ps-0")
    code, said = logs("worker", "names")
    assert code == 2 and "'worker' names 2 roles of cluster 'names': worker-0, worker-1; name one" in said
    code, said = logs("evaluator", "names")
    assert code == 2 and "no role 'evaluator' in cluster 'names'; roles are: chief-0, worker-0, worker-1, ps-0" in said
    code, said = logs("chief", "names", "--attempt", "2")
    assert code == 2 and "chief-0 has attempts 1..1" in said


def test_events_shows_each_event_and_skips_lines_that_are_not_one(tmp_path: Path) -> None:
    """A torn or foreign line in events.jsonl is skipped (a list, a time that is text or out of range gave a
    traceback)."""
    from click.testing import CliRunner

    from psctl.cli import cli
    from psctl.supervisor.state import ClusterRecord, save_state

    home = tmp_path / "home"
    cdir = ClusterDir(home / "ev")
    cdir.create()
    save_state(cdir.state_file, ClusterRecord(name="ev", cluster_id="ev-1", roles=[]))
    good = {"time": 1_700_000_000, "role": "worker-1", "from": "running", "to": "lost", "reason": "SIGKILL"}
    odd = ['[1, 2]', '{"time": "x", "role": "ps-0", "to": "lost"}', '{"time": 1e30, "role": "ps-1"}',
           '{"time": null, "role": "chief-0", "from": "starting", "to": "running"}', '{"torn']
    cdir.events_file.write_text("\n".join([json.dumps(good), *odd]) + "\n")
    result = CliRunner().invoke(cli, ["events", "ev"], env={"PSCTL_HOME": str(home)})
    assert result.exit_code == 0, result.output
    stamp = time.strftime("%H:%M:%S", time.localtime(good["time"]))
    assert result.stdout.splitlines() == [
        f"{stamp}  worker-1     running -> lost  SIGKILL",
        "??:??:??  ps-0         None -> lost",
        "??:??:??  ps-1         None -> None",
        "??:??:??  chief-0      starting -> running",
    ]
    cdir.events_file.write_text("")
    none = CliRunner().invoke(cli, ["events", "ev"], env={"PSCTL_HOME": str(home)})
    assert (none.exit_code, none.stdout) == (0, ""), none.output
    assert none.stderr == f"no events recorded for cluster 'ev' ({cdir.events_file})\n"


def test_follow_reads_a_log_cut_short_from_its_start_again_and_strips_crlf(tmp_path: Path) -> None:
    """`logs -f` of a log truncated in place (rotated by copytruncate) read nothing more, ever: its offset was past
    the end. And it kept the carriage return of a CRLF line, which `logs` without -f drops."""
    from psctl.supervisor.state import ClusterRecord, ClusterState, save_state

    cdir = ClusterDir(tmp_path / "home" / "fol")
    cdir.create()
    role = RoleRecord("worker-0", "worker", 0, "localhost", "127.0.0.1", 1, attempt=1)
    record = ClusterRecord(name="fol", cluster_id="fol-1", roles=[role], state=ClusterState.RUNNING)
    save_state(cdir.state_file, record)
    path = Path(cdir.role_log("worker-0", 1))
    path.write_bytes(b"old line 1\r\nold line 2\n")
    log = observe.RoleLog("worker-0", placements(cdir, {}, {"localhost": LocalRunner()}, cwd=str(tmp_path)), role)
    lines = observe.follow(cdir, log, start_attempt=1, offset=0, poll=0.01)
    assert [next(lines), next(lines)] == ["old line 1", "old line 2"]
    path.write_bytes(b"new\n")  # cut short, then written on
    assert next(lines) == "new"
    save_state(cdir.state_file, ClusterRecord(name="fol", cluster_id="fol-1", roles=[role],
                                              state=ClusterState.SUCCEEDED))
    assert list(lines) == []
