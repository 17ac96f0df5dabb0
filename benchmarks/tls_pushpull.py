"""What mutual TLS costs a PS: push and pull throughput with TLS on and off, in the same run. One JSON line per
size.

    python -m benchmarks.tls_pushpull [--sizes 1,8,64] [--repeats 10] [--warmup 2]

Servers: two real PS processes (``python -m psctl.runtime``), started like every role with ``PSCTL_CLUSTER``:
one whose ``tls`` entry names a certificate of a cluster PKI made by ``psctl.pki.create_cluster_pki`` (so it
serves mutual TLS, exactly as in a cluster ``psctl up`` starts), and one with ``"tls": null`` (plaintext). The
client is this process, ``psctl.runtime.ps_client.PsClient``, with the PKI's client certificate for the first.

For each size S (MiB) both PS hold a float32 variable of S MiB (SGD). As the median of ``--repeats`` timed
repeats after ``--warmup`` untimed ones, plaintext and TLS alternating repeat by repeat:

- pull: read the whole variable (the unary rpc up to 16 MiB, the chunked stream above);
- push: send an S MiB dense gradient, which the PS validates and applies.

``*_tls_ratio`` = TLS MB/s / plaintext MB/s from the medians (1.0: TLS costs nothing); ``best_*_tls_ratio``
the same from the fastest repeat of each, which a busy machine disturbs less.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import (
    MB,
    MIB,
    THREADS_HELP,
    BenchCluster,
    Monitor,
    auto_or_count,
    emit_all,
    install_signal_handlers,
    log,
    machine,
    median,
    resolve_threads,
    rounded,
    run_directory,
)
from psctl.pki import create_cluster_pki
from psctl.proto import psctl_pb2 as pb
from psctl.runtime import limits
from psctl.runtime.cluster import TlsFiles
from psctl.runtime.ps_client import PsClient, PushHeader
from psctl.runtime.wire import DENSE, Entry

MODES = ("plain", "tls")


class PsProcess(BenchCluster):
    """One ``python -m psctl.runtime`` PS, with ``tls`` in its PSCTL_CLUSTER (or null: plaintext)."""

    def __init__(self, run_dir: Path, tls: TlsFiles | None, *, threads: int) -> None:
        super().__init__(
            run_dir, {}, num_ps=1, num_workers=0, with_chief=False, threads=threads, cluster_id="bench-tls"
        )
        self.tls = tls

    def env(self, task_type: str, index: int) -> dict[str, str]:
        env = super().env(task_type, index)
        config = json.loads(env["PSCTL_CLUSTER"])
        config["tls"] = asdict(self.tls) if self.tls is not None else None
        env["PSCTL_CLUSTER"] = json.dumps(config)
        return env


def variable_name(nbytes: int) -> str:
    return f"bench/v{nbytes}"


def operations(client: PsClient, nbytes: int, step_ids: list[int]) -> dict[str, Callable[[], None]]:
    """One pull of the whole S-byte variable, and one push of an S-byte dense gradient."""
    name = variable_name(nbytes)
    elements = nbytes // 4
    grad = np.full(elements, 1e-6, dtype=np.float32)
    pull_plan = {0: [Entry(name, DENSE, np.zeros(0, dtype=np.float32))]}

    def pull() -> None:
        pulled, _ = client.pull(pull_plan, {0: nbytes})
        if pulled[0][0].array.shape != (elements,):
            raise RuntimeError(f"pulled {pulled[0][0].array.shape}, expected ({elements},)")

    def push() -> None:
        step_ids[0] += 1
        header = PushHeader(step_id=step_ids[0], task="chief:0", incarnation=1)
        if not client.push(header, {0: [Entry(name, DENSE, grad)]})[0].applied:
            raise RuntimeError(f"push of step {step_ids[0]} was not applied")

    return {"pull": pull, "push": push}


def measure(
    clients: dict[str, PsClient], nbytes: int, repeats: int, warmup: int, step_ids: dict[str, list[int]]
) -> dict[str, dict[str, list[float]]]:
    """Seconds per operation and mode. Plaintext and TLS alternate repeat by repeat (in alternating order), so a
    change in the machine's load hits both alike."""
    ops = {mode: operations(clients[mode], nbytes, step_ids[mode]) for mode in MODES}
    out: dict[str, dict[str, list[float]]] = {mode: {"pull": [], "push": []} for mode in MODES}
    for op in ("pull", "push"):
        for r in range(warmup + repeats):
            for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
                start = time.perf_counter()
                ops[mode][op]()
                elapsed = time.perf_counter() - start
                if r >= warmup:
                    out[mode][op].append(elapsed)
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = [int(float(s) * MIB) for s in args.sizes.split(",")]
    records = []
    with ExitStack() as stack:
        run_dir = stack.enter_context(run_directory(args.run_dir))
        pki_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="psctl-bench-pki-")))
        # The client is the chief's: a ps takes Init only from it (and a push only as the task its certificate names)
        files = create_cluster_pki(pki_dir / "tls", "bench-tls", [("ps-0", "127.0.0.1"), ("chief-0", "127.0.0.1")])
        server_tls = {"plain": None, "tls": files["ps-0"]}
        client_tls = {"plain": None, "tls": files["chief-0"]}
        clusters: dict[str, PsProcess] = {}
        monitors: dict[str, Monitor] = {}
        clients: dict[str, PsClient] = {}
        for mode in MODES:
            cluster = PsProcess(run_dir / mode, server_tls[mode], threads=args.threads)
            stack.callback(cluster.close)
            clusters[mode] = cluster
            cluster.start_all()
            monitor = Monitor(cluster, poll_steps=False)
            monitor.start()
            stack.callback(monitor.stop)
            monitors[mode] = monitor
            client = PsClient(cluster.jobs["ps"], tls=client_tls[mode], timeout=120.0)
            stack.callback(client.close)
            clients[mode] = client
        specs = [
            pb.VariableSpec(
                name=variable_name(n), dtype="float32", shape=[n // 4], full_shape=[n // 4], initializer="zeros"
            )
            for n in sizes
        ]
        figures: dict[str, dict[int, dict[str, list[float]]]] = {mode: {} for mode in MODES}
        try:
            for mode in MODES:
                clients[mode].wait_ready(60.0)
                clients[mode].init({0: specs}, pb.OptimizerConfig(name="sgd", learning_rate=0.01), "bench-tls")
            step_ids = {mode: [0] for mode in MODES}
            for n in sizes:
                log(f"measuring pull / push of {n / MIB:g} MiB, plaintext and TLS")
                measured = measure(clients, n, args.repeats, args.warmup, step_ids)
                for mode in MODES:
                    figures[mode][n] = measured[mode]
                    clusters[mode].check_alive()
        except BaseException:
            for cluster in clusters.values():
                log(cluster.logs())
            raise
        for monitor in monitors.values():
            monitor.stop()
        for n in sizes:
            times = {mode: {k: median(v) for k, v in figures[mode][n].items()} for mode in MODES}
            rates = {op: {mode: n / times[mode][op] / MB for mode in MODES} for op in ("pull", "push")}
            best = {op: {mode: n / min(figures[mode][n][op]) / MB for mode in MODES} for op in ("pull", "push")}
            records.append(
                {
                    "benchmark": "tls_pushpull",
                    "size_mib": n / MIB,
                    "bytes": n,
                    "rpc": "stream" if n > limits.UNARY_MAX_BYTES else "unary",
                    "servers": "one python -m psctl.runtime PS process per mode (PSCTL_CLUSTER tls entry / null)",
                    "repeats": args.repeats,
                    "warmup": args.warmup,
                    "pull_MBps": {mode: rounded(rates["pull"][mode], 1) for mode in MODES},
                    "push_MBps": {mode: rounded(rates["push"][mode], 1) for mode in MODES},
                    "pull_tls_ratio": rounded(rates["pull"]["tls"] / rates["pull"]["plain"]),
                    "push_tls_ratio": rounded(rates["push"]["tls"] / rates["push"]["plain"]),
                    "best_pull_tls_ratio": rounded(best["pull"]["tls"] / best["pull"]["plain"]),
                    "best_push_tls_ratio": rounded(best["push"]["tls"] / best["push"]["plain"]),
                    "median_ms": {mode: {op: rounded(t * 1e3, 2) for op, t in times[mode].items()} for mode in MODES},
                    "ps_peak_rss_mb": {mode: monitors[mode].peak_rss_mb().get("ps:0") for mode in MODES},
                    "machine": machine(),
                }
            )
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,64", help="comma-separated sizes in MiB (default 1,8,64)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats per figure (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repeats first (default 2)")
    parser.add_argument("--threads", type=auto_or_count, default="auto", help=THREADS_HELP)
    parser.add_argument("--run-dir", help="keep the PS logs here (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    args.threads = resolve_threads(args.threads, 2)  # one ps at a time, and this process as its client
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    install_signal_handlers()
    return emit_all("tls_pushpull", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
