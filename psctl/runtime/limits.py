"""Message size limits of every gRPC channel and server psctl opens, and the options that set them.

A module of its own, without numpy, so that what only opens channels and servers (a host's agent, the
supervisor's endpoint for agents) starts without importing numpy (~45 ms).
"""

from __future__ import annotations

#: Requests and responses up to this size go in one unary message; larger ones are streamed. Measured with the
#: roles' malloc settings (grpcio 1.85, 2 cores): up to 8-16 MiB one message costs less CPU than 2 MiB frames
#: (no frames to join, no request-iterator thread) and a push can bring the variables back in its answer; at
#: 32-64 MiB gRPC Python's unary path costs 2-4x the stream's.
UNARY_MAX_BYTES = 8 << 20
#: gRPC's message size limit, raised deliberately to fit a unary message plus its framing.
MAX_MESSAGE_BYTES = UNARY_MAX_BYTES + (1 << 20)


def grpc_options() -> list[tuple[str, int]]:
    """Channel and server options shared by every role: message limits raised on purpose."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]

#: The most data shards a run may read its data in (``training.data_shards``): a push's shard index beyond it is
#: refused by the PS, whose positions (one per shard, in every GetState) it would otherwise have to hold.
MAX_DATA_SHARDS = 100_000
