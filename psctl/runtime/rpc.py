"""gRPC channels and servers for every role, plaintext or mutual TLS, with one set of options."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from psctl.runtime.cluster import TlsFiles
from psctl.runtime.limits import grpc_options

#: Every role certificate carries this DNS name, so a role can verify a peer known only by IP:port.
TLS_SERVER_NAME = "psctl-role"
#: HTTP/2 pings while a call is in flight: a peer whose host was cut off (no RST, no FIN) fails the call within
#: about time + timeout, so the chief re-runs the step elsewhere instead of waiting on it forever.
KEEPALIVE_TIME_MS = 2000
KEEPALIVE_TIMEOUT_MS = 3000
CLIENT_KEEPALIVE: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),  # a long step sends no data for a while: keep pinging
]
#: Servers accept those pings (by default gRPC servers answer pings more often than every 5 minutes with
#: GOAWAY "too many pings").
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def make_channel(
    address: str, tls: TlsFiles | None = None, *, keepalive_ms: int = KEEPALIVE_TIME_MS
) -> grpc.Channel:
    """A channel to ``address``; ``keepalive_ms``: HTTP/2 pings that fail a call to a silent peer (a stream that
    carries a report every second needs them seldom: each ping costs the SSH forward that carries it)."""
    # Reconnect quickly: a restarted role answers at the same address within seconds, and gRPC's default
    # backoff (up to 120 s) would leave the cluster idle long after it is back.
    options: list[tuple[str, Any]] = [
        *grpc_options(),
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        *[(key, keepalive_ms if key == "grpc.keepalive_time_ms" else value) for key, value in CLIENT_KEEPALIVE],
        # (not min_reconnect_backoff_ms: gRPC core also uses it as the connect timeout, and a TLS handshake on
        # a loaded machine can take longer than a short one)
    ]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca), private_key=_read(tls.key), certificate_chain=_read(tls.cert)
    )
    options.append(("grpc.ssl_target_name_override", TLS_SERVER_NAME))
    return grpc.secure_channel(address, creds, options=options)


def member_of_task(task: str) -> str:
    """The certificate name of a runtime task: ``worker:0`` -> ``worker-0``."""
    job, _, index = task.partition(":")
    return f"{job}-{index}"


#: The chief's certificate: only it initialises, restores and flushes a ps and runs a worker's steps.
CHIEF_MEMBER = member_of_task("chief:0")


def caller(context: grpc.ServicerContext | grpc.aio.ServicerContext) -> str | None:
    """The cluster member that made this call: its certificate's name (``worker-0``, ``chief-0``); None on a
    server without TLS (``security: {tls: false}``), whose callers name no one. A TLS server of psctl's takes no
    client without a certificate of the cluster's CA; one that names no member is "" (refused as no one's)."""
    found = context.auth_context()
    if found.get("transport_security_type") != [b"ssl"]:
        return None
    names = found.get("x509_common_name") or []
    return names[0].decode() if names else ""


def refuse_unless_from(context: grpc.ServicerContext, member: str, what: str) -> None:
    """PERMISSION_DENIED unless ``member``'s certificate made this call: a certificate of the cluster proves
    that a caller is one of its members, this proves which (a worker cannot reset a ps or beat as the chief)."""
    name = caller(context)
    if name is not None and name != member:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{what} is {member}'s to send, not {name}'s")


#: How long a replaced channel stays open: a call another thread took its stub for just before the swap must
#: not hit a closed channel (a ValueError, not an RpcError); calls to a dead peer fail by keepalive meanwhile.
REPLACED_CHANNEL_GRACE = 60.0


def close_later(channel: grpc.Channel, delay: float = REPLACED_CHANNEL_GRACE) -> None:
    """Close a channel that was just replaced (its peer moved) once no call can still be starting on it."""
    timer = threading.Timer(delay, channel.close)
    timer.daemon = True
    timer.start()


#: A server's threads for its unary and short streaming calls (a session needs one more of its own).
UNARY_THREADS = 16


def make_server(
    bind: str, tls: TlsFiles | None = None, *, max_workers: int = UNARY_THREADS, exclusive: bool = False
) -> tuple[grpc.Server, int]:
    """A server listening on ``bind``; returns it (not started) and the port it got. ``exclusive``: fail where
    another socket listens there (gRPC sets SO_REUSEPORT by default: two servers would share the port)."""
    options = [*grpc_options(), *SERVER_OPTIONS, *([("grpc.so_reuseport", 0)] if exclusive else [])]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options)
    try:
        if tls is None:
            port = server.add_insecure_port(bind)
        else:
            creds = grpc.ssl_server_credentials(
                [(_read(tls.key), _read(tls.cert))], root_certificates=_read(tls.ca), require_client_auth=True
            )
            port = server.add_secure_port(bind, creds)
    except RuntimeError:  # (grpcio raises where older versions returned 0)
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {bind}: address in use or not available")
    return server, port

