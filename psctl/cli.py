"""The ``psctl`` command line: parse, call one operation, render. It holds no cluster state itself."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import stat
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

# The commands that start, change or stop a cluster import psctl.operations where they run (spec validation with
# numpy, certificates, the agents' gRPC): the read-only ones (status, logs, top, ls) need psctl.observe only, and
# start in ~0.13 s instead of ~0.3 (tests/test_cli.py holds them to it).
from psctl import __version__, completion, observe
from psctl.errors import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    ClusterStopped,
    LogNotFound,
    PsctlError,
    TrainingFailed,
    UsageError,
)
from psctl.home import ClusterDir, list_clusters, nearest_existing, psctl_home
from psctl.render import (
    checkpoint_text,
    host_table,
    newest_global_step,
    plan_table,
    progress,
    progress_line,
    result_of,
    status_dict,
    status_view,
    step_of_steps,
)
from psctl.runtime.metrics import metrics_text
from psctl.supervisor.state import ClusterRecord, ClusterState, DamagedState, load_state
from psctl.top import snapshot, top_view

console = Console()
err_console = Console(stderr=True)


#: ``ctx.meta`` key: the command ``psctl`` resolved, for its usage errors.
COMMAND_NAME = "psctl.command"


class PsctlGroup(click.Group):
    """Turns PsctlError, and a command's usage error (an unknown option, a value out of range), into one line on
    stderr and its exit code; tracebacks only with --debug."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PsctlError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                traceback.print_exc()
            print_error(exc.format_message())
            ctx.exit(exc.exit_code)
        except click.UsageError as exc:  # (click's own form is four lines: usage, a hint, a blank, the error)
            print_usage_error(exc, ctx)
        except OSError as exc:  # the machine's, not psctl's: a full disk, a read-only folder, too many open files
            if exc.errno == errno.EPIPE:
                raise  # (`psctl logs --all | head`: click ends quietly on a closed pipe)
            if ctx.obj and ctx.obj.get("debug"):
                traceback.print_exc()
            print_error(os_error_text(exc))
            ctx.exit(EXIT_FAILURE)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None,
                                                                           list[str]]:
        name, command, rest = super().resolve_command(ctx, args)
        ctx.meta[COMMAND_NAME] = name  # (for a usage error click raises without the command's context)
        return name, command, rest

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:  # psctl's own options (`psctl --bogus`)
            print_usage_error(exc, exc.ctx)


#: click >= 8.2 raises this for a group called with no command (its help, not a mistake); 8.1 prints the help.
_NO_ARGS_IS_HELP: type[click.UsageError] | None = getattr(click.exceptions, "NoArgsIsHelpError", None)


def print_usage_error(exc: click.UsageError, ctx: click.Context | None) -> NoReturn:
    """A usage error in one line, with where to read the command's usage; exit 2."""
    context = exc.ctx or ctx
    if _NO_ARGS_IS_HELP is not None and isinstance(exc, _NO_ARGS_IS_HELP) and context is not None:  # `psctl`
        click.echo(context.get_help())
        sys.exit(0)
    where = context.command_path if context is not None else "psctl"
    if exc.ctx is None and ctx is not None and ctx.meta.get(COMMAND_NAME):  # (an option's missing value)
        where = f"{ctx.command_path} {ctx.meta[COMMAND_NAME]}"
    if isinstance(exc, click.NoSuchOption) and exc.option_name == "--debug":  # psctl's, given after a command
        print_error(f"--debug is psctl's option: give it before the command (psctl --debug {where.split()[-1]} ...)")
        sys.exit(exc.exit_code)
    print_error(f"{exc.format_message().rstrip('.')} (see `{where} --help`)")
    sys.exit(exc.exit_code)


def os_error_text(exc: OSError) -> str:
    """An OSError in one line: what, where, and for the usual ones of a machine, what to do."""
    where = f"{exc.filename}: " if exc.filename else ""
    what = exc.strerror or str(exc)
    fix = {errno.ENOSPC: "free space there", errno.EDQUOT: "free space there (your quota is used up)",
           errno.EROFS: "its file system is mounted read-only", errno.EMFILE: "raise the limit (ulimit -n)",
           errno.EACCES: "check the permissions"}.get(exc.errno or 0)
    return f"{where}{what}" + (f" ({fix}; `psctl --debug` shows where)" if fix else " (`psctl --debug` shows where)")


