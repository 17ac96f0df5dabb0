"""psctl: launch and supervise parameter-server training clusters."""

__version__ = "0.1.0"
