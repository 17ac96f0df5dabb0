"""Push/pull throughput of one real PS against its ceilings: loopback TCP between two plain Python processes,
and an in-memory numpy copy. One JSON line per size.

    python -m benchmarks.pushpull [--sizes 1,8,64] [--repeats 10] [--warmup 2]

For each size S (MiB) the PS holds a float32 variable of S MiB (created by Init, SGD optimizer). The client
(this process, psctl.runtime.ps_client.PsClient) measures, as the median of ``--repeats`` timed repeats after
``--warmup`` untimed ones:

- pull: read the whole variable (the unary rpc up to 16 MiB, the chunked stream above);
- push: send an S MiB dense gradient, which the PS validates and applies;
- pushpull: one pull then one push, as a worker's step does (2 S bytes moved).

The TCP ceiling is the time for a sender process to ``sendall`` S bytes to a receiver process that
``recv_into``s them into a preallocated buffer and answers one byte; memcpy is ``np.copyto`` of S bytes.
``ratio`` = pushpull MB/s / TCP MB/s (the issue's target: >= 0.5 at 64 MiB).
"""

from __future__ import annotations

import argparse
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import psutil

from benchmarks.common import (
    MB,
    MIB,
    REPO_ROOT,
    Monitor,
    bench_cluster,
    emit,
    install_signal_handlers,
    log,
    machine,
    median,
    rounded,
    run_directory,
)
from psctl.proto import psctl_pb2 as pb
from psctl.runtime import wire
from psctl.runtime.ps_client import PsClient, PushHeader
from psctl.runtime.wire import DENSE, Entry

_HEADER = struct.Struct("<Q")


# -- the ceilings -----------------------------------------------------------------------------------------
def timed(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def memcpy_seconds(nbytes: int, repeats: int, warmup: int) -> list[float]:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return timed(lambda: np.copyto(dst, src), repeats, warmup)


def tcp_receiver(max_bytes: int) -> int:
    """The receiving process: prints its port, then for each transfer (8-byte length, payload) fills a
    preallocated buffer with recv_into and answers one byte. A length of 0 ends it."""
    buf = bytearray(max_bytes)
    view = memoryview(buf)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            header = bytearray(_HEADER.size)
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


def tcp_seconds(sizes: list[int], repeats: int, warmup: int) -> dict[int, list[float]]:
    """Per size: seconds for one transfer to a receiver process, until its one-byte answer arrived."""
    receiver = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.pushpull", "--tcp-receiver", str(max(sizes))],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        assert receiver.stdout is not None
        port = int(receiver.stdout.readline())
        out: dict[int, list[float]] = {}
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ack = bytearray(1)
            for nbytes in sizes:
                payload = np.ones(nbytes, dtype=np.uint8)  # touched pages, like a real gradient

                def send(payload: np.ndarray = payload, nbytes: int = nbytes) -> None:
                    conn.sendall(_HEADER.pack(nbytes))
                    conn.sendall(memoryview(payload))
                    if conn.recv_into(ack) != 1:
                        raise RuntimeError("the tcp receiver hung up")

                out[nbytes] = timed(send, repeats, warmup)
            conn.sendall(_HEADER.pack(0))
        receiver.wait(timeout=10)
        return out
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


# -- gRPC itself -----------------------------------------------------------------------------------------
_RAW_SERVICE = "psctlbench.Raw"


def grpc_raw_server(port: int) -> int:
    """A gRPC server of raw bytes (no protobuf), with psctl's server options and thread pool: Sink takes a
    message (unary) or a stream of chunks, Source returns ``n`` bytes whole or in CHUNK_BYTES chunks."""
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
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=wire.grpc_options())
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(_RAW_SERVICE, handlers)])
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print(bound, flush=True)
    stop = Event()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    stop.wait()
    server.stop(0)
    return 0