def print_error(message: str) -> None:
    """``error: message`` on stderr, one line however wide (escaped: a path or key may look like rich markup)."""
    err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)


@click.group(cls=PsctlGroup)
@click.version_option(__version__, prog_name="psctl")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Launch and supervise parameter-server training clusters."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    _show_warnings()


class _Warnings(logging.Handler):
    """``warning: message`` on the standard error of the moment, as the commands' own warnings read (what psctl's
    modules log, such as a checkpoint passed over, was printed bare)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"{record.levelname.lower()}: {record.getMessage()}", file=sys.stderr)
        except Exception:  # (a closed stderr: nothing to say it on)
            self.handleError(record)


def _show_warnings() -> None:
    """psctl's modules' warnings and errors on stderr (set once per process)."""
    logger = logging.getLogger("psctl")
    if not any(isinstance(h, _Warnings) for h in logger.handlers):
        logger.addHandler(_Warnings(logging.WARNING))
        logger.propagate = False


#: ``--set KEY.PATH=VALUE`` (repeatable): the spec's values changed without editing it (psctl.spec.overrides).
set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
    help="Change one of the spec's values (YAML), e.g. --set training.steps=2000; repeatable.")


@cli.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@set_option
def validate(spec: str, overrides: tuple[str, ...]) -> None:
    """Check a cluster spec and print the plan (which role runs where)."""
    from psctl import operations

    cluster_spec, plan = operations.plan_spec(spec, overrides)
    operations.check_local_program(cluster_spec, plan)  # (as `up --dry-run` does: the two agree)
    console.print(plan_table(plan))
    console.print(f"[green]{escape(spec)}: valid[/green] ({len(plan.instances)} roles)")


@cli.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@set_option
def check(spec: str, overrides: tuple[str, ...]) -> None:
    """Check that the spec's hosts are ready: SSH, python and modules, psctl, ports, disk, clocks."""
    from psctl import operations

    cluster_spec, plan = operations.plan_spec(spec, overrides)
    if cluster_spec.backend == "slurm":
        from psctl.slurm_cluster import check_submit_host

        check_submit_host(cluster_spec)
        assert cluster_spec.slurm is not None
        partition = f"partition {cluster_spec.slurm.partition!r} exists" if cluster_spec.slurm.partition else \
            "the default partition"
        console.print(f"{escape(spec)}: Slurm's commands are here and {partition}; the job's nodes are Slurm's "
                      "to check when it runs", soft_wrap=True)
        return
    operations.check_local_program(cluster_spec, plan)
    runners = operations.ssh_runners(cluster_spec, plan)
    if not runners:
        console.print(f"{escape(spec)}: every role runs on this machine; its ports are free (no host to check)")
        return
    try:
        reports = operations.check_hosts(cluster_spec, plan, runners)
    finally:
        for runner in runners.values():
            runner.close()
    console.print(host_table(reports))
    for report in reports.values():
        for line in report.warnings:
            err_console.print(f"[yellow]warning:[/yellow] {escape(line)}")
    console.print(f"[green]{len(reports)} host(s) ready[/green] for {len(plan.instances)} roles")


