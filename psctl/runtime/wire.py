"""numpy arrays on the wire, with validation: frames, the plain protobuf form, chunking and reassembly.

An array travels as its raw C-order little-endian bytes plus dtype and shape; never pickled. Two forms:

- **framed** (psctl's own client and PS, the ``*Framed`` rpcs): one gRPC message holds a header (a protobuf
  message listing the arrays) and one payload with every array's bytes back to back. It is written with one
  ``b"".join`` of memoryviews and decoded with ``np.frombuffer`` straight on the received buffer: no copy.
- **plain** (the other rpcs, for other clients): the bytes inside each ``Tensor.data`` (protobuf copies them).

Arrays larger than a chunk are split into pieces carrying their byte offset, and an :class:`Assembler` puts
them back together, checking that the pieces are in order, of one dtype and shape, and cover the array exactly.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.message import DecodeError

from psctl.proto import psctl_pb2 as pb

#: dtypes accepted on the wire. Strings and objects never travel (no pickle).
DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
     "float16", "float32", "float64"}
)
#: Largest array accepted (bytes): far above any sane shard, far below what could exhaust memory by accident.
MAX_ARRAY_BYTES = 8 << 30
MAX_RANK = 8
#: Payload of each frame of a stream. Measured (64 MiB push+pull, 1 / 2 / 4 MiB): 2 MiB moves the most bytes per
#: second; larger messages cost gRPC Python more per byte (it gathers each one into a growing bytearray).
CHUNK_BYTES = 2 << 20
#: Every array in a frame starts at a multiple of this many bytes, so that it decodes aligned, in place.
FRAME_ALIGN = 8
#: The PS's gRPC service (rpc paths are /psctl.ParameterServer/<method>).
PS_SERVICE = "psctl.ParameterServer"

DENSE = pb.DENSE
IDS = pb.IDS
ROWS = pb.ROWS
SLOT = pb.SLOT
LEFT_FACTOR = pb.LEFT_FACTOR
RIGHT_FACTOR = pb.RIGHT_FACTOR
PULL_IDS = pb.PULL_IDS
_KINDS = (DENSE, IDS, ROWS, SLOT, LEFT_FACTOR, RIGHT_FACTOR, PULL_IDS)
_ZEROS = bytes(FRAME_ALIGN)
#: Wire dtype by name, and name by dtype (either byte order): looked up per array on every rpc, where numpy's
#: own ``dtype.name`` and ``np.dtype(name)`` cost microseconds each.
_WIRE_DTYPE = {name: np.dtype(name).newbyteorder("<") for name in DTYPES}
_NAME_OF = {dt.newbyteorder(order): name for name, dt in _WIRE_DTYPE.items() for order in "<>"}


_NO_DATA = np.zeros(0, dtype=np.float32)


class WireError(ValueError):
    """A malformed array or frame on the wire; servers answer it with INVALID_ARGUMENT."""


@dataclass(frozen=True)
class Entry:
    """One decoded array with its variable (shard) name and what it holds (DENSE, IDS or ROWS)."""

    name: str
    kind: int
    array: np.ndarray


def whole_shard(name: str) -> Entry:
    """A pull's ask for the whole of shard ``name`` (a DENSE entry with no data)."""
    return Entry(name, DENSE, _NO_DATA)


class Piece(NamedTuple):
    """Bytes ``offset .. offset + len(data)`` of one array (all of them when it travels whole)."""

    name: str
    kind: int
    dtype: str
    shape: tuple[int, ...]
    offset: int
    data: np.ndarray  # uint8, a view of the array where it is C-contiguous and little-endian already


def _dtype_name(array: np.ndarray) -> str:
    name = _NAME_OF.get(array.dtype)
    if name is None:
        raise WireError(f"dtype {array.dtype.name} cannot travel; use one of {', '.join(sorted(DTYPES))}")
    return name


def _wire_bytes(array: np.ndarray, name: str) -> np.ndarray:
    """The array's little-endian C-order bytes as a flat uint8 array (no copy when it already is so laid out)."""
    return np.ascontiguousarray(array, dtype=_WIRE_DTYPE[name]).reshape(-1).view(np.uint8)


