"""The supervisor: one per cluster; starts roles, tracks heartbeats, restarts what fails."""