@cli.command()
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--detach", "-d", is_flag=True, help="Return once the cluster is starting; do not watch it.")
@click.option("--dry-run", is_flag=True, help="Validate and print the plan; start nothing.")
@set_option
def up(spec: str, detach: bool, dry_run: bool, overrides: tuple[str, ...]) -> None:
    """Start the cluster SPEC describes and watch it until training finishes (Ctrl-C detaches)."""
    from psctl import operations

    cluster_spec, plan = operations.plan_spec(spec, overrides)
    if dry_run:
        operations.check_local_program(cluster_spec, plan)
        console.print(plan_table(plan))
        console.print(f"dry run: nothing started ({len(plan.instances)} roles planned)")
        return
    name = cluster_spec.name
    runs_before = ClusterDir.named(name).kept_runs()
    try:
        cdir = operations.bring_up(
            cluster_spec, plan, warn=lambda line: err_console.print(f"[yellow]warning:[/yellow] {escape(line)}")
        )
    except KeyboardInterrupt:  # before it runs, Ctrl-C abandons the start; once it runs, it detaches (below)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a second Ctrl-C must not cut the stop short)
        try:
            operations.abandon_start(name)
        finally:
            signal.signal(signal.SIGINT, previous)
        err_console.print(f"interrupted while starting: cluster {name!r} stopped; nothing of it is left running",
                          markup=False, highlight=False, soft_wrap=True)
        sys.exit(EXIT_INTERRUPTED)
    runs = cdir.kept_runs()
    if runs and runs[-1] not in runs_before:
        console.print(f"the last run's logs, metrics, events and result are kept in {runs[-1]}", markup=False,
                      highlight=False, soft_wrap=True)
    if detach:
        console.print(f"cluster {name!r} is starting; watch it with `psctl status {name}`", markup=False)
        return
    try:
        record = _watch(cdir)
    except KeyboardInterrupt:
        console.print(
            f"\ndetached: cluster {name!r} keeps running. `psctl status {name}`, `psctl logs ROLE {name}`, "
            f"`psctl down {name}`",
            markup=False,
        )
        return
    _finish_line(cdir, record)


#: How often ``psctl up`` looks at the state file (a stat; it is read again only when it changed), redraws, and
#: checks that the supervisor still runs (a Slurm cluster's: a query of Slurm, not to be made 20 times a second).
WATCH_POLL = 0.05
WATCH_REDRAW = 0.25
WATCH_ALIVE_EVERY = 1.0


def _watch(cdir: ClusterDir, *, plain_every: float = 5.0) -> Any:
    """A live table on a terminal; elsewhere (CI logs, pipes) a progress line every few seconds. The state
    file is read again only when it changed (the supervisor writes it about once a second, and once more with
    the outcome), so that the end is seen within WATCH_POLL without parsing a large cluster's state each time."""
    live = Live(console=console, refresh_per_second=4, transient=False) if console.is_terminal else None
    last_line = drawn = 0.0
    alive_checked = float("-inf")
    stale = False
    seen: tuple[int, int, int] | None = None
    record: Any = None
    if live is not None:
        live.start()
    try:
        while True:
            stat = cdir.state_file.stat()
            changed = (stat.st_ino, stat.st_mtime_ns, stat.st_size) != seen  # (written anew, then renamed)
            if changed:
                seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
                record = load_state(cdir.state_file)
            now = time.monotonic()
            if now - alive_checked >= WATCH_ALIVE_EVERY:
                alive_checked = now
                stale = observe.is_stale(cdir, record)
            if live is not None and (changed or now - drawn >= WATCH_REDRAW):
                drawn = now
                live.update(status_view(cdir, record, stale=stale))
            elif live is None and (now - last_line >= plain_every or record.state.terminal):
                last_line = now
                click.echo(progress_line(cdir, record))
            if record.state.terminal:
                return record
            if stale:
                raise PsctlError(
                    f"the supervisor of {record.name!r} died; roles may still run",
                    hint=f"`psctl supervise {record.name}` adopts them, `psctl down {record.name}` stops everything",
                )
            time.sleep(WATCH_POLL)
    finally:
        if live is not None:
            live.stop()


def _steps_text(record: ClusterRecord, result: dict[str, Any]) -> str:
    """``1000 steps in 1.2s``; where the chief resumed (a checkpoint of an earlier run of the same name, or the
    ps's global step after a restart of the chief), the steps it ran and from where; the steps trained again
    after a lost ps was restored (the run's cost of it, else only in the chief's log)."""
    text = _resumed_text(record, result)
    again = result.get("recomputed_steps", 0)
    if again:
        text += f"; {again} of them trained again after a ps was lost"
    return text