# -- the plain form ----------------------------------------------------------------------------------------
def to_tensor(array: np.ndarray, out: pb.Tensor | None = None) -> pb.Tensor:
    """Encode a whole array."""
    array = np.asarray(array)
    name = _dtype_name(array)
    tensor = out if out is not None else pb.Tensor()
    tensor.dtype = name
    tensor.shape[:] = array.shape
    tensor.data = _wire_bytes(array, name).tobytes()
    return tensor


def _declared(tensor: pb.Tensor) -> tuple[np.dtype, tuple[int, ...], int]:
    dtype = _WIRE_DTYPE.get(tensor.dtype)
    if dtype is None:
        raise WireError(f"unsupported dtype {tensor.dtype!r}; expected one of {', '.join(sorted(DTYPES))}")
    dims = tensor.shape
    if len(dims) > MAX_RANK:
        raise WireError(f"rank {len(dims)} exceeds the maximum of {MAX_RANK}")
    shape = tuple(dims)
    if shape and min(shape) < 0:
        raise WireError(f"negative dimension in shape {shape}")
    # Bound the product of the non-zero dimensions too: a zero dimension must not hide a huge one, which
    # numpy would refuse later with an error of its own. (Python ints: no overflow.)
    bound = nbytes = dtype.itemsize
    for d in shape:
        bound *= d or 1
        nbytes *= d
        if bound > MAX_ARRAY_BYTES:
            raise WireError(f"array of shape {shape} exceeds the limit of {MAX_ARRAY_BYTES} bytes")
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


# -- pieces and chunks -------------------------------------------------------------------------------------
def iter_pieces(entries: Sequence[Entry], chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[Piece]]:
    """Cut entries into groups of pieces holding at most ``chunk_bytes`` of data each, without copying.

    Always yields at least one (possibly empty) group, so a request with no arrays still gets sent.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
    group: list[Piece] = []
    room = chunk_bytes
    sent = False
    for entry in entries:
        array = np.asarray(entry.array)
        name = _dtype_name(array)
        flat = _wire_bytes(array, name)
        offset = 0
        while True:
            take = min(room, len(flat) - offset)
            data = flat if take == len(flat) else flat[offset : offset + take]
            group.append(Piece(entry.name, entry.kind, name, array.shape, offset, data))
            offset += take
            room -= take
            if room <= 0:
                yield group
                group, room, sent = [], chunk_bytes, True
            if offset >= len(flat):
                break
    if group or not sent:  # pieces still to send (empty arrays too), or nothing was sent yet
        yield group


def _describe(item: pb.NamedTensor, piece: Piece) -> pb.Tensor:
    """Fill a fresh NamedTensor with the piece's name, kind, dtype, shape and offset (not its bytes)."""
    item.name = piece.name
    item.kind = piece.kind  # type: ignore[assignment]
    tensor = item.tensor
    tensor.dtype = piece.dtype
    tensor.shape.extend(piece.shape)
    if piece.offset:
        tensor.offset = piece.offset
    return tensor


