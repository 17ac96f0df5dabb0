"""The embedded training runtime: what runs on every host.

Never imports the launcher side (psctl.cli, psctl.spec, psctl.launch, psctl.supervisor).
"""
