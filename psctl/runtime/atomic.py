"""Files that readers see whole: the old content or the new, never half of it (also on shared storage)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any) -> None:
    """Temporary file (named for this host and process: other hosts may write beside it), fsync, rename;
    owner-only."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
