"""numpy arrays <-> protobuf, with validation, and chunking for large transfers.

An array travels as its raw C-order little-endian bytes plus dtype and shape; it is decoded with
``np.frombuffer`` (no pickle, no copy when it arrived whole). Arrays larger than a chunk are split into
pieces carrying their byte offset, and an :class:`Assembler` puts them back together, checking that the
pieces are in order, of one dtype and shape, and cover the array exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from psctl.proto import psctl_pb2 as pb

#: dtypes accepted on the wire. Strings and objects never travel (no pickle).
DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"}
)
#: Largest array accepted (bytes): far above any sane shard, far below what could exhaust memory by accident.
MAX_ARRAY_BYTES = 8 << 30
MAX_RANK = 8
#: Size of each piece of a streamed array. 4 MiB keeps per-message overhead small relative to copying.
CHUNK_BYTES = 4 << 20
#: Requests and responses up to this size go in one unary message; larger ones are streamed (measured: above
#: a few MiB gRPC's unary path is slower than streaming the same bytes in chunks).
UNARY_MAX_BYTES = CHUNK_BYTES
#: gRPC's message size limit, raised deliberately to fit a unary message plus its framing.
MAX_MESSAGE_BYTES = UNARY_MAX_BYTES + (1 << 20)

DENSE = pb.DENSE
IDS = pb.IDS
ROWS = pb.ROWS
SLOT = pb.SLOT


class WireError(ValueError):
    """A malformed array on the wire; servers answer it with INVALID_ARGUMENT."""


@dataclass(frozen=True)
class Entry:
    """One decoded array with its variable (shard) name and what it holds (DENSE, IDS or ROWS)."""

    name: str
    kind: int
    array: np.ndarray


def _wire_dtype(array: np.ndarray) -> np.dtype:
    if array.dtype.name not in DTYPES:
        raise WireError(f"dtype {array.dtype.name} cannot travel; use one of {', '.join(sorted(DTYPES))}")
    return array.dtype.newbyteorder("<")


def to_tensor(array: np.ndarray, out: pb.Tensor | None = None) -> pb.Tensor:
    """Encode a whole array."""
    array = np.asarray(array)
    dtype = _wire_dtype(array)
    tensor = out if out is not None else pb.Tensor()
    tensor.dtype = array.dtype.name
    tensor.shape[:] = array.shape
    tensor.data = np.ascontiguousarray(array, dtype=dtype).tobytes()
    return tensor


def _declared(tensor: pb.Tensor) -> tuple[np.dtype, tuple[int, ...], int]:
    if tensor.dtype not in DTYPES:
        raise WireError(f"unsupported dtype {tensor.dtype!r}; expected one of {', '.join(sorted(DTYPES))}")
    if len(tensor.shape) > MAX_RANK:
        raise WireError(f"rank {len(tensor.shape)} exceeds the maximum of {MAX_RANK}")
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise WireError(f"negative dimension in shape {shape}")
    dtype = np.dtype(tensor.dtype).newbyteorder("<")
    # Bound the product of the non-zero dimensions too: a zero dimension must not hide a huge one, which
    # numpy would refuse later with an error of its own.
    bound = dtype.itemsize
    for d in shape:
        bound *= max(d, 1)
        if bound > MAX_ARRAY_BYTES:
            raise WireError(f"array of shape {shape} exceeds the limit of {MAX_ARRAY_BYTES} bytes")
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    return dtype, shape, nbytes


def from_tensor(tensor: pb.Tensor) -> np.ndarray:
    """Decode a whole array (read-only view of the message's bytes); WireError if malformed."""
    dtype, shape, nbytes = _declared(tensor)
    data = tensor.data  # read once: each read of a bytes field is a copy
    if tensor.offset != 0 or len(data) != nbytes:
        raise WireError(
            f"shape {shape} of {tensor.dtype} needs {nbytes} bytes, got {len(data)} at offset {tensor.offset}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def add_entries(field: object, entries: Iterable[Entry]) -> None:
    """Append whole entries to a repeated NamedTensor field."""
    for entry in entries:
        item = field.add()  # type: ignore[attr-defined]
        item.name = entry.name
        item.kind = entry.kind
        to_tensor(entry.array, item.tensor)


def payload_bytes(entries: Iterable[Entry]) -> int:
    return sum(int(np.asarray(e.array).nbytes) for e in entries)


def iter_chunks(entries: Sequence[Entry], chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[pb.NamedTensor]]:
    """Split entries into groups of NamedTensor pieces of at most ``chunk_bytes`` of data each.

    Always yields at least one (possibly empty) group, so a request with no arrays still gets sent.
    """
    for message in fill_chunks(entries, lambda _i: pb.PullResponse(), chunk_bytes):
        yield list(message.entries)


def fill_chunks(
    entries: Sequence[Entry], new_message: Callable[[int], Any], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[Any]:
    """Yield messages made by ``new_message(i)`` whose repeated ``entries`` field holds the pieces of
    ``entries`` (at most ``chunk_bytes`` of data per message), each piece built in place."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
    index = 0
    message = new_message(index)
    field = _entries_field(message)
    room = chunk_bytes
    for entry in entries:
        array = np.asarray(entry.array)
        dtype = _wire_dtype(array)
        flat = np.ascontiguousarray(array, dtype=dtype).reshape(-1).view(np.uint8)  # bytes, no copy
        offset = 0
        while True:
            take = min(room, len(flat) - offset)
            piece = field.add()
            piece.name = entry.name
            piece.kind = entry.kind
            piece.tensor.dtype = array.dtype.name
            piece.tensor.shape[:] = array.shape
            piece.tensor.offset = offset
            piece.tensor.data = flat[offset : offset + take].tobytes()
            offset += take
            room -= take
            if room <= 0:
                yield message
                index += 1
                message = new_message(index)
                field = _entries_field(message)
                room = chunk_bytes
            if offset >= len(flat):
                break
    if len(field) or index == 0:  # pieces still to send (empty arrays too), or nothing was sent yet
        yield message


def _entries_field(message: Any) -> Any:
    """The repeated NamedTensor field of a chunk message (PushChunk / PullChunk / AssignChunk wrap a part)."""
    return message.part.entries if hasattr(message, "part") else message.entries


class Assembler:
    """Reassembles entries from whole tensors or in-order pieces, validating as it goes."""

    def __init__(self, *, max_total_bytes: int = MAX_ARRAY_BYTES) -> None:
        self._max_total = max_total_bytes
        self._total = 0
        self._order: list[tuple[str, int]] = []
        self._parts: dict[tuple[str, int], tuple[np.dtype, tuple[int, ...], int, list[bytes], int]] = {}

    def add(self, items: Iterable[pb.NamedTensor]) -> None:
        for item in items:
            if item.kind not in (DENSE, IDS, ROWS, SLOT):
                raise WireError(f"entry {item.name!r}: unknown kind {item.kind}")
            key = (item.name, int(item.kind))
            dtype, shape, nbytes = _declared(item.tensor)
            data = item.tensor.data
            if key not in self._parts:
                if item.tensor.offset != 0:
                    raise WireError(f"entry {item.name!r}: first piece starts at offset {item.tensor.offset}")
                self._total += nbytes
                if self._total > self._max_total:
                    raise WireError(f"request exceeds the limit of {self._max_total} bytes")
                self._order.append(key)
                self._parts[key] = (dtype, shape, nbytes, [data], len(data))
            else:
                first_dtype, first_shape, total, pieces, received = self._parts[key]
                if received == total and item.tensor.offset == 0:
                    raise WireError(f"entry {item.name!r} given twice")
                if (dtype, shape) != (first_dtype, first_shape):
                    raise WireError(f"entry {item.name!r}: pieces disagree on dtype or shape")
                if item.tensor.offset != received:
                    raise WireError(f"entry {item.name!r}: piece at offset {item.tensor.offset}, expected {received}")
                pieces.append(data)
                self._parts[key] = (dtype, shape, total, pieces, received + len(data))
            if self._parts[key][4] > nbytes:
                raise WireError(f"entry {item.name!r}: more bytes than shape {shape} holds")

    def entries(self) -> list[Entry]:
        out = []
        for key in self._order:
            dtype, shape, nbytes, pieces, received = self._parts[key]
            if received != nbytes:
                raise WireError(f"entry {key[0]!r}: got {received} of {nbytes} bytes")
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            out.append(Entry(key[0], key[1], np.frombuffer(data, dtype=dtype).reshape(shape)))
        return out


def decode_entries(items: Iterable[pb.NamedTensor]) -> list[Entry]:
    assembler = Assembler()
    assembler.add(items)
    return assembler.entries()


def grpc_options() -> list[tuple[str, int]]:
    """Channel and server options shared by every role: message limits raised on purpose."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