def grpc_raw_seconds(sizes: list[int], repeats: int, warmup: int) -> dict[int, dict[str, list[float]]]:
    """Per size: seconds to send / receive the bytes over gRPC without protobuf or psctl, unary (sizes psctl
    sends unary) and as a stream of CHUNK_BYTES pieces (what psctl streams above UNARY_MAX_BYTES)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.pushpull", "--grpc-raw-server", "0"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=wire.grpc_options())
        try:
            grpc.channel_ready_future(channel).result(timeout=30)
            sink = channel.unary_unary(f"/{_RAW_SERVICE}/Sink")
            sink_stream = channel.stream_unary(f"/{_RAW_SERVICE}/SinkStream")
            source = channel.unary_unary(f"/{_RAW_SERVICE}/Source")
            source_stream = channel.unary_stream(f"/{_RAW_SERVICE}/SourceStream")
            out: dict[int, dict[str, list[float]]] = {}
            for nbytes in sizes:
                data = np.ones(nbytes, dtype=np.uint8).tobytes()
                view = memoryview(data)
                ask = str(nbytes).encode()

                def chunks(view: memoryview = view) -> Iterator[bytes]:
                    for offset in range(0, len(view), wire.CHUNK_BYTES):
                        yield bytes(view[offset : offset + wire.CHUNK_BYTES])

                def send_stream(chunks: Callable[[], Iterator[bytes]] = chunks) -> None:
                    sink_stream(chunks(), timeout=120)

                def recv_stream(ask: bytes = ask) -> None:
                    for _ in source_stream(ask, timeout=120):
                        pass

                runs: dict[str, Callable[[], object]] = {"stream_send": send_stream, "stream_recv": recv_stream}
                if nbytes <= wire.UNARY_MAX_BYTES:
                    runs["unary_send"] = lambda data=data: sink(data, timeout=120)  # type: ignore[misc]
                    runs["unary_recv"] = lambda ask=ask: source(ask, timeout=120)  # type: ignore[misc]
                out[nbytes] = {name: timed(fn, repeats, warmup) for name, fn in runs.items()}
            return out
        finally:
            channel.close()
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


# -- psctl ------------------------------------------------------------------------------------------------
def variable_name(nbytes: int) -> str:
    return f"bench/v{nbytes}"


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


@dataclass
class Phase:
    """Timed repeats of one operation, and the CPU seconds per repeat spent by the client and by the PS."""

    times: list[float]
    client_cpu: float
    ps_cpu: float


def pushpull_phases(
    client: PsClient, ps: psutil.Process, nbytes: int, repeats: int, warmup: int, step_ids: list[int]
) -> dict[str, Phase]:
    name = variable_name(nbytes)
    elements = nbytes // 4
    grad = np.full(elements, 1e-6, dtype=np.float32)
    pull_plan = {0: [Entry(name, DENSE, np.zeros(0, dtype=np.float32))]}
    expected = {0: nbytes}
    me = psutil.Process()

    def pull() -> None:
        pulled, _ = client.pull(pull_plan, expected)
        if pulled[0][0].array.shape != (elements,):
            raise RuntimeError(f"pulled {pulled[0][0].array.shape}, expected ({elements},)")

    def push() -> None:
        step_ids[0] += 1
        client.push(PushHeader(step_id=step_ids[0], task="bench:0", incarnation=1), {0: [Entry(name, DENSE, grad)]})

    def both() -> None:
        pull()
        push()

    def phase(fn: Callable[[], None]) -> Phase:
        timed(fn, 0, warmup)
        client_cpu, ps_cpu = cpu_seconds(me), cpu_seconds(ps)
        times = timed(fn, repeats, 0)
        return Phase(times, (cpu_seconds(me) - client_cpu) / repeats, (cpu_seconds(ps) - ps_cpu) / repeats)

    return {"pull": phase(pull), "push": phase(push), "pushpull": phase(both)}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = [int(float(s) * MIB) for s in args.sizes.split(",")]
    log("measuring memcpy and the loopback tcp ceiling")
    memcpy = {n: memcpy_seconds(n, args.repeats, args.warmup) for n in sizes}
    tcp = tcp_seconds(sizes, args.repeats, args.warmup)
    log("measuring raw gRPC (bytes, no protobuf)")
    raw = grpc_raw_seconds(sizes, args.repeats, args.warmup)
    records = []
    with run_directory(args.run_dir) as run_dir, bench_cluster(
        run_dir, {}, num_ps=1, num_workers=0, with_chief=False, threads=args.threads
    ) as cluster:
        monitor = Monitor(cluster, poll_steps=False)
        cluster.start_all()
        monitor.start()
        client = PsClient(cluster.jobs["ps"], timeout=120.0)
        try:
            client.wait_ready(60.0)
            specs = [
                pb.VariableSpec(name=variable_name(n), dtype="float32", shape=[n // 4], full_shape=[n // 4],
                                initializer="zeros")
                for n in sizes
            ]
            client.init({0: specs}, pb.OptimizerConfig(name="sgd", learning_rate=0.01), cluster.cluster_id)
            step_ids = [0]
            ps_process = cluster.role("ps").process
            if ps_process is None:
                raise RuntimeError("the ps exited at once")
            psctl: dict[int, dict[str, Phase]] = {}
            for n in sizes:
                log(f"measuring pull / push of {n / MIB:g} MiB")
                psctl[n] = pushpull_phases(client, ps_process, n, args.repeats, args.warmup, step_ids)
                cluster.check_alive()
        except BaseException:
            log(cluster.logs())
            raise
        finally:
            client.close()
            monitor.stop()
        for n in sizes:
            times = {k: median(v.times) for k, v in psctl[n].items()}
            tcp_s, memcpy_s = median(tcp[n]), median(memcpy[n])
            rates = {
                "pull_MBps": n / times["pull"] / MB,
                "push_MBps": n / times["push"] / MB,
                "pushpull_MBps": 2 * n / times["pushpull"] / MB,
            }
            tcp_rate = n / tcp_s / MB
            records.append({
                "benchmark": "pushpull",
                "size_mib": n / MIB,
                "bytes": n,
                "rpc": "stream" if n > wire.UNARY_MAX_BYTES else "unary",
                "repeats": args.repeats,
                "warmup": args.warmup,
                **{k: rounded(v, 1) for k, v in rates.items()},
                "tcp_MBps": rounded(tcp_rate, 1),
                "memcpy_MBps": rounded(n / memcpy_s / MB, 1),
                # gRPC alone (bytes in, bytes out, psctl's options): what psctl could reach on gRPC Python.
                "grpc_raw_MBps": {k: rounded(n / median(v) / MB, 1) for k, v in raw[n].items()},
                "ratio": rounded(rates["pushpull_MBps"] / tcp_rate),
                "pull_ratio": rounded(rates["pull_MBps"] / tcp_rate),
                "push_ratio": rounded(rates["push_MBps"] / tcp_rate),
                "median_ms": {
                    **{k: rounded(v * 1e3, 2) for k, v in times.items()},
                    "tcp": rounded(tcp_s * 1e3, 2),
                    "memcpy": rounded(memcpy_s * 1e3, 2),
                },
                # CPU per operation, client and PS: near the wall time means CPU bound, far below means waiting.
                "cpu_ms_per_op": {
                    k: {"client": rounded(v.client_cpu * 1e3, 2), "ps": rounded(v.ps_cpu * 1e3, 2)}
                    for k, v in psctl[n].items()
                },
                "ps_peak_rss_mb": monitor.peak_rss_mb().get("ps:0"),
                "machine": machine(),
            })
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,8,64", help="comma-separated sizes in MiB (default 1,8,64)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats per figure (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repeats first (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="OMP/OPENBLAS threads of the PS (default 1)")
    parser.add_argument("--run-dir", help="keep the PS log here (default: a temp dir)")
    parser.add_argument("--tcp-receiver", type=int, metavar="MAX_BYTES", help=argparse.SUPPRESS)
    parser.add_argument("--grpc-raw-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tcp_receiver is not None:
        return tcp_receiver(args.tcp_receiver)
    if args.grpc_raw_server is not None:
        return grpc_raw_server(args.grpc_raw_server)
    install_signal_handlers()
    try:
        for record in run(args):
            emit(record)
    except (RuntimeError, TimeoutError, OSError) as exc:
        emit({"benchmark": "pushpull", "ok": False, "error": str(exc).splitlines()[0]})
        return 1
    except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C or SIGTERM: every process is already stopped
        emit({"benchmark": "pushpull", "ok": False, "error": f"interrupted ({type(exc).__name__})"})
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
