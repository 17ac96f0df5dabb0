"""gRPC Python's cost per request-and-answer: a unary call against a message on an open stream. One JSON line per
size and form.

    python -m benchmarks.sessions [--sizes 0,325000,4194304] [--clients 2] [--calls 2000] [--rounds 3]

An echo server process (psctl's server options, raw bytes, no protobuf) answers each request with a message of
the same size; ``--clients`` client processes (psctl's channel options) each make ``--calls`` calls after 50
untimed ones, all at once, in three forms:

- unary: a unary call per request (what the framed rpcs cost);
- stream: each request a message on one open bidirectional stream per client, read back before the next (gRPC
  Python's own best for the form: the ceiling of sessions);
- session: the same through psctl.runtime.sessions.SessionPool (what a worker's pulls and pushes cost now);
- aio: the same messages on one stream of gRPC's asyncio API, each written and read on the client's event
  loop (no hand-off to gRPC's request-iterator and channel threads: what a worker whose steps ran on an event
  loop would pay).

Per form: calls/s of all clients together, and CPU ms per call of the server and of a client (median of
``--rounds`` rounds; every round runs the three forms in turn, so that the machine's drift hits them alike).
Sizes are bytes each way (325,000: W1's variables, 4 MiB: a W3 ps's).
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import psutil

from benchmarks.common import REPO_ROOT, emit_all, install_signal_handlers, log, machine, median, rounded
from psctl.runtime.rpc import UNARY_THREADS, make_channel, make_server
from psctl.runtime.sessions import SessionPool

SERVICE = "bench.Echo"
FORMS = ("unary", "stream", "session", "aio")
WARMUP_CALLS = 50
_END = object()


def serve(size: int, clients: int) -> int:
    """The echo server: prints its port, serves until stdin closes."""
    answer = bytes(size)

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        return answer

    def echo_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        for _ in requests:
            yield answer

    server, port = make_server("127.0.0.1:0", max_workers=UNARY_THREADS + clients)
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "EchoSession": grpc.stream_stream_rpc_method_handler(echo_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # until the benchmark closes it
    server.stop(0)
    return 0


def aio_client(port: int, size: int, calls: int) -> int:
    """The ``aio`` form's client: one stream of gRPC's asyncio API, driven by this process's event loop."""
    import asyncio

    from psctl.runtime.limits import grpc_options

    async def exchange() -> dict[str, float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=grpc_options()) as channel:
            call = channel.stream_stream(f"/{SERVICE}/EchoSession")()
            request = bytes(size)
            for _ in range(WARMUP_CALLS):
                await call.write(request)
                await call.read()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(calls):
                await call.write(request)
                await call.read()
            timed = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
            await call.done_writing()
            return timed

    print(json.dumps(asyncio.run(exchange())), flush=True)
    return 0


def client(port: int, form: str, size: int, calls: int) -> int:
    """One client: makes its calls, prints its wall and CPU seconds for the timed ones as JSON."""
    if form == "aio":
        return aio_client(port, size, calls)
    channel = make_channel(f"127.0.0.1:{port}")
    request = bytes(size)
    unary = channel.unary_unary(f"/{SERVICE}/Echo")
    stream = channel.stream_stream(f"/{SERVICE}/EchoSession")
    if form == "unary":
        def call() -> object:
            return unary(request, timeout=60)
    elif form == "session":
        pool = SessionPool(stream, unary)

        def call() -> object:
            return pool(request, timeout=60)
    else:
        requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        answers = stream(iter(requests.get, _END))

        def call() -> object:
            requests.put(request)
            return next(answers)

    for _ in range(WARMUP_CALLS):
        call()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        call()
    print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}), flush=True)
    if form == "stream":
        requests.put(_END)
    channel.close()
    return 0


def one_run(size: int, form: str, clients: int, calls: int) -> dict[str, float]:
    """One form at one size: a fresh server, ``clients`` clients at once."""
    me = [sys.executable, "-m", "benchmarks.sessions"]
    server = subprocess.Popen([*me, "--serve", str(size), "--clients", str(clients)], cwd=REPO_ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        serving = psutil.Process(server.pid)
        before = serving.cpu_times()
        runs = [subprocess.Popen([*me, "--client", str(port), "--form", form, "--size", str(size),
                                  "--calls", str(calls)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
                for _ in range(clients)]  # fmt: skip
        results = [json.loads(r.communicate(timeout=600)[0]) for r in runs]
        after = serving.cpu_times()
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(timeout=30)
    total = clients * calls
    server_s = (after.user + after.system) - (before.user + before.system)
    return {
        "calls_per_s": total / max(r["wall_s"] for r in results),
        # the server's CPU over the warm-up calls too, spread over every call it answered
        "server_cpu_ms": 1e3 * server_s / (total + clients * WARMUP_CALLS),
        "client_cpu_ms": 1e3 * sum(r["cpu_s"] for r in results) / total,
    }


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    for size in (int(s) for s in args.sizes.split(",")):
        rounds: dict[str, list[dict[str, float]]] = {form: [] for form in FORMS}
        for r in range(args.rounds):
            for form in FORMS:
                log(f"size {size} round {r + 1} {form}")
                rounds[form].append(one_run(size, form, args.clients, args.calls))
        for form in FORMS:
            line: dict[str, Any] = {"benchmark": "sessions", "size_bytes": size, "form": form,
                                    "clients": args.clients, "calls": args.calls, "rounds": args.rounds}  # fmt: skip
            for key in ("calls_per_s", "server_cpu_ms", "client_cpu_ms"):
                line[key] = rounded(median([x[key] for x in rounds[form]]))
            line["machine"] = machine()
            yield line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="0,325000,4194304", help="bytes each way, comma-separated")
    parser.add_argument("--clients", type=int, default=2, help="client processes at once (default 2)")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per client (default 2000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the forms (default 3)")
    parser.add_argument("--serve", type=int, metavar="SIZE", help=argparse.SUPPRESS)
    parser.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--form", choices=FORMS, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve is not None:
        return serve(args.serve, args.clients)
    if args.client is not None:
        return client(args.client, args.form, args.size, args.calls)
    install_signal_handlers()
    return emit_all("sessions", lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
