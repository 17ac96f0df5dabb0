"""Experiment: gRPC Python throughput with raw bytes messages (no protobuf), unary and 4 MiB-chunk streams."""
import os, signal, socket, subprocess, sys, threading, time
from concurrent import futures
import grpc
import numpy as np

LIMIT = 200 << 20
OPTS = [("grpc.max_send_message_length", LIMIT), ("grpc.max_receive_message_length", LIMIT)]
CHUNK = 4 << 20

def serve(port):
    payloads = {}
    def sink(req, ctx): return b""
    def source(req, ctx):
        n = int(req.decode()); 
        if n not in payloads: payloads[n] = np.ones(n, np.uint8).tobytes()
        return payloads[n]
    def sink_stream(it, ctx):
        for _ in it: pass
        return b""
    def source_stream(req, ctx):
        n = int(req.decode())
        if n not in payloads: payloads[n] = np.ones(n, np.uint8).tobytes()
        mv = memoryview(payloads[n])
        for off in range(0, n, CHUNK): yield bytes(mv[off:off + CHUNK])
    handlers = {"Sink": grpc.unary_unary_rpc_method_handler(sink), "Source": grpc.unary_unary_rpc_method_handler(source),
                "SinkStream": grpc.stream_unary_rpc_method_handler(sink_stream), "SourceStream": grpc.unary_stream_rpc_method_handler(source_stream)}
    server = grpc.server(futures.ThreadPoolExecutor(16), options=OPTS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("raw.Raw", handlers)])
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    stop = threading.Event(); signal.signal(signal.SIGTERM, lambda *a: stop.set()); stop.wait(); server.stop(0)

def main():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    p = subprocess.Popen([sys.executable, __file__, "serve", str(port)])
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTS)
        grpc.channel_ready_future(ch).result(timeout=20)
        sink = ch.unary_unary("/raw.Raw/Sink"); source = ch.unary_unary("/raw.Raw/Source")
        sink_s = ch.stream_unary("/raw.Raw/SinkStream"); source_s = ch.unary_stream("/raw.Raw/SourceStream")
        for mib in (1, 8, 64):
            n = mib << 20
            payload = np.ones(n, np.uint8).tobytes(); mv = memoryview(payload)
            def med(fn, r=10):
                fn(); fn(); ts = []
                for _ in range(r):
                    t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
                return float(np.median(ts))
            res = {
                "unary_send": med(lambda: sink(payload, timeout=60)),
                "unary_recv": med(lambda: source(str(n).encode(), timeout=60)),
                "stream_send": med(lambda: sink_s((bytes(mv[o:o + CHUNK]) for o in range(0, n, CHUNK)), timeout=60)),
                "stream_recv": med(lambda: [c for c in source_s(str(n).encode(), timeout=60)]),
            }
            print(f"raw grpc {mib:3d} MiB: " + "  ".join(f"{k} {n / v / 1e6:7.1f} MB/s" for k, v in res.items()), flush=True)
        ch.close()
    finally:
        p.send_signal(signal.SIGTERM); p.wait()

if __name__ == "__main__":
    serve(int(sys.argv[2])) if len(sys.argv) > 1 and sys.argv[1] == "serve" else main()
