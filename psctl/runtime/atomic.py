"""Files that readers see whole: the old content or the new, never half of it (also on shared storage)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any, *, compact: bool = False) -> None:
    """A new temporary file beside it (``private_temporary``: other hosts may write beside it), fsync, rename;
    owner-only. ``compact``: one line, by json's C encoder (a supervisor of a thousand roles writes its state
    every second; indented output takes the pure-Python encoder, several times slower)."""
    text = json.dumps(data, separators=(",", ":"), default=str) if compact else json.dumps(data, indent=1, default=str)
    write_text_atomic(path, text)


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` to ``path`` as ``write_json_atomic`` writes: whole or not at all, owner-only."""
    tmp = None
    try:
        tmp = private_temporary(path)
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # (a full disk: what it took goes back)
            if tmp is not None:
                tmp.unlink()
        if isinstance(exc, OSError):  # named for the file meant, not its temporary (a write names none at all)
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


def private_temporary(path: Path) -> Path:
    """A new file beside ``path`` for its next content, of mode 0600: created, never opened where it stood (a
    link planted at a name known in advance, by another user of a shared folder, would be written through),
    its name unique across the hosts and processes that may write beside it."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    return Path(name)