def fill_chunks(
    entries: Sequence[Entry], new_message: Callable[[int], Any], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[Any]:
    """Plain form: yield messages made by ``new_message(i)`` whose repeated ``entries`` field holds the pieces
    of ``entries`` (at most ``chunk_bytes`` of data per message), each piece's bytes in its Tensor.data."""
    for index, group in enumerate(iter_pieces(entries, chunk_bytes)):
        message = new_message(index)
        field = message.part.entries if hasattr(message, "part") else message.entries  # PushChunk etc. wrap a part
        for piece in group:
            _describe(field.add(), piece).data = piece.data.tobytes()
        yield message


def iter_chunks(entries: Sequence[Entry], chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[pb.NamedTensor]]:
    """Plain form: the pieces of ``entries`` as NamedTensor groups (see fill_chunks)."""
    for message in fill_chunks(entries, lambda _i: pb.PullResponse(), chunk_bytes):
        yield list(message.entries)


# -- frames ------------------------------------------------------------------------------------------------
# A frame is the protobuf message {header = 1; padding = 2; payload = 3} (PushRequestFrame etc.), written by
# hand in that field order so that the payload can be read in place: each field is a tag byte (field number
# << 3 | 2, length-delimited), a varint length and the bytes.
_HEADER_TAG, _PADDING_TAG, _PAYLOAD_TAG = 0x0A, 0x12, 0x1A


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _frame(header: Any, pieces: Sequence[Piece]) -> bytes:
    """One frame: ``header`` (its ``entries`` filled in here, one per piece) and the pieces' bytes, each
    starting at a multiple of FRAME_ALIGN into the payload; the payload itself starts aligned too."""
    parts: list[Any] = []
    size = 0
    field = header.entries
    for piece in pieces:
        _describe(field.add(), piece).size = len(piece.data)
        gap = -size % FRAME_ALIGN
        if gap:
            parts.append(_ZEROS[:gap])
        parts.append(piece.data)
        size += gap + len(piece.data)
    head = header.SerializeToString()
    length = _varint(size)
    prefix = bytes((_HEADER_TAG,)) + _varint(len(head))
    pad = -(len(prefix) + len(head) + 3 + len(length)) % FRAME_ALIGN  # 3: padding tag, its length, payload tag
    return b"".join((prefix, head, bytes((_PADDING_TAG, pad)), _ZEROS[:pad], bytes((_PAYLOAD_TAG,)), length, *parts))


def encode_frame(header: Any, entries: Sequence[Entry]) -> bytes:
    """A frame of ``header`` and whole ``entries`` (the unary framed rpcs)."""
    (pieces,) = iter_pieces(entries, sys.maxsize)
    return _frame(header, pieces)


def frames(entries: Sequence[Entry], header: Any, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """A stream's frames, of at most ``chunk_bytes`` of payload each: the first with ``header``, the others with
    an empty header of its type (only their entries).

    Every dtype is checked now: gRPC consumes a request stream in a thread of its own, where an error would only
    show as a cancelled call.
    """
    for entry in entries:
        _dtype_name(np.asarray(entry.array))
    groups = iter_pieces(entries, chunk_bytes)
    return (_frame(header if i == 0 else type(header)(), group) for i, group in enumerate(groups))


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    if pos < len(view) and view[pos] < 0x80:  # one byte: every tag, and lengths below 128
        return view[pos], pos + 1
    value = shift = 0
    while True:
        if pos >= len(view):
            raise WireError("frame truncated inside a length")
        if shift > 63:
            raise WireError("frame has a length of more than 64 bits")
        byte = view[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        shift += 7
        if byte < 0x80:
            return value, pos


def _frame_fields(view: memoryview) -> dict[int, tuple[int, int]]:
    """Where header (1), padding (2) and payload (3) lie: each at most once, in that order, nothing else."""
    fields: dict[int, tuple[int, int]] = {}
    pos = last = 0
    while pos < len(view):
        tag, pos = _read_varint(view, pos)
        number = tag >> 3
        if tag & 7 != 2 or number not in (1, 2, 3) or number <= last:
            raise WireError(f"unexpected field {number} (wire type {tag & 7}) in a frame at byte {pos}")
        length, pos = _read_varint(view, pos)
        if length > len(view) - pos:
            raise WireError(f"frame field {number} of {length} bytes overruns the message ({len(view) - pos} left)")
        fields[number] = (pos, pos + length)
        pos += length
        last = number
    return fields


def decode_frame(buffer: bytes, header_type: Any) -> tuple[Any, list[tuple[pb.NamedTensor, np.ndarray]]]:
    """The header (a ``header_type`` message) and each of its entries with its bytes: read-only views of
    ``buffer``, nothing copied. WireError if the frame is malformed in any way."""
    view = memoryview(buffer)
    fields = _frame_fields(view)
    start, end = fields.get(1, (0, 0))
    try:
        header = header_type.FromString(bytes(view[start:end]))
    except DecodeError as exc:
        raise WireError(f"frame header is not a valid {header_type.__name__}: {exc}") from None
    start, end = fields.get(3, (0, 0))
    payload = np.frombuffer(buffer, np.uint8, count=end - start, offset=start)
    if payload.ctypes.data % FRAME_ALIGN:  # only a frame psctl did not write: align it (one copy)
        payload = payload.copy()
    pieces = []
    used = 0
    for item in header.entries:
        if item.tensor.data:
            raise WireError(f"entry {item.name!r}: a framed tensor's bytes belong in the payload, not in data")
        size = item.tensor.size
        at = used + -used % FRAME_ALIGN
        if size < 0 or size > len(payload) - at:
            raise WireError(f"entry {item.name!r}: {size} bytes at payload offset {at} overrun the "
                            f"payload of {len(payload)} bytes")  # fmt: skip
        pieces.append((item, payload[at : at + size]))
        used = at + size
    if used != len(payload):
        raise WireError(f"the payload holds {len(payload)} bytes, its entries {used}")
    return header, pieces


def read_frame(buffer: bytes, header_type: Any) -> tuple[Any, list[Entry]]:
    """A frame holding whole arrays: its header and its entries, decoded in place and validated."""
    header, pieces = decode_frame(buffer, header_type)
    assembler = Assembler()
    assembler.add_pieces(pieces)
    return header, assembler.entries()


# -- reassembly --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SplitArray:
    """A dense array left in the pieces it arrived in: consecutive 1-d runs of its elements, each a read-only
    view of a received frame. The PS validates and applies a streamed gradient run by run instead of first
    joining it, which would cost a copy of the whole gradient (64 MiB: ~11 ms of a ~50 ms push)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    parts: tuple[np.ndarray, ...]
    #: Every run passed the Assembler's ``check_run`` as it arrived (the PS's finite check), so a receiver
    #: need not read the whole array again once the last piece is in.
    runs_checked: bool = False

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def runs(self) -> Iterator[tuple[int, np.ndarray]]:
        """(index of its first element in the flat array, the run) for each run, in order."""
        start = 0
        for part in self.parts:
            yield start, part
            start += part.size

    def join(self) -> np.ndarray:
        """The whole array (one copy)."""
        out = np.concatenate(self.parts) if self.parts else np.empty(0, self.dtype)
        out = out.reshape(self.shape)
        out.flags.writeable = False
        return out


def _elements(data: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """``data`` (uint8) as 1-d elements of ``dtype`` without a copy, if it holds whole, aligned ones."""
    size = dtype.itemsize
    if len(data) % size or data.ctypes.data % size:
        return None
    return data.view(dtype)


@dataclass(slots=True)
class _Partial:
    """One array being reassembled: its declared layout, and its bytes so far."""

    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int
    data: np.ndarray | None = None  # uint8: the one piece that was the whole array, or a buffer being filled
    received: int = 0
    pieces: list[np.ndarray] | None = None  # uint8: the pieces as they arrived, when kept (see SplitArray)

    def append(self, name: str, data: np.ndarray, *, keep: bool) -> None:
        if self.received + len(data) > self.nbytes:
            raise WireError(f"entry {name!r}: more bytes than shape {self.shape} holds")
        if self.pieces is not None:
            self.pieces.append(data)
        elif self.received == 0 and len(data) == self.nbytes:
            self.data = data  # arrived whole: decoded in place
        elif keep and self.received == 0:
            self.pieces = [data]
        elif len(data):
            if self.data is None:
                try:
                    self.data = np.empty(self.nbytes, np.uint8)
                except MemoryError:
                    raise WireError(f"entry {name!r}: no memory for {self.nbytes} bytes") from None
            self.data[self.received : self.received + len(data)] = data
        self.received += len(data)

    def split(self, *, runs_checked: bool) -> SplitArray | None:
        """The kept pieces as a SplitArray, if every one of them holds whole, aligned elements."""
        if self.pieces is None or any(_elements(p, self.dtype) is None for p in self.pieces):
            return None
        runs = tuple(p.view(self.dtype) for p in self.pieces if len(p))
        return SplitArray(self.dtype, self.shape, runs, runs_checked)

    def array(self) -> np.ndarray:
        if self.pieces is not None:
            self.data = np.concatenate(self.pieces)
        data = self.data if self.data is not None else np.empty(0, np.uint8)
        out = data.view(self.dtype).reshape(self.shape)
        out.flags.writeable = False  # like every decoded array: a view of what arrived
        return out


class Assembler:
    """Reassembles entries from whole tensors or in-order pieces, validating as it goes."""

    def __init__(
        self,
        *,
        max_total_bytes: int = MAX_ARRAY_BYTES,
        keep_dense_pieces: bool = False,
        check_run: Callable[[str, np.ndarray], None] | None = None,
    ) -> None:
        """``keep_dense_pieces``: leave DENSE arrays that arrive in several pieces in them, for split_entries;
        ``check_run(name, elements)`` is called on each such piece as it arrives (it raises WireError to refuse
        the request), so that a check of the whole array overlaps its transfer instead of following it."""
        self._max_total = max_total_bytes
        self._keep_dense = keep_dense_pieces
        self._check_run = check_run
        self._total = 0
        self._parts: dict[tuple[str, int], _Partial] = {}  # in arrival order

    def add(self, items: Iterable[pb.NamedTensor]) -> None:
        """Plain form: pieces with their bytes in Tensor.data."""
        for item in items:
            self.add_piece(item, item.tensor.data)

    def add_pieces(self, pieces: Iterable[tuple[pb.NamedTensor, Any]]) -> None:
        for item, data in pieces:
            self.add_piece(item, data)

    def add_piece(self, item: pb.NamedTensor, data: Any) -> None:
        """One piece (``item`` describes it, ``data`` holds its bytes: bytes or a uint8 array)."""
        name, kind, tensor = item.name, item.kind, item.tensor
        if kind not in _KINDS:
            raise WireError(f"entry {name!r}: unknown kind {kind}")
        key = (name, int(kind))
        dtype, shape, nbytes = _declared(tensor)
        offset = tensor.offset
        part = self._parts.get(key)
        if part is None:
            if offset != 0:
                raise WireError(f"entry {name!r}: first piece starts at offset {offset}")
            self._total += nbytes
            if self._total > self._max_total:
                raise WireError(f"request exceeds the limit of {self._max_total} bytes")
            part = self._parts[key] = _Partial(dtype, shape, nbytes)
        else:
            if part.received == part.nbytes and offset == 0:
                raise WireError(f"entry {name!r} given twice")
            if (dtype, shape) != (part.dtype, part.shape):
                raise WireError(f"entry {name!r}: pieces disagree on dtype or shape")
            if offset != part.received:
                raise WireError(f"entry {name!r}: piece at offset {offset}, expected {part.received}")
        data = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        keep = self._keep_dense and kind == DENSE
        part.append(name, data, keep=keep)
        if keep and part.pieces is not None and self._check_run is not None:
            elements = _elements(data, dtype)
            if elements is not None:  # (an unaligned piece makes split() join the array: checked whole later)
                self._check_run(name, elements)

    def entries(self) -> list[Entry]:
        """Every entry, whole (pieces kept by ``keep_dense_pieces`` are joined)."""
        return [Entry(name, kind, part.array()) for (name, kind), part in self._complete()]

    def split_entries(self) -> tuple[list[Entry], dict[str, SplitArray]]:
        """The DENSE arrays kept in aligned pieces, as SplitArrays by name, and every other entry whole."""
        out: list[Entry] = []
        split_arrays: dict[str, SplitArray] = {}
        for (name, kind), part in self._complete():
            pieces = part.split(runs_checked=self._check_run is not None)
            if pieces is not None:
                split_arrays[name] = pieces
            else:
                out.append(Entry(name, kind, part.array()))
        return out, split_arrays

    def _complete(self) -> list[tuple[tuple[str, int], _Partial]]:
        for (name, _), part in self._parts.items():
            if part.received != part.nbytes:
                raise WireError(f"entry {name!r}: got {part.received} of {part.nbytes} bytes")
        return list(self._parts.items())


def decode_entries(items: Iterable[pb.NamedTensor]) -> list[Entry]:
    """Plain form: whole entries (or in-order pieces) from NamedTensors with their bytes inline."""
    assembler = Assembler()
    assembler.add(items)
    return assembler.entries()