def _resumed_text(record: ClusterRecord, result: dict[str, Any]) -> str:
    total = result.get("global_step", 0)
    this_run = result.get("steps_this_run", total)
    took = f"{result.get('seconds', 0):.1f}s"
    if this_run >= total:
        return f"{total} steps in {took}"
    start = total - this_run
    chief = next((r for r in record.roles if r.role == "chief"), None)
    if chief is not None and chief.attempt > 1:
        return f"{total} steps; {this_run} in {took} since the chief resumed at global step {start}"
    folder = Path(result["checkpoint"]).parent if result.get("checkpoint") else "its checkpoint folder"
    if this_run == 0:
        return (f"nothing to train: an earlier run's checkpoint in {folder} is at global step {start}, at or past "
                f"training.steps {record.steps} (raise training.steps to train on; remove that folder, or name "
                f"the cluster differently, to start afresh)")
    return f"{total} steps; {this_run} in {took} from an earlier run's checkpoint at global step {start} in {folder}"


def _finish_line(cdir: ClusterDir, record: Any) -> None:
    if record.state == ClusterState.SUCCEEDED and record.result is None:  # a program of its own (TensorFlow)
        chief = next((r for r in record.roles if r.role == "chief"), None)
        step = chief.global_step if chief is not None else 0
        took = f" in {time.time() - record.created_at:.1f}s" if record.created_at else ""
        console.print(f"[bold green]training finished[/bold green]: the chief exited 0 at step {step}{took}; "
                      f"its output: `psctl logs chief-0 {record.name}`", highlight=False, soft_wrap=True)
        return
    if record.state == ClusterState.SUCCEEDED:
        result = record.result or {}
        metrics = result.get("metrics", {})
        shown = metrics_text(metrics)
        console.print(
            f"[bold green]training finished[/bold green]: {escape(_steps_text(record, result))}; test split: {shown}; "
            f"checkpoint: {escape(checkpoint_text(result))}",
            highlight=False,
            soft_wrap=True,  # one line, also in a pipe: scripts read it
        )
        if result.get("checkpoint_failures"):
            err_console.print(f"[yellow]warning:[/yellow] checkpoints of {record.name!r} failed; the chief's log "
                              f"says why: `psctl logs chief {record.name}`", highlight=False, soft_wrap=True)
        if result.get("damaged_checkpoints"):
            err_console.print(
                f"[yellow]warning:[/yellow] {len(result['damaged_checkpoints'])} checkpoint(s) of {record.name!r} did "
                f"not verify, and training went on from an older one (or its initializers): "
                f"{escape('; '.join(result['damaged_checkpoints']))}", highlight=False, soft_wrap=True)
        return
    if record.state == ClusterState.STOPPED:
        step = newest_global_step(record, progress(cdir, record))
        again = "resumes it from its last checkpoint" if record.checkpoint_dir else "trains it again (it kept no " \
            "checkpoints)"
        raise ClusterStopped(f"cluster {record.name!r} was stopped at global step {step} of {record.steps}, before "
                             f"training finished: {record.reason}", hint=f"`psctl up` of its spec {again}")
    raise TrainingFailed(f"cluster {record.name!r} failed: {record.reason}",
                         hint=f"logs in {cdir.logs}")


@cli.command()
@click.argument("name", required=False, shell_complete=completion.cluster_names)
@click.option("--json", "as_json", is_flag=True, help="Print the state as JSON, for scripts.")
def status(name: str | None, as_json: bool) -> None:
    """Show a cluster's roles, their state and training progress."""
    cdir = observe.resolve_cluster(name)
    record = load_state(cdir.state_file)
    stale = observe.is_stale(cdir, record)
    if as_json:
        click.echo(json.dumps(status_dict(cdir, record, stale=stale), indent=2, default=str))
        return
    console.print(status_view(cdir, record, stale=stale))
    if stale and result_of(cdir, record) is not None:  # (psctl's ps and workers end by themselves a minute later)
        by_themselves = "" if record.framework == "tensorflow" else " (its ps and workers end by themselves a minute " \
            "after the end)"
        err_console.print(
            f"[yellow]hint:[/yellow] training finished, but the supervisor of {record.name!r} died before it "
            f"stopped the other roles{by_themselves}: `psctl supervise {record.name}` sees the cluster to its end, "
            f"`psctl down {record.name}` stops whatever is left"
        )
    elif stale:
        err_console.print(
            f"[yellow]hint:[/yellow] the supervisor of {record.name!r} is not running; "
            f"`psctl supervise {record.name}` adopts what runs, `psctl down {record.name}` stops whatever is left"
        )


