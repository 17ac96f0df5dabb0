"""The per-host agent (``python -m psctl.agent``): see :mod:`psctl.agent.core`."""
