"""``logs --tail`` reads only the end of a long log, and gives the same lines as reading all of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from psctl import operations
from psctl.home import ClusterDir
from psctl.launch.hostset import placements
from psctl.launch.local import LocalRunner
from psctl.supervisor.state import RoleRecord


class CountingRunner(LocalRunner):
    """The local runner, counting the bytes it hands out."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read = 0

    def read_file(self, path: str, offset: int = 0) -> bytes:
        data = super().read_file(path, offset)
        self.bytes_read += len(data)
        return data

    def read_end(self, path: str, nbytes: int) -> tuple[bytes, int]:
        data, size = super().read_end(path, nbytes)
        self.bytes_read += len(data)
        return data, size


@pytest.fixture
def log(tmp_path: Path) -> tuple[operations.RoleLog, CountingRunner, Path]:
    cdir = ClusterDir(tmp_path / "c")
    cdir.create()
    runner = CountingRunner()
    places = placements(cdir, {}, {"localhost": runner}, cwd=str(tmp_path))
    record = RoleRecord("worker-0", "worker", 0, "localhost", "127.0.0.1", 1)
    path = Path(cdir.role_log("worker-0", 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    return operations.RoleLog("worker-0", places, record), runner, path


@pytest.mark.parametrize("n", [1, 3, 50, 5000])
def test_the_last_lines_of_a_long_log_without_reading_all_of_it(log, n: int) -> None:
    role_log, runner, path = log
    lines = [f"line {i} " + "x" * (i % 300) for i in range(20_000)]  # ~3 MB, lines of varied length
    path.write_text("\n".join(lines) + "\n")
    got, offset = operations.tail_log(role_log, 1, n)
    assert got == lines[-n:]
    assert offset == path.stat().st_size  # following goes on from the end
    # Only the end was read: the chunks grow 4x, so at most ~5x what the lines hold (plus the first chunk).
    needed = sum(len(line) + 1 for line in lines[-n:])
    assert runner.bytes_read <= 6 * needed + operations.TAIL_CHUNK
    assert runner.bytes_read < path.stat().st_size


def test_a_short_log_a_long_last_line_and_a_missing_log(log) -> None:
    role_log, _runner, path = log
    long_line = "y" * (3 * operations.TAIL_CHUNK)
    path.write_text(f"first\n{long_line}\nlast")
    assert operations.tail_log(role_log, 1, 2) == ([long_line, "last"], path.stat().st_size)
    assert operations.tail_log(role_log, 1, 10)[0] == ["first", long_line, "last"]
    assert operations.tail_log(role_log, 2, 5) == ([], 0)
