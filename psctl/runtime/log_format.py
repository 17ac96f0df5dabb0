"""How psctl's roles and supervisor write their log lines, for what reads them back (``psctl logs --all``
merges roles' lines by their time; the supervisor finds why a role failed in its last lines)."""

from __future__ import annotations

LOG_FORMAT = "%(asctime)s %(levelname)s %(message)s"
#: The time a line starts with (``logging``'s default asctime), which sorts as text.
LOG_TIME = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