@cli.command()
@click.argument("name", required=False, shell_complete=completion.cluster_names)
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot as JSON and exit.")
@click.option("--interval", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Seconds between refreshes.")
def top(name: str | None, as_json: bool, interval: float) -> None:
    """A live view of where each role's time goes: steps/s, step time, pull/compute/push/wait, requests/s,
    CPU and memory; stragglers and hot parameter servers flagged. Ctrl-C leaves it."""
    cdir = observe.resolve_cluster(name)
    record = load_state(cdir.state_file)
    if as_json:
        click.echo(json.dumps(snapshot(record), indent=2, default=str))
        return
    if not console.is_terminal or record.state.terminal:
        console.print(top_view(record, console.width))
        return
    try:
        with Live(top_view(record, console.width), console=console, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval)
                record = load_state(cdir.state_file)
                live.update(top_view(record, console.width), refresh=True)
                if record.state.terminal:
                    return
    except KeyboardInterrupt:
        pass


@cli.command()
@click.argument("names", nargs=-1, metavar="[NAME]...", shell_complete=completion.cluster_names)
@click.option("--output", "-o", "out", default="curves.png", show_default=True, type=click.Path(dir_okay=False),
              help="The PNG file to write.")
def plot(names: tuple[str, ...], out: str) -> None:
    """Draw the training curves of cluster NAME (loss, accuracy, steps/s by global step) into a PNG; of several
    clusters (the runs of a sweep), side by side in each panel. A run resumed from a checkpoint continues the
    curves of the runs before it (kept under the cluster's history/)."""
    from psctl.plot import plot as draw
    from psctl.plot import resumed_curves

    check_output_path(out, "--output")
    cdirs = observe.resolve_clusters(names)
    for cdir in cdirs:
        refuse_a_tensorflow_program(cdir, "writes no psctl metrics to plot",
                                    "its own summaries (TensorBoard), as the program writes them")
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        drawn = draw({cdir.name: resumed_curves([*(run / "run" for run in cdir.kept_runs()), cdir.run_dir])
                      for cdir in cdirs}, Path(out))
    except OSError as exc:
        raise PsctlError(f"cannot write {out}: {exc.strerror or exc}",
                         hint="give --output a path in a folder you can write") from exc
    console.print(f"wrote {out}: {', '.join(drawn)}", markup=False, soft_wrap=True)


def check_output_path(out: str, option: str) -> None:
    """A file to write must not lie under a file (the error would say "File exists" or "Not a directory");
    missing folders on its way are made."""
    try:
        parent, kind = nearest_existing(Path(out).expanduser().absolute().parent)
    except OSError as exc:
        raise UsageError(f"{option} {out}: cannot reach {exc.filename}: {exc.strerror}",
                         hint="give a path in a folder you can write") from None
    if not stat.S_ISDIR(kind):
        raise UsageError(f"{option} {out}: {parent} is a file, not a folder", hint="give a path in a folder")


def refuse_a_tensorflow_program(cdir: ClusterDir, what: str, instead: str) -> None:
    """A UsageError where the cluster ran a TensorFlow program of its own: psctl's metrics and checkpoints
    are its runtime's, not the program's."""
    from psctl.supervisor.state import cluster_spec

    if not cdir.spec_file.is_file():  # (a cluster of an older psctl)
        return
    record = load_state(cdir.state_file)
    if cluster_spec(cdir.spec_file, record).training.get("framework") == "tensorflow":
        raise UsageError(f"cluster {cdir.name!r} runs a TensorFlow program, which {what}", hint=f"use {instead}")


@cli.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON, for scripts (a sweep's results).")
def list_command(as_json: bool) -> None:
    """List the clusters psctl knows (under PSCTL_HOME), with each one's result: the runs of a sweep side by
    side."""
    # each with its result, whether it is stale, its global step
    listed: list[tuple[ClusterRecord, dict[str, Any] | None, bool, int]] = []
    damaged: list[DamagedState] = []  # listed too, not a reason to list nothing
    for cdir in list_clusters():
        try:
            record = load_state(cdir.state_file)
        except DamagedState as exc:
            damaged.append(exc)
            continue
        except FileNotFoundError:
            continue  # (purged meanwhile)
        listed.append((record, result_of(cdir, record), observe.is_stale(cdir, record),
                       newest_global_step(record, progress(cdir, record))))
    if as_json:
        click.echo(json.dumps([
            {"name": r.name, "state": r.state.value, "stale": stale, "roles": len(r.roles), "global_step": step,
             "steps": r.steps, "updated_at": r.updated_at, "spec_path": r.spec_path,
             "spec_overrides": r.spec_overrides, "result": result}
            for r, result, stale, step in listed]
            + [{"name": d.path.parent.name, "state": "damaged", "error": d.format_message()} for d in damaged],
            indent=1))
        return
    table = Table(box=None)
    for col in ("name", "state", "roles", "step", "updated"):
        table.add_column(col, no_wrap=True)
    table.add_column("result (test split)")
    for record, result, stale, step in listed:
        metrics = (result or {}).get("metrics")
        table.add_row(record.name, record.state.value + ("*" if stale else ""), str(len(record.roles)),
                      step_of_steps(step, record), time.strftime("%m-%d %H:%M", time.localtime(record.updated_at)),
                      metrics_text(metrics) if metrics else "-")  # (80 columns: a mark, a footnote for stale)
    for unread in damaged:
        table.add_row(unread.path.parent.name, "damaged", "-", "-", "-", "-")
    console.print(table)
    if any(stale for _, _, stale, _ in listed):
        console.print("* stale: its supervisor is not running; `psctl supervise NAME` takes it up again",
                      markup=False, soft_wrap=True)
    for unread in damaged:
        err_console.print(f"[yellow]warning:[/yellow] {escape(unread.format_message())}", highlight=False,
                          soft_wrap=True)


@cli.command()
@click.argument("role", required=False, shell_complete=completion.role_names)
@click.argument("name", required=False, shell_complete=completion.cluster_names)
@click.option("--tail", "-n", "tail", type=click.IntRange(min=0), default=0, help="Only the last N lines (0: all).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines, across restarts of the role.")
@click.option("--attempt", type=click.IntRange(min=1), default=None, help="An earlier attempt's log (1 is the first).")
@click.option("--all", "all_roles", is_flag=True,
              help="Every role's logs, every attempt's, merged in time order, each line prefixed with its role "
                   "(an earlier attempt's with `role (attempt K):`).")
def logs(role: str | None, name: str | None, tail: int, follow: bool, attempt: int | None, all_roles: bool) -> None:
    """Print the log of ROLE (worker-1, worker:1, or `chief` where one role is of that kind) of cluster NAME;
    `psctl logs --all [NAME]` prints every role's."""
    if all_roles:
        if name is not None or attempt is not None:
            raise UsageError("with --all, give only the cluster's name (and --tail, -f)",
                             hint="e.g. `psctl logs --all digits -n 50`")
        _all_logs(role, tail, follow)
        return
    if role is None:
        raise UsageError("name the role whose log to print (e.g. worker-1), or use --all for every role")
    if name is not None and observe.is_cluster(role) and not observe.is_cluster(name):
        raise UsageError(f"{role!r} is a cluster and {name!r} is not: the role comes first",
                         hint=f"psctl logs {name} {role}")
    cdir = observe.resolve_cluster(name)
    record = load_state(cdir.state_file)
    attempt = observe.check_attempt(record, role, attempt)
    log = observe.role_log(cdir, record, role)
    try:
        observe.check_log_exists(log, attempt)
        lines = observe.tail_log(log, attempt, tail)
        for line in lines:
            click.echo(line)
        if follow:
            for line in observe.follow(cdir, log, start_attempt=attempt, offset=lines.offset):
                click.echo(line)
    except KeyboardInterrupt:
        pass
    finally:
        log.close()


def _all_logs(name: str | None, tail: int, follow: bool) -> None:
    cdir = observe.resolve_cluster(name)
    logs = observe.cluster_logs(cdir, load_state(cdir.state_file))
    try:
        lines, offsets, missing = observe.merged_tail(logs, tail)
        for where, latest in missing:
            why = "deleted or moved?" if latest else "deleted or moved, or the attempt never started?"
            err_console.print(f"[yellow]warning:[/yellow] a log is missing: {escape(where)} ({why})",
                              highlight=False, soft_wrap=True)
        for line in lines:
            click.echo(line)
        if follow:
            for line in observe.follow_all(cdir, logs, offsets()):
                click.echo(line)
    except KeyboardInterrupt:
        return
    finally:
        if logs:
            logs[0].close()
    latest_missing = [where for where, latest in missing if latest]  # (an earlier attempt's: warned of only)
    if latest_missing:
        raise LogNotFound(f"{len(latest_missing)} log(s) of {cdir.name!r} missing: {', '.join(latest_missing)}",
                          hint="deleted or moved; `psctl events` has the roles' state changes and their reasons")


@cli.command()
@click.argument("name", required=False, shell_complete=completion.cluster_names)
@click.option("--detach", "-d", is_flag=True, help="Return once the supervisor runs; do not watch the cluster.")
def supervise(name: str | None, detach: bool) -> None:
    """Start a new supervisor for a cluster whose supervisor died; its running roles are adopted, not restarted."""
    from psctl import operations

    cdir = observe.resolve_cluster(name)
    record = operations.resupervise(cdir)
    console.print(f"cluster {cdir.name!r}: supervised again (pid {record.supervisor_pid}); roles still running "
                  "are adopted as they are, those that ended restart as their policy says", markup=False)
    if detach:
        return
    try:
        record = _watch(cdir)
    except KeyboardInterrupt:
        console.print(f"\ndetached: cluster {cdir.name!r} keeps running", markup=False)
        return
    _finish_line(cdir, record)


@cli.command()
@click.argument("name", shell_complete=completion.cluster_names)
@click.argument("targets", nargs=-1, metavar="ROLE=N...")
def scale(name: str, targets: tuple[str, ...]) -> None:
    """Change a running cluster's workers or ps: `psctl scale NAME worker=4 ps=3`.

    New workers get work from the chief at once; removed ones finish their step and leave; a new ps count
    has the chief reshard the variables (a short pause, nothing lost). Bounds: roles.ROLE.min_replicas and
    max_replicas in the spec.
    """
    from psctl import scaling

    if "=" in name:
        raise UsageError(f"{name!r} is a change, not a cluster: give the cluster's name first",
                         hint=f"psctl scale NAME {' '.join((name, *targets))}")
    wanted = scaling.parse_targets(targets)
    cdir = observe.resolve_cluster(name)
    for change in scaling.scale(cdir, wanted):
        verb = "unchanged" if change.was == change.now else f"{change.was} -> {change.now}"
        console.print(f"cluster {cdir.name!r}: {change.role} {verb}", markup=False)
    console.print(f"see `psctl status {cdir.name}` and `psctl events {cdir.name}`", markup=False)


@cli.command()
@click.argument("names", nargs=-1, metavar="[NAME]...", shell_complete=completion.cluster_names)
@click.option("--grace", type=click.FloatRange(min=0), default=5.0, show_default=True,
              help="Seconds between SIGTERM and SIGKILL.")
@click.option("--purge", is_flag=True,
              help="Also delete the cluster's logs and state; its checkpoints are kept (a later `up` of the same "
                   "name resumes from them).")
def down(names: tuple[str, ...], grace: float, purge: bool) -> None:
    """Stop every process of a cluster (of each one named: the runs of a sweep) and verify that none is left."""
    from psctl import operations

    cdirs = observe.resolve_clusters(names)  # (before anything stops: a misspelt name stops nothing)
    failed: list[str] = []
    for cdir in cdirs:
        try:
            report = operations.tear_down(cdir, grace=grace, purge=purge)
        except PsctlError as exc:
            if len(cdirs) == 1:
                raise
            failed.append(cdir.name)  # the others are still brought down
            print_error(f"cluster {cdir.name!r}: {exc.format_message()}")
            continue
        what = f"stopped {report.stopped} process(es)" if report.stopped else "nothing was running"
        kept = "logs and state deleted" if purge else f"logs kept in {cdir.logs}"
        if report.kept_checkpoints:
            kept += (f"; checkpoints kept in {report.kept_checkpoints} (a later `up` of {cdir.name!r} resumes from "
                     "them; delete that folder to start afresh)")
        spares = (f"; not answering, but no role ever ran there: {', '.join(report.unanswered_spares)}"
                  if report.unanswered_spares else "")  # fmt: skip
        console.print(f"cluster {cdir.name!r}: {what}; no process of it is left; {kept}{spares}", markup=False,
                      highlight=False, soft_wrap=True)  # (one line: a path broken over two is no path)
        if report.damaged:  # (its processes here were found by the files they held open: other hosts unknown)
            err_console.print(f"[yellow]warning:[/yellow] {escape(report.damaged)}: only this machine was looked at; "
                              f"`psctl down --purge {cdir.name}` removes it", highlight=False, soft_wrap=True)
    if failed:
        raise PsctlError(f"{len(failed)} of {len(cdirs)} clusters are not down: {', '.join(failed)}",
                         hint="see the errors above; run psctl down again for them")


@cli.command()
@click.argument("name", required=False, shell_complete=completion.cluster_names)
@click.option("--tail", "-n", "tail", type=click.IntRange(min=0), default=20, show_default=True,
              help="Only the last N events (0: all).")
def events(name: str | None, tail: int) -> None:
    """Show the cluster's recent role state changes, with their reasons."""
    cdir = observe.resolve_cluster(name)
    shown_any = False
    for line in observe.tail_lines(cdir.events_file, tail):
        shown = observe.event_text(line)
        if shown is not None:
            click.echo(shown)
            shown_any = True
    if not shown_any:  # (said on stderr: the output stays the events, none)
        click.echo(f"no events recorded for cluster {cdir.name!r} ({cdir.events_file})", err=True)


@cli.command()
@click.argument("name", required=False, shell_complete=completion.cluster_names)
@click.option("--checkpoint", "checkpoint", default=None,
              help="A checkpoint folder or a folder of checkpoints, HOST:PATH on one of the cluster's hosts "
                   "(default: the cluster's, wherever its chief wrote them).")
@click.option("--out", "-o", type=click.Path(dir_okay=False), required=True, help="The .npz file to write.")
def export(name: str | None, checkpoint: str | None, out: str) -> None:
    """Write the trained variables of the latest valid checkpoint as plain arrays (.npz), for serving."""
    from psctl.checkpoints import find_snapshot  # (numpy, and SSH for a checkpoint on another host)
    from psctl.runtime.checkpoint import export_arrays

    check_output_path(out, "--out")
    cdir = record = None
    if checkpoint is None or (":" in checkpoint and not Path(checkpoint).exists()):
        cdir = observe.resolve_cluster(name)
        record = load_state(cdir.state_file)
        if checkpoint is None:
            refuse_a_tensorflow_program(cdir, "writes TensorFlow checkpoints, not psctl's",
                                        "tf.train.Checkpoint on its checkpoint folder")
    where, snapshot = find_snapshot(cdir, record, checkpoint)
    try:
        written = export_arrays(snapshot, out)
    except OSError as exc:
        raise PsctlError(f"cannot write {out}: {exc.strerror or exc}",
                         hint="give --out a path in a folder you can write") from exc
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in snapshot.variables.items())
    click.echo(f"exported {where} (global step {snapshot.global_step}) to {written}: {shapes}",
               err=not written.is_file())  # (-o /dev/stdout: the arrays alone on standard output)


def main() -> None:
    os.umask(0o077)  # state, logs and keys psctl writes are private to their owner
    if os.environ.get("PSCTL_HOME"):  # a relative one, as this folder names it, for the processes psctl starts
        os.environ["PSCTL_HOME"] = str(psctl_home())
    try:
        cli(obj={})
    except KeyboardInterrupt:
        sys.exit(130)


