"""Shell completion of what psctl's arguments name: clusters (and the spec files that name them) and roles.

Click runs these when the shell asks (``_PSCTL_COMPLETE=bash_complete``, set up by the line the README gives).
Each reads only ``PSCTL_HOME``'s state files, so a completion costs what ``psctl status`` does; a problem there
completes nothing rather than printing an error into the shell's line.
"""

from __future__ import annotations

from pathlib import Path

import click
from click.shell_completion import CompletionItem

from psctl import observe
from psctl.home import ClusterDir, list_clusters
from psctl.supervisor.state import ClusterRecord, DamagedState, load_state


def _records() -> list[tuple[ClusterDir, ClusterRecord]]:
    found = []
    for cdir in list_clusters():
        try:
            found.append((cdir, load_state(cdir.state_file)))
        except (OSError, DamagedState):
            continue  # (a state file removed meanwhile, or damaged: leave it out)
    return found


def _spec_files(incomplete: str) -> list[str]:
    """The .yaml files that ``incomplete`` begins, as a path (in its folder, or this one)."""
    folder, _, stem = incomplete.rpartition("/")
    base = Path(folder or ".")
    if not base.is_dir():
        return []
    return [f"{folder}/{path.name}" if folder else path.name for path in sorted(base.iterdir())
            if path.name.startswith(stem) and path.suffix in (".yaml", ".yml") and path.is_file()]


def cluster_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The clusters ``incomplete`` begins (unfinished ones first), then the spec files it begins."""
    records = sorted(_records(), key=lambda found: (found[1].state.terminal, found[0].name))
    names = [CompletionItem(cdir.name, help=record.state.value) for cdir, record in records
             if cdir.name.startswith(incomplete)]
    return names + [CompletionItem(path, help="spec file") for path in _spec_files(incomplete)]


def _the_cluster(ctx: click.Context) -> ClusterRecord | None:
    """The cluster the command line names so far, or the one a command without a name would use."""
    try:
        cdir = observe.resolve_cluster(ctx.params.get("name"))
        return load_state(cdir.state_file)
    except (click.ClickException, OSError):  # (DamagedState is a ClickException)
        return None


def role_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The roles of the cluster (named, or the only one) that ``incomplete`` begins."""
    record = _the_cluster(ctx)
    if record is None:
        return []
    return [CompletionItem(r.name, help=r.state.value) for r in record.roles
            if r.name.startswith(incomplete) and not r.retired]
