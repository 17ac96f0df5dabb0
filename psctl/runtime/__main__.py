"""``python -m psctl.runtime``: run this process's role, as the environment describes it.

Exit codes (psctl.runtime.exits): 0 done, 1 unexpected failure, 2 bad configuration (permanent: restarting
cannot help), 3 training failed (a non-retryable error in the program; also permanent), 75 stopped by SIGTERM
within its grace (preempted, or ``psctl down``): a worker first finishes the steps it is running and refuses new
ones (``PSCTL_PREEMPTION_GRACE`` seconds at most), so that the chief hands them to another worker; 80 a ps or
worker that ended by itself, training being over and nothing having stopped it (``TRAINING_OVER_LINGER``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from psctl.launch.cpus import bind_self, cpu_list, settle_priority
from psctl.runtime.cluster import ClusterConfigError, ClusterInfo, from_env
from psctl.runtime.exits import (
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_FILE_VARIABLE,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_TRAINING_FAILED,
    EXIT_TRAINING_OVER,
    EXITING,
    write_exit_file,
)
from psctl.runtime.log_format import LOG_FORMAT
from psctl.signals import RECORDED_SIGNALS, on_signals

#: Seconds a worker stopped by SIGTERM gives the steps it is running (the supervisor sets it from
#: supervision.preemption_grace; the SIGKILL that follows a preemption's warning ends it otherwise).
DEFAULT_PREEMPTION_GRACE = 30.0
#: The longest a role on its way out waits for its last heartbeat (its final step and metrics) to be sent.
FINAL_BEAT_WAIT = 1.0
#: Seconds a ps or worker waits, once the chief said training is over, for the supervisor to stop it; then it
#: ends by itself (EXIT_TRAINING_OVER). The supervisor stops it within a second or two: this is for a cluster whose
#: supervisor died (or whose machine sleeps), whose roles would otherwise keep their hosts busy for nothing.
TRAINING_OVER_LINGER = 60.0


def _serve(info: ClusterInfo, stop: threading.Event) -> int:
    from psctl.runtime.fencing import CHIEF_FENCE  # also fed by this process's heartbeat replies
    from psctl.runtime.rpc import UNARY_THREADS, make_server

    CHIEF_FENCE.learn(info.chief_incarnation)  # before serving: a replaced chief may already be calling

    threads = UNARY_THREADS
    if info.task_type == "ps":
        from psctl.runtime.ps import SERVER_THREADS

        threads = SERVER_THREADS  # a thread for each of the workers' sessions too
    server, _port = make_server(info.bind_address(), info.tls, max_workers=threads)
    worker = None  # a worker's servicer: on SIGTERM it finishes the steps running and refuses new ones
    store = None  # a ps's: on SIGTERM it leaves once the chief has checkpointed it
    if info.task_type == "ps":
        from psctl.runtime.ps import ParameterServerServicer, VariableStore, add_to_server
        from psctl.runtime.stepstats import RequestRate

        store = VariableStore(cluster_id=info.cluster_id, chief_fence=CHIEF_FENCE)
        ps_servicer = ParameterServerServicer(store)
        add_to_server(ps_servicer, server)
        RequestRate(lambda: ps_servicer.requests, store.held_bytes).start()
    else:
        from psctl.proto import psctl_pb2_grpc as pb_grpc
        from psctl.runtime.config import TrainingConfig
        from psctl.runtime.heartbeat import ADDRESSES
        from psctl.runtime.model import ShardedModel
        from psctl.runtime.program import ProgramRef, load_program
        from psctl.runtime.ps_client import PsClient
        from psctl.runtime.worker import WorkerServicer

        cfg = TrainingConfig.from_dict(info.training)
        program = load_program(ProgramRef(cfg.program, cfg.args, cfg.data, cfg.seed))
        def layout(addresses: Sequence[str]) -> tuple[ShardedModel, PsClient]:
            return (ShardedModel(program, len(addresses), cfg.partitioner, cfg.placement),
                    PsClient(addresses, tls=info.tls, sessions=True))

        model, ps = layout(info.ps)
        num_shards = cfg.data_shards or len(info.workers)
        servicer = WorkerServicer(
            model,
            ps,
            task=info.task,
            incarnation=info.incarnation or int(time.time() * 1000),
            batch_size=cfg.batch_size,
            num_shards=num_shards,
            chief_fence=CHIEF_FENCE,
            relayout=layout,
            serial=not cfg.pipelined,
            on_first_step=settle_priority,  # bound, it yields its CPU to the ps and the chief from then on
            on_out_of_memory=stop.set,  # (restarted, it starts with its memory as it was)
            on_hung=leave_hung,
        )
        # a ps restarted on another host of its pool: push and pull there
        ADDRESSES.subscribe(lambda addresses: servicer.ps.follow(addresses))
        # load its data before serving: not during its first step
        servicer.dataset("train", info.task_index % num_shards)
        pb_grpc.add_WorkerServicer_to_server(servicer, server)
        worker = servicer
    server.start()
    logging.info("%s serving on %s (incarnation %d)", info.task, info.address, info.incarnation)
    linger = float(os.environ.get("PSCTL_TRAINING_OVER_LINGER", TRAINING_OVER_LINGER))
    if _wait_for_stop(stop, lambda: bool(worker.training_over if worker is not None else
                                         store is not None and store.training_over.is_set()), linger):
        logging.info("%s stopping: training is over, and nothing stopped this role within %gs (its supervisor "
                     "is gone?)", info.task, linger)
        server.stop(grace=2).wait()
        return EXIT_TRAINING_OVER
    grace = float(os.environ.get("PSCTL_PREEMPTION_GRACE", DEFAULT_PREEMPTION_GRACE))
    if worker is not None:
        left = worker.drain(grace)
        logging.info("%s stopping: %s", info.task, f"{left} step(s) still running after {grace:g}s" if left else
                     "training is over" if worker.training_over else "its steps finished")
    if store is not None:
        saved = store.leave(grace)
        logging.info("%s stopping: %s", info.task, "the chief checkpointed it first" if saved else
                     "training is over" if store.training_over.is_set() else
                     "no chief training (or none released it within the grace)")
    server.stop(grace=2).wait()
    logging.info("%s stopped", info.task)
    return EXIT_FAILURE if worker is not None and worker.out_of_memory else EXIT_PREEMPTED


def _wait_for_stop(stop: threading.Event, training_over: Callable[[], bool], linger: float, *,
                   clock: Callable[[], float] = time.monotonic) -> bool:
    """Wait until the role is stopped (False), or training has been over for ``linger`` seconds on end (True:
    a step or push meanwhile says training goes on, and the count starts again)."""
    over_since: float | None = None
    while not stop.wait(min(1.0, max(linger, 0.05))):
        if not training_over():
            over_since = None
            continue
        over_since = clock() if over_since is None else over_since
        if clock() - over_since >= linger:
            return True
    return False


def _chief(info: ClusterInfo, stop: threading.Event) -> int:
    from psctl.runtime.chief import CheckpointMismatch, Chief, Interrupted, VariablesRefused
    from psctl.runtime.coordinator import CancelledError, StepError
    from psctl.runtime.fencing import ChiefReplaced
    from psctl.runtime.ps_client import PsUnavailable

    chief = Chief(info, stop=stop)
    try:
        chief.run()
    except ChiefReplaced as exc:
        logging.warning("%s: a newer chief runs the training: stopping", exc)
        return EXIT_OK
    except StepError as exc:
        logging.error("training failed: %s", exc)
        return EXIT_TRAINING_FAILED
    except (CheckpointMismatch, VariablesRefused) as exc:  # permanent: a restart would fail alike (or train over
        # the checkpoint)
        logging.error("%s", exc)
        return EXIT_CONFIG
    except Interrupted as exc:  # its successor resumes at the global step the ps hold: nothing is lost
        logging.info("%s", exc)
        return EXIT_PREEMPTED
    except (PsUnavailable, CancelledError) as exc:
        logging.error("training interrupted: %s", exc)
        return EXIT_FAILURE
    finally:
        chief.close()
    return EXIT_OK


def _record_and_end(signum: int, _frame: object) -> None:
    """End as the signal would have, having left it in the exit file (only a file written: safe in a handler)."""
    record_exit(-signum)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def main() -> int:
    os.umask(0o077)  # logs, metrics, results and checkpoints are private to their owner
    for signum in RECORDED_SIGNALS:
        signal.signal(signum, _record_and_end)
    logging.basicConfig(
        level=logging.INFO, format=LOG_FORMAT, stream=sys.stdout, force=True
    )
    try:
        info = from_env()
    except ClusterConfigError as exc:
        print(f"psctl.runtime: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    stop = threading.Event()

    def on_signal(signum: int) -> None:
        if not stop.is_set():
            logging.info("%s received %s: stopping", info.task, signal.Signals(signum).name)
        stop.set()

    on_signals((signal.SIGTERM, signal.SIGINT), on_signal)
    logging.info("%s starting (pid %d)", info.task, os.getpid())
    heartbeat = None
    if info.supervisor:
        from psctl.runtime.heartbeat import Heartbeater

        heartbeat = Heartbeater(info)
        heartbeat.start()
    # Bound once it beats (its gRPC imported and started on whichever CPU was free: a restarted role is back as
    # soon as unbound), before its own work (psctl.launch.cpus).
    cpus = bind_self()
    if cpus is not None:
        logging.info("%s bound to CPU %s", info.task, cpu_list(cpus))
        if info.task_type == "evaluator":  # it never waits for the others: it yields its CPU from now on
            settle_priority()
    try:
        if info.task_type == "chief":
            return _chief(info, stop)
        if info.task_type in ("ps", "worker"):
            return _serve(info, stop)
        if info.task_type == "evaluator":
            from psctl.runtime.evaluator import run_evaluator

            code = run_evaluator(info, stop)
            return EXIT_PREEMPTED if stop.is_set() else code
        return EXIT_CONFIG
    except (ValueError, ImportError) as exc:
        logging.error("%s: configuration error: %s", info.task, exc)
        return EXIT_CONFIG
    finally:
        if heartbeat is not None:
            heartbeat.progress.status = EXITING  # (its supervisor then waits for its end, not for more beats)
            heartbeat.stop(final_within=FINAL_BEAT_WAIT)  # its final step and metrics, for psctl status


def leave_hung() -> NoReturn:
    """End this process now, as failed (to be restarted): a step of its program hangs, and its thread cannot be
    stopped (see ``WorkerServicer``'s ``on_hung``)."""
    record_exit(EXIT_FAILURE)
    _exit_at_once(EXIT_FAILURE)


def record_exit(code: int) -> None:
    """Leave the exit code where ``PSCTL_EXIT_FILE`` says: a launcher that is not this process's parent (over
    SSH) cannot wait() for it, and must tell "finished" (0) from "bad config" (2) from "killed" (no file)."""
    path = os.environ.get(EXIT_FILE_VARIABLE)
    if not path:
        return
    try:
        write_exit_file(path, code)
    except OSError as exc:
        print(f"psctl.runtime: cannot write the exit file {path}: {exc}", file=sys.stderr)


#: How long a program's threads that are not daemons have to end once the role is done, before it exits anyway.
THREADS_GRACE = 2.0


def exit_now(code: int) -> NoReturn:
    """Exit with ``code`` (from the main thread), deaf to SIGTERM and SIGINT. A thread of the program that never
    ends (not a daemon) kept the interpreter at its exit once the role was done, its heartbeat stopped: a chief
    that had finished training was taken for hung and restarted, again and again. Such threads have
    THREADS_GRACE to end; then the process exits without them (and without the exit handlers, which run after
    them), saying which they were."""
    # A SIGTERM from here on must not end the process as killed by it (a failure, to its supervisor, where a
    # preemption sent it twice): its end is recorded already, and Python restores the default handlers as it
    # finalizes, which an ignored signal keeps.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    deadline = time.monotonic() + THREADS_GRACE
    for thread in _lingering():
        thread.join(max(0.0, deadline - time.monotonic()))
    left = _lingering()
    if not left:
        sys.exit(code)
    logging.warning("exiting with %d thread(s) still running (not daemons, they would have held this process at "
                    "its exit; the program's?): %s", len(left), ", ".join(t.name for t in left))
    _exit_at_once(code)


def _exit_at_once(code: int) -> NoReturn:
    """End the process with ``code`` now, its logs and output flushed (threads that hang are not waited for)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _lingering() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]


if __name__ == "__main__":
    try:
        exit_code = main()
    except (Exception, KeyboardInterrupt):  # a crash: say so, rather than leave a launcher to read "killed" from
        # no file, and end (a thread of the program left running would hold the process as on a clean exit)
        record_exit(EXIT_FAILURE)
        traceback.print_exc()
        exit_now(EXIT_FAILURE)
    record_exit(exit_code)
    exit_now(exit_code)
