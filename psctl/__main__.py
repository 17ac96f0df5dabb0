"""``python -m psctl``: the same as the ``psctl`` command."""

from psctl.cli import main

main()
