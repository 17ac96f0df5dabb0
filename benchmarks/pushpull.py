"""Push/pull throughput of one real PS against its ceilings: loopback TCP between two plain Python processes,
gRPC itself (raw bytes, no protobuf), and an in-memory numpy copy. One JSON line per size.

    python -m benchmarks.pushpull [--sizes 1,8,64] [--repeats 10] [--warmup 2]

For each size S (MiB) the PS holds a float32 variable of S MiB (created by Init, SGD optimizer). The client
(this process, psctl.runtime.ps_client.PsClient) measures, as the median of ``--repeats`` timed repeats after
``--warmup`` untimed ones:

- pull: read the whole variable (the unary rpc up to 16 MiB, the chunked stream above);
- push: send an S MiB dense gradient, which the PS validates and applies;
- pushpull: one pull then one push, as a worker's step does (2 S bytes moved).

Ceilings, measured in the same run:

- tcp: a sender (this process) ``sendall``s S bytes to a receiver process that ``recv_into``s them into a
  preallocated buffer and answers one byte; the time until that byte arrives;
- grpc_raw: the same bytes over gRPC Python with psctl's channel and server options but no protobuf and no
  psctl code (bytes in, bytes out), unary and as a stream of 4 MiB chunks, to a server process;
- memcpy: ``np.copyto`` of S bytes.

Every repeat runs every operation once, in turn, so that a busy machine slows all of them alike.
``ratio`` = pushpull MB/s / tcp MB/s (the issue's target: >= 0.5 at 64 MiB).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import psutil

from benchmarks.common import (
    MB,
    MIB,
    REPO_ROOT,
    THREADS_HELP,
    Monitor,
    auto_or_count,
    bench_cluster,
    cpu_seconds,
    emit_all,
    install_signal_handlers,
    log,
    machine,
    median,
    resolve_threads,
    rounded,
    run_as_role,
    run_directory,
)
from psctl.proto import psctl_pb2 as pb
from psctl.runtime import limits, wire
from psctl.runtime.ps_client import PsClient, PushHeader
from psctl.runtime.wire import DENSE, Entry

Op = Callable[[], object]
_HEADER = struct.Struct("<Q")
_RAW_SERVICE = "psctlbench.Raw"


# -- helper processes -------------------------------------------------------------------------------------
@contextlib.contextmanager
def helper(flag: str, value: int) -> Iterator[int]:
    """Run this module with a hidden ``flag`` in its own process (group); yields the port it prints."""
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.pushpull", flag, str(value)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {flag} helper exited with code {process.wait()}")
        yield int(line)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def tcp_receiver(max_bytes: int) -> int:
    """The receiving process: prints its port, then for each transfer (8-byte length, payload) fills a
    preallocated buffer with recv_into and answers one byte. A length of 0 (or a closed socket) ends it."""
    view = memoryview(bytearray(max_bytes))
    header = bytearray(_HEADER.size)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                got = 0
                while got < _HEADER.size:
                    n = conn.recv_into(memoryview(header)[got:])
                    if n == 0:
                        return 0
                    got += n
                (length,) = _HEADER.unpack(header)
                if length == 0:
                    return 0
                got = 0
                while got < length:
                    n = conn.recv_into(view[got:length])
                    if n == 0:
                        return 1
                    got += n
                conn.sendall(b"\x01")


def grpc_raw_server(port: int) -> int:
    """A gRPC server of raw bytes with psctl's server options and thread pool: Sink takes a message (unary) or
    a stream of chunks; Source returns ``n`` bytes whole, or as CHUNK_BYTES chunks (SourceStream)."""
    from concurrent import futures
    from threading import Event

    payloads: dict[int, bytes] = {}

    def payload(request: bytes) -> bytes:
        n = int(request.decode())
        if n not in payloads:
            payloads[n] = np.ones(n, dtype=np.uint8).tobytes()
        return payloads[n]

    def sink(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b""

    def sink_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        for _ in requests:
            pass
        return b""

    def source(request: bytes, context: grpc.ServicerContext) -> bytes:
        return payload(request)

    def source_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        view = memoryview(payload(request))
        for offset in range(0, len(view), wire.CHUNK_BYTES):
            yield bytes(view[offset : offset + wire.CHUNK_BYTES])

    handlers = {
        "Sink": grpc.unary_unary_rpc_method_handler(sink),
        "SinkStream": grpc.stream_unary_rpc_method_handler(sink_stream),
        "Source": grpc.unary_unary_rpc_method_handler(source),
        "SourceStream": grpc.unary_stream_rpc_method_handler(source_stream),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=limits.grpc_options())
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(_RAW_SERVICE, handlers)])
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(bound, flush=True)
    stop = Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    stop.wait()
    server.stop(0)
    return 0


# -- the operations ---------------------------------------------------------------------------------------
def memcpy_op(nbytes: int) -> Op:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def tcp_op(conn: socket.socket, nbytes: int) -> Op:
    payload = np.ones(nbytes, dtype=np.uint8)  # touched pages, like a real gradient
    ack = bytearray(1)

    def send() -> None:
        conn.sendall(_HEADER.pack(nbytes))
        conn.sendall(payload.data)
        if conn.recv_into(ack) != 1:
            raise RuntimeError("the tcp receiver hung up")

    return send


def grpc_raw_ops(channel: grpc.Channel, nbytes: int) -> dict[str, Op]:
    sink = channel.unary_unary(f"/{_RAW_SERVICE}/Sink")
    sink_stream = channel.stream_unary(f"/{_RAW_SERVICE}/SinkStream")
    source = channel.unary_unary(f"/{_RAW_SERVICE}/Source")
    source_stream = channel.unary_stream(f"/{_RAW_SERVICE}/SourceStream")
    data = np.ones(nbytes, dtype=np.uint8).tobytes()
    ask = str(nbytes).encode()

    def chunks() -> Iterator[bytes]:
        view = memoryview(data)
        for offset in range(0, nbytes, wire.CHUNK_BYTES):
            yield bytes(view[offset : offset + wire.CHUNK_BYTES])

    def recv_stream() -> None:
        for _ in source_stream(ask, timeout=120):
            pass

    ops: dict[str, Op] = {
        "stream_send": lambda: sink_stream(chunks(), timeout=120),
        "stream_recv": recv_stream,
    }
    if nbytes <= limits.UNARY_MAX_BYTES:  # psctl's message limit: larger ones must be streamed
        ops["unary_send"] = lambda: sink(data, timeout=120)
        ops["unary_recv"] = lambda: source(ask, timeout=120)
    return ops


def variable_name(nbytes: int) -> str:
    return f"bench/v{nbytes}"


def psctl_ops(client: PsClient, nbytes: int, step_ids: list[int]) -> dict[str, Op]:
    name = variable_name(nbytes)
    elements = nbytes // 4
    grad = np.full(elements, 1e-6, dtype=np.float32)
    pull_plan = {0: [Entry(name, DENSE, np.zeros(0, dtype=np.float32))]}
    expected = {0: nbytes}

    def pull() -> None:
        pulled, _ = client.pull(pull_plan, expected)
        if pulled[0][0].array.shape != (elements,):
            raise RuntimeError(f"pulled {pulled[0][0].array.shape}, expected ({elements},)")

    def push() -> None:
        step_ids[0] += 1
        client.push(PushHeader(step_id=step_ids[0], task="bench:0", incarnation=1), {0: [Entry(name, DENSE, grad)]})

    def pushpull() -> None:
        pull()
        push()

    return {"pull": pull, "push": push, "pushpull": pushpull}


@dataclass
class Sample:
    """Timed repeats of one operation, and the CPU seconds spent by this process and by the PS meanwhile."""

    times: list[float] = field(default_factory=list)
    client_cpu: float = 0.0
    ps_cpu: float = 0.0

    def per_op_ms(self, seconds: float) -> float | None:
        return rounded(seconds / max(1, len(self.times)) * 1e3, 2)


def measure(ops: dict[str, Op], repeats: int, warmup: int, ps: psutil.Process) -> dict[str, Sample]:
    """Warm every operation up, then run them in turn ``repeats`` times (interleaved)."""
    me = psutil.Process()
    for op in ops.values():
        for _ in range(warmup):
            op()
    samples = {name: Sample() for name in ops}
    for _ in range(repeats):
        for name, op in ops.items():
            client_cpu, ps_cpu = cpu_seconds(me), cpu_seconds(ps)
            start = time.perf_counter()
            op()
            samples[name].times.append(time.perf_counter() - start)
            samples[name].client_cpu += cpu_seconds(me) - client_cpu
            samples[name].ps_cpu += cpu_seconds(ps) - ps_cpu
    return samples


def record(nbytes: int, samples: dict[str, Sample], args: argparse.Namespace) -> dict[str, Any]:
    seconds = {name: median(s.times) for name, s in samples.items()}

    def rate(name: str, moved: int = nbytes) -> float:
        return moved / seconds[name] / MB

    tcp = rate("tcp")
    rates = {"pull_MBps": rate("pull"), "push_MBps": rate("push"), "pushpull_MBps": rate("pushpull", 2 * nbytes)}
    raw = [k for k in samples if k.startswith("grpc_")]
    # gRPC Python's best for the same traffic: the faster raw form (unary or stream) each way, one after the other
    raw_send = min((seconds[k] for k in raw if k.endswith("_send")), default=float("nan"))
    raw_recv = min((seconds[k] for k in raw if k.endswith("_recv")), default=float("nan"))
    raw_pushpull = 2 * nbytes / (raw_send + raw_recv) / MB
    return {
        "benchmark": "pushpull",
        "size_mib": nbytes / MIB,
        "bytes": nbytes,
        "rpc": "stream" if nbytes > limits.UNARY_MAX_BYTES else "unary",
        "repeats": args.repeats,
        "warmup": args.warmup,
        **{k: rounded(v, 1) for k, v in rates.items()},
        "tcp_MBps": rounded(tcp, 1),
        "memcpy_MBps": rounded(rate("memcpy"), 1),
        # gRPC alone (bytes in, bytes out, psctl's options): what psctl could reach on gRPC Python.
        "grpc_raw_MBps": {k.removeprefix("grpc_"): rounded(rate(k), 1) for k in raw},
        "grpc_raw_pushpull_MBps": rounded(raw_pushpull, 1),
        # the target: push+pull at >= 0.9 of raw gRPC Python's rate for the same bytes
        "raw_ratio": rounded(rates["pushpull_MBps"] / raw_pushpull),
        "ratio": rounded(rates["pushpull_MBps"] / tcp),
        "pull_ratio": rounded(rates["pull_MBps"] / tcp),
        "push_ratio": rounded(rates["push_MBps"] / tcp),
        "median_ms": {k: rounded(v * 1e3, 2) for k, v in seconds.items()},
        # CPU per operation of this process (the client) and of the PS: near the wall time means CPU bound.
        "cpu_ms_per_op": {
            k: {"client": samples[k].per_op_ms(samples[k].client_cpu), "ps": samples[k].per_op_ms(samples[k].ps_cpu)}
            for k in ("pull", "push", "pushpull")
        },
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = [int(float(s) * MIB) for s in args.sizes.split(",")]
    records = []
    with contextlib.ExitStack() as stack:
        run_dir = stack.enter_context(run_directory(args.run_dir))
        cluster = stack.enter_context(
            bench_cluster(run_dir, {}, num_ps=1, num_workers=0, with_chief=False, threads=args.threads)
        )
        monitor = Monitor(cluster, poll_steps=False)
        cluster.start_all()
        monitor.start()
        stack.callback(monitor.stop)
        tcp_port = stack.enter_context(helper("--tcp-receiver", max(sizes)))
        raw_port = stack.enter_context(helper("--grpc-raw-server", 0))
        conn = stack.enter_context(socket.create_connection(("127.0.0.1", tcp_port)))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = grpc.insecure_channel(f"127.0.0.1:{raw_port}", options=limits.grpc_options())
        stack.callback(channel.close)
        client = PsClient(cluster.jobs["ps"], timeout=120.0)
        stack.callback(client.close)
        try:
            grpc.channel_ready_future(channel).result(timeout=30)
            client.wait_ready(60.0)
            specs = [
                pb.VariableSpec(name=variable_name(n), dtype="float32", shape=[n // 4], full_shape=[n // 4],
                                initializer="zeros")
                for n in sizes
            ]
            client.init({0: specs}, pb.OptimizerConfig(name="sgd", learning_rate=0.01), cluster.cluster_id)
            ps_process = cluster.role("ps").process
            if ps_process is None:
                raise RuntimeError("the ps exited at once")
            step_ids = [0]
            for n in sizes:
                log(f"measuring {n / MIB:g} MiB: memcpy, tcp, raw grpc, psctl pull / push (interleaved)")
                ops: dict[str, Op] = {"memcpy": memcpy_op(n), "tcp": tcp_op(conn, n)}
                ops.update({f"grpc_{k}": op for k, op in grpc_raw_ops(channel, n).items()})
                ops.update(psctl_ops(client, n, step_ids))
                samples = measure(ops, args.repeats, args.warmup, ps_process)
                cluster.check_alive()
                records.append(record(n, samples, args))
            conn.sendall(_HEADER.pack(0))
        except BaseException:
            log(cluster.logs())
            raise
    peak = monitor.peak_rss_mb().get("ps:0")
    return [{**r, "ps_peak_rss_mb": peak, "machine": machine()} for r in records]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,64", help="comma-separated sizes in MiB (default 1,8,64)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats per figure (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repeats first (default 2)")
    parser.add_argument("--threads", type=auto_or_count, default="auto", help=THREADS_HELP)
    parser.add_argument("--run-dir", help="keep the PS log here (default: a temp dir)")
    parser.add_argument("--tcp-receiver", type=int, metavar="MAX_BYTES", help=argparse.SUPPRESS)
    parser.add_argument("--grpc-raw-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    args.threads = resolve_threads(args.threads, 2)  # the ps, and this process as the worker
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tcp_receiver is not None:
        return tcp_receiver(args.tcp_receiver)
    if args.grpc_raw_server is not None:
        return grpc_raw_server(args.grpc_raw_server)
    run_as_role("benchmarks.pushpull", args.threads, argv)
    install_signal_handlers()
    return emit_all("pushpull", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
