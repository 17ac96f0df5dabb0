"""psctl.runtime.wire: arrays <-> protobuf and frames, round trips, chunking and reassembly, and every refusal."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psctl.proto import psctl_pb2 as pb
from psctl.runtime import wire
from psctl.runtime.wire import DENSE, IDS, ROWS, Assembler, Entry, WireError, from_tensor, iter_chunks, to_tensor

ALL_DTYPES = sorted(wire.DTYPES)


def _sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """Values that exercise the dtype (negative where signed, fractional where float, both booleans)."""
    n = math.prod(shape)
    base = np.arange(n, dtype=np.int64) * 37 - 5
    if dtype == "bool":
        return (base % 3 == 0).reshape(shape)
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return (base / 7.0).astype(dt).reshape(shape)
    if dt.kind == "u":
        # include the top bit, so a uint64 that does not fit an int64 travels too
        top = np.array([np.iinfo(dt).max], dtype=dt)
        return np.concatenate([top, (np.abs(base) % 250).astype(dt)])[:n].reshape(shape)
    info = np.iinfo(dt)
    return np.clip(base, info.min, info.max).astype(dt).reshape(shape)


def _assert_same(decoded: np.ndarray, original: np.ndarray) -> None:
    assert decoded.dtype.name == original.dtype.name
    assert decoded.dtype.byteorder in ("<", "=", "|")
    assert decoded.shape == original.shape
    np.testing.assert_array_equal(decoded, original)
    # bit-for-bit (NaN-safe and sign-of-zero-safe): compare the little-endian bytes
    le = original.dtype.newbyteorder("<")
    assert np.ascontiguousarray(decoded, dtype=le).tobytes() == np.ascontiguousarray(original, dtype=le).tobytes()


# -- whole tensors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(3, 4), (), (0,), (2, 0, 3), (1, 1, 1, 1, 1, 1, 1, 5)])
def test_round_trip_every_dtype_and_shape(dtype: str, shape: tuple[int, ...]) -> None:
    array = _sample(dtype, shape)
    tensor = to_tensor(array)
    assert tensor.dtype == dtype
    assert tuple(tensor.shape) == shape
    assert tensor.offset == 0
    assert len(tensor.data) == array.nbytes
    # the message survives real serialization, not only the in-memory object
    decoded = from_tensor(pb.Tensor.FromString(tensor.SerializeToString()))
    _assert_same(decoded, array)


def test_round_trip_special_float_values() -> None:
    array = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, np.finfo(np.float64).tiny], dtype=np.float64)
    _assert_same(from_tensor(to_tensor(array)), array)
    half = array.astype(np.float16)
    _assert_same(from_tensor(to_tensor(half)), half)


def test_zero_d_array_keeps_its_empty_shape() -> None:
    array = np.array(2.5, dtype=np.float32)
    tensor = to_tensor(array)
    assert list(tensor.shape) == []
    decoded = from_tensor(tensor)
    assert decoded.shape == ()
    assert decoded.item() == 2.5


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(60, dtype=np.float32).reshape(6, 10)[::2, ::3],  # strided view
        lambda: np.arange(24, dtype=np.int64).reshape(4, 6).T,  # Fortran order
        lambda: np.arange(10, dtype=np.int16)[::-1],  # negative stride
        lambda: np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
    ],
    ids=["strided", "transposed", "reversed", "fortran"],
)
def test_non_contiguous_inputs_travel_in_c_order(make: object) -> None:
    array = make()  # type: ignore[operator]
    assert not array.flags.c_contiguous
    tensor = to_tensor(array)
    assert tensor.data == np.ascontiguousarray(array).tobytes()
    _assert_same(from_tensor(tensor), array)


@pytest.mark.parametrize("dtype", [">i4", ">f8", ">u2", ">f2", ">i8", ">f4", ">u8"])
def test_big_endian_input_is_sent_little_endian(dtype: str) -> None:
    array = np.arange(-3, 9, dtype=dtype).reshape(3, 4) if dtype[1] != "u" else np.arange(12, dtype=dtype)
    tensor = to_tensor(array)
    little = array.astype(np.dtype(dtype).newbyteorder("<"))
    assert tensor.dtype == np.dtype(dtype).name
    assert tensor.data == little.tobytes()
    assert tensor.data != array.tobytes()  # the big-endian bytes really were converted
    decoded = from_tensor(tensor)
    assert decoded.dtype == little.dtype
    np.testing.assert_array_equal(decoded, array)


def test_big_endian_input_is_chunked_little_endian() -> None:
    array = np.arange(10, dtype=">i4")
    groups = list(iter_chunks([Entry("x", DENSE, array)], chunk_bytes=7))
    data = b"".join(piece.tensor.data for group in groups for piece in group)
    assert data == array.astype("<i4").tobytes()


def test_decoded_array_is_read_only_view() -> None:
    decoded = from_tensor(to_tensor(np.arange(4, dtype=np.int32)))
    assert not decoded.flags.writeable


# -- chunking and reassembly -----------------------------------------------------------------------------
def _entries() -> list[Entry]:
    return [
        Entry("empty/first", DENSE, np.zeros((0,), dtype=np.float32)),
        Entry("dense/kernel", DENSE, np.arange(15, dtype=np.float32).reshape(3, 5) / 3),
        Entry("emb/part_0", IDS, np.array([3, 1, 4, 1, 5], dtype=np.int64)),
        Entry("emb/part_0", ROWS, np.arange(10, dtype=np.float64).reshape(5, 2) - 4.5),
        Entry("scalar", DENSE, np.array(7, dtype=np.int16)),
        Entry("empty/2d", DENSE, np.zeros((4, 0), dtype=np.float64)),
        Entry("flags", DENSE, np.array([True, False, True])),
        Entry("bytes", DENSE, np.arange(9, dtype=np.uint8)),
        Entry("empty/last", IDS, np.zeros((0,), dtype=np.int64)),
    ]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 8, 13, 64, 1 << 20])
def test_chunks_reassemble_exactly(chunk_bytes: int) -> None:
    entries = _entries()
    total = wire.payload_bytes(entries)
    groups = list(iter_chunks(entries, chunk_bytes=chunk_bytes))
    sizes = [sum(len(p.tensor.data) for p in group) for group in groups]
    assert all(size <= chunk_bytes for size in sizes)
    assert sum(sizes) == total
    # every group but the last is full; the last may carry only empty entries (which must travel too)
    assert all(size == chunk_bytes for size in sizes[:-1])
    assert len(groups) in (max(1, math.ceil(total / chunk_bytes)), math.ceil(total / chunk_bytes) + 1)
    if sizes[-1] == 0:
        assert groups[-1] and all(len(p.tensor.data) == 0 for p in groups[-1])
    if chunk_bytes < total:
        assert len(groups) > 1
    assembler = Assembler()
    for group in groups:
        # each group goes through real serialization, as the streaming rpcs send it
        chunk = pb.PushChunk(part=pb.PushRequest(entries=group))
        assembler.add(pb.PushChunk.FromString(chunk.SerializeToString()).part.entries)
    out = assembler.entries()
    assert [(e.name, e.kind) for e in out] == [(e.name, e.kind) for e in entries]
    for got, want in zip(out, entries, strict=True):
        _assert_same(got.array, np.asarray(want.array))


def test_pieces_carry_offsets_shape_and_dtype_of_the_whole_array() -> None:
    array = np.arange(5, dtype=np.float32)  # 20 bytes -> pieces of 7, 7, 6
    pieces = [p for group in iter_chunks([Entry("v", DENSE, array)], chunk_bytes=7) for p in group]
    assert [p.tensor.offset for p in pieces] == [0, 7, 14]
    assert [len(p.tensor.data) for p in pieces] == [7, 7, 6]
    assert all(list(p.tensor.shape) == [5] and p.tensor.dtype == "float32" for p in pieces)


def test_empty_entry_list_still_yields_one_group() -> None:
    groups = list(iter_chunks([]))
    assert groups == [[]]
    assembler = Assembler()
    assembler.add(groups[0])
    assert assembler.entries() == []


def test_only_empty_entries_yield_one_group_with_all_of_them() -> None:
    entries = [Entry("a", DENSE, np.zeros(0, np.float32)), Entry("b", IDS, np.zeros((0, 3), np.int64))]
    groups = list(iter_chunks(entries, chunk_bytes=7))
    assert len(groups) == 1
    assert [p.name for p in groups[0]] == ["a", "b"]
    out = wire.decode_entries(groups[0])
    assert [(e.name, e.array.shape) for e in out] == [("a", (0,)), ("b", (0, 3))]


def test_exact_multiple_of_chunk_size_has_no_trailing_empty_group() -> None:
    groups = list(iter_chunks([Entry("v", DENSE, np.arange(14, dtype=np.uint8))], chunk_bytes=7))
    assert [len(g) for g in groups] == [1, 1]


def test_add_entries_and_decode_entries_round_trip() -> None:
    request = pb.PullRequest()
    wire.add_entries(request.entries, _entries())
    out = wire.decode_entries(pb.PullRequest.FromString(request.SerializeToString()).entries)
    for got, want in zip(out, _entries(), strict=True):
        assert (got.name, got.kind) == (want.name, want.kind)
        _assert_same(got.array, np.asarray(want.array))


# -- refusals ------------------------------------------------------------------------------------------------
def _tensor(
    dtype: str = "float32", shape: tuple[int, ...] = (3,), data: bytes | None = None, offset: int = 0
) -> pb.Tensor:
    if data is None:
        data = b"\0" * (np.dtype(dtype).itemsize * math.prod(shape)) if dtype in wire.DTYPES else b""
    return pb.Tensor(dtype=dtype, shape=list(shape), data=data, offset=offset)


def _piece(name: str, tensor: pb.Tensor, kind: int = DENSE) -> pb.NamedTensor:
    return pb.NamedTensor(name=name, kind=kind, tensor=tensor)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (_tensor("complex64", data=b"\0" * 24), "unsupported dtype"),
        (_tensor("object", data=b"\0" * 24), "unsupported dtype"),
        (_tensor("<U3", data=b"\0" * 36), "unsupported dtype"),
        (_tensor("", data=b""), "unsupported dtype"),
        (_tensor("float32", (2, -1), data=b""), "negative dimension"),
        (_tensor("float32", (3,), data=b"\0" * 8), "needs 12 bytes"),
        (_tensor("float32", (3,), data=b"\0" * 16), "needs 12 bytes"),
        (_tensor("int64", (), data=b""), "needs 8 bytes"),
        (_tensor("float32", (3,), offset=4), "at offset 4"),
        (_tensor("float32", (1 << 31, 1 << 31), data=b""), "exceeds the limit"),
        (_tensor("uint8", (wire.MAX_ARRAY_BYTES + 1,), data=b""), "exceeds the limit"),
        (_tensor("float64", (1 << 62, 1 << 62, 1 << 62), data=b""), "exceeds the limit"),
        (_tensor("float32", (1,) * (wire.MAX_RANK + 1)), "rank 9 exceeds"),
    ],
    ids=[
        "complex",
        "object",
        "unicode",
        "no-dtype",
        "negative-dim",
        "too-few-bytes",
        "too-many-bytes",
        "scalar-without-data",
        "offset-on-whole",
        "product-over-limit",
        "one-dim-over-limit",
        "product-over-int64",
        "rank-9",
    ],
)
def test_malformed_tensor_is_refused(tensor: pb.Tensor, message: str) -> None:
    with pytest.raises(WireError, match=message):
        from_tensor(tensor)
    # the same tensor as a (first) piece is refused by the Assembler too
    with pytest.raises(WireError):
        wire.decode_entries([_piece("x", tensor)])


def test_rank_eight_is_the_limit_and_accepted() -> None:
    array = np.zeros((1,) * wire.MAX_RANK, dtype=np.float32)
    assert from_tensor(to_tensor(array)).shape == array.shape


def test_zero_size_shape_with_huge_dims_is_refused_as_wire_error() -> None:
    # Its product is 0 bytes, yet numpy cannot even describe it: it must be a WireError (a server answers
    # INVALID_ARGUMENT), not numpy's own ValueError escaping from the decoder.
    for shape in [(0, 1 << 62), (1 << 62, 0), (0, 1 << 40, 1 << 40)]:
        with pytest.raises(WireError):
            from_tensor(_tensor("float32", shape, data=b""))
        with pytest.raises(WireError):
            wire.decode_entries([_piece("x", _tensor("float32", shape, data=b""))])


def test_rank_limit_is_checked_before_the_shape_is_used() -> None:
    # 64 dims of 2**62: rank is refused before any product is formed
    with pytest.raises(WireError, match="rank"):
        from_tensor(_tensor("float32", (1 << 62,) * 64, data=b""))


@pytest.mark.parametrize(
    "array",
    [
        np.array(["a", "bc"]),
        np.array([b"x", b"yz"]),
        np.array([1, "a", None], dtype=object),
        np.array([1 + 2j], dtype=np.complex64),
        np.zeros(2, dtype=[("a", np.int32), ("b", np.float32)]),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
        np.zeros(3, dtype=np.float128) if hasattr(np, "float128") else np.zeros(3, dtype=np.clongdouble),
    ],
    ids=["unicode", "bytes", "object", "complex", "structured", "datetime", "longdouble"],
)
def test_arrays_that_cannot_travel_are_refused_on_encode(array: np.ndarray) -> None:
    with pytest.raises(WireError, match="cannot travel"):
        to_tensor(array)
    with pytest.raises(WireError, match="cannot travel"):
        list(iter_chunks([Entry("x", DENSE, array)]))
    request = pb.PushRequest()
    with pytest.raises(WireError):
        wire.add_entries(request.entries, [Entry("x", DENSE, array)])


def _pieces_of(array: np.ndarray, chunk_bytes: int = 4, name: str = "v") -> list[pb.NamedTensor]:
    return [p for group in iter_chunks([Entry(name, DENSE, array)], chunk_bytes=chunk_bytes) for p in group]


def test_out_of_order_pieces_are_refused() -> None:
    pieces = _pieces_of(np.arange(4, dtype=np.float32))  # offsets 0, 4, 8, 12
    assembler = Assembler()
    assembler.add([pieces[0]])
    with pytest.raises(WireError, match="piece at offset 8, expected 4"):
        assembler.add([pieces[2]])
    with pytest.raises(WireError, match="piece at offset 12, expected 8"):
        Assembler().add([pieces[0], pieces[1], pieces[3], pieces[2]])
    with pytest.raises(WireError, match="first piece starts at offset 4"):
        Assembler().add([pieces[1]])
    # a piece repeated (a retransmission) is out of order too
    with pytest.raises(WireError, match="piece at offset 0, expected 4"):
        Assembler().add([pieces[0], pieces[0]])


def test_same_name_different_kind_is_a_different_entry() -> None:
    ids = _pieces_of(np.array([1, 2], dtype=np.int64), chunk_bytes=8, name="e")
    for p in ids:
        p.kind = IDS
    rows = _pieces_of(np.array([[1.0], [2.0]], dtype=np.float32), chunk_bytes=8, name="e")
    for p in rows:
        p.kind = ROWS
    out = wire.decode_entries([ids[0], rows[0], ids[1]])
    assert [(e.name, e.kind, e.array.tolist()) for e in out] == [("e", IDS, [1, 2]), ("e", ROWS, [[1.0], [2.0]])]


def test_pieces_disagreeing_on_shape_or_dtype_are_refused() -> None:
    first = _piece("v", _tensor("float32", (4,), data=b"\0" * 8))
    other_shape = _piece("v", _tensor("float32", (2, 2), data=b"\0" * 8, offset=8))
    other_dtype = _piece("v", _tensor("int32", (4,), data=b"\0" * 8, offset=8))
    with pytest.raises(WireError, match="disagree"):
        Assembler().add([first, other_shape])
    with pytest.raises(WireError, match="disagree"):
        Assembler().add([first, other_dtype])


def test_more_bytes_than_the_shape_holds_are_refused() -> None:
    with pytest.raises(WireError, match="more bytes"):
        Assembler().add([_piece("v", _tensor("float32", (2,), data=b"\0" * 9))])
    pieces = [
        _piece("v", _tensor("float32", (2,), data=b"\0" * 4)),
        _piece("v", _tensor("float32", (2,), data=b"\0" * 8, offset=4)),
    ]
    with pytest.raises(WireError, match="more bytes"):
        Assembler().add(pieces)


def test_missing_bytes_are_refused_when_entries_are_taken() -> None:
    assembler = Assembler()
    assembler.add(_pieces_of(np.arange(4, dtype=np.float32))[:3])
    with pytest.raises(WireError, match="got 12 of 16 bytes"):
        assembler.entries()


def test_assembler_refuses_declared_sizes_over_its_budget_before_data_arrives() -> None:
    assembler = Assembler(max_total_bytes=100)
    assembler.add([_piece("a", _tensor("float32", (20,), data=b"\0" * 4))])  # 80 bytes declared: fine
    with pytest.raises(WireError, match="exceeds the limit of 100 bytes"):
        # only 4 bytes of data, but 40 declared: 120 in all
        assembler.add([_piece("b", _tensor("float32", (10,), data=b"\0" * 4))])


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(WireError, match="unknown kind"):
        Assembler().add([_piece("v", _tensor("float32", (1,)), kind=7)])


# -- frames ----------------------------------------------------------------------------------------------------
def _frame_of(entries: list[Entry], header: object | None = None) -> bytes:
    return wire.encode_frame(header if header is not None else pb.PushRequest(step_id=3, task="w:0"), entries)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(3, 4), (), (0,), (2, 0, 3), (1, 1, 1, 1, 1, 1, 1, 5), (7,)])
def test_frame_round_trip_every_dtype_and_shape_in_place(dtype: str, shape: tuple[int, ...]) -> None:
    array = _sample(dtype, shape)
    # an odd-sized entry first, so that the next one must be padded to its alignment
    first = np.arange(3, dtype=np.uint8)
    frame = _frame_of([Entry("odd", DENSE, first), Entry("x", ROWS, array)])
    header, entries = wire.read_frame(frame, pb.PushRequest)
    assert (header.step_id, header.task) == (3, "w:0")
    assert [(e.name, e.kind) for e in entries] == [("odd", DENSE), ("x", ROWS)]
    _assert_same(entries[0].array, first)
    decoded = entries[1].array
    _assert_same(decoded, array)
    assert not decoded.flags.writeable
    assert decoded.ctypes.data % wire.FRAME_ALIGN == 0
    if array.size:  # decoded in place: a view of the received message, nothing copied
        assert np.shares_memory(decoded, np.frombuffer(frame, np.uint8))


@pytest.mark.parametrize("dtype", [">i4", ">f8", ">u2", ">f2"])
def test_frames_carry_little_endian_bytes(dtype: str) -> None:
    array = np.arange(-3, 9, dtype=dtype).reshape(3, 4) if dtype[1] != "u" else np.arange(12, dtype=dtype)
    (entry,) = wire.read_frame(_frame_of([Entry("x", DENSE, array)]), pb.PushRequest)[1]
    assert entry.array.dtype == array.dtype.newbyteorder("<")
    np.testing.assert_array_equal(entry.array, array)
    assert array.astype(array.dtype.newbyteorder("<")).tobytes() in _frame_of([Entry("x", DENSE, array)])


def test_non_contiguous_inputs_travel_framed_in_c_order() -> None:
    array = np.arange(60, dtype=np.float32).reshape(6, 10)[::2, ::3]
    (entry,) = wire.read_frame(_frame_of([Entry("x", DENSE, array)]), pb.PushRequest)[1]
    _assert_same(entry.array, array)


def test_a_frame_is_the_protobuf_message_its_schema_describes() -> None:
    entries = _entries()
    frame = _frame_of(entries)
    message = pb.PushRequestFrame.FromString(frame)
    assert (message.header.step_id, message.header.task) == (3, "w:0")
    assert [e.name for e in message.header.entries] == [e.name for e in entries]
    assert all(not e.tensor.data for e in message.header.entries)
    assert sum(e.tensor.size for e in message.header.entries) == wire.payload_bytes(entries)
    assert set(message.padding) <= {0}
    # A plain protobuf client's frame (no padding, so the payload is not aligned) is read too, with one copy.
    plain = pb.PushRequestFrame(header=message.header, payload=message.payload).SerializeToString()
    _, got = wire.read_frame(plain, pb.PushRequest)
    for decoded, want in zip(got, entries, strict=True):
        _assert_same(decoded.array, np.asarray(want.array))
        assert decoded.array.ctypes.data % wire.FRAME_ALIGN == 0


@pytest.mark.parametrize("chunk_bytes", [1, 7, 8, 13, 64, 1 << 20])
def test_framed_streams_reassemble_exactly(chunk_bytes: int) -> None:
    entries = _entries()
    frames = list(wire.frames(entries, pb.PushRequest(step_id=9, task="w:1"), chunk_bytes))
    assembler = Assembler()
    for i, frame in enumerate(frames):
        header, pieces = wire.decode_frame(frame, pb.PushRequest)
        assert (header.step_id, header.task) == ((9, "w:1") if i == 0 else (0, ""))
        assert sum(len(data) for _, data in pieces) <= chunk_bytes
        assembler.add_pieces(pieces)
    assert len(frames) >= math.ceil(wire.payload_bytes(entries) / chunk_bytes)
    for got, want in zip(assembler.entries(), entries, strict=True):
        assert (got.name, got.kind) == (want.name, want.kind)
        _assert_same(got.array, np.asarray(want.array))


def test_a_stream_of_no_arrays_is_one_frame() -> None:
    (frame,) = wire.frames([], pb.AssignRequest(global_step=4))
    header, pieces = wire.decode_frame(frame, pb.AssignRequest)
    assert (header.global_step, pieces) == (4, [])


def test_arrays_that_cannot_travel_are_refused_before_any_frame_is_made() -> None:
    bad = [Entry("ok", DENSE, np.zeros(3)), Entry("x", DENSE, np.array(["a"]))]
    with pytest.raises(WireError, match="cannot travel"):
        wire.frames(bad, pb.PushRequest())  # not lazily, in gRPC's request thread
    with pytest.raises(WireError, match="cannot travel"):
        _frame_of(bad)


def _good_frame() -> bytes:
    return _frame_of([Entry("w", DENSE, np.arange(12, dtype=np.float32).reshape(3, 4)),
                      Entry("e", IDS, np.array([4, 1], dtype=np.int64))])  # fmt: skip


def _tag(number: int, wire_type: int = 2) -> bytes:
    return bytes([number << 3 | wire_type])


def _field(number: int, data: bytes) -> bytes:
    return _tag(number) + wire._varint(len(data)) + data


def _header_bytes(*items: pb.NamedTensor) -> bytes:
    return pb.PushRequest(step_id=1, entries=list(items)).SerializeToString()


def _item(name: str = "w", dtype: str = "float32", shape: tuple[int, ...] = (2,), size: int = 8,
          data: bytes = b"", offset: int = 0) -> pb.NamedTensor:  # fmt: skip
    return pb.NamedTensor(name=name, tensor=pb.Tensor(dtype=dtype, shape=shape, size=size, data=data, offset=offset))


def _refuse(frame: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        wire.read_frame(frame, pb.PushRequest)


def test_every_truncation_of_a_frame_is_refused() -> None:
    frame = _good_frame()
    for n in range(1, len(frame)):
        with pytest.raises(WireError):
            wire.read_frame(frame[:n], pb.PushRequest)
    assert wire.read_frame(b"", pb.PushRequest)[1] == []  # no bytes at all: an empty header and no arrays


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (_field(1, _header_bytes(_item())) + _field(3, bytes(8)) + b"\x00", "unexpected field 0"),
        (_tag(1) + wire._varint(1 << 40) + _header_bytes(), "field 1 of 1099511627776 bytes overruns the message"),
        (_field(1, _header_bytes(_item())) + _tag(3) + wire._varint(100) + bytes(8), "field 3 of 100 bytes overruns"),
        (_tag(1) + b"\xff" * 11, "more than 64 bits|truncated"),
        (_tag(1) + b"\x80", "truncated inside a length"),
        (_field(3, bytes(8)) + _field(1, _header_bytes(_item())), "unexpected field 1"),
        (_field(1, _header_bytes()) + _field(1, _header_bytes()), "unexpected field 1"),
        (_field(1, _header_bytes()) + _field(4, b"x"), "unexpected field 4"),
        (_tag(1, 0) + b"\x05", r"unexpected field 1 \(wire type 0\)"),
        (_field(1, b"\xff\xff\xff"), "not a valid PushRequest"),
        (_field(1, _header_bytes(_item(data=bytes(8)))) + _field(3, bytes(8)), "belong in the payload"),
        (_field(1, _header_bytes(_item(size=-1))) + _field(3, bytes(8)), "overrun the payload"),
        (_field(1, _header_bytes(_item(size=16))) + _field(3, bytes(8)), "overrun the payload"),
        (_field(1, _header_bytes(_item(size=8))) + _field(3, bytes(9)), "payload holds 9 bytes, its entries 8"),
        (_field(1, _header_bytes(_item(size=4))) + _field(3, bytes(4)), "got 4 of 8 bytes"),
        (_field(1, _header_bytes(_item(shape=(1,), size=8))) + _field(3, bytes(8)), "more bytes than shape"),
        (_field(1, _header_bytes(_item(dtype="complex64"))) + _field(3, bytes(8)), "unsupported dtype"),
        (_field(1, _header_bytes(_item(shape=(1 << 40, 1 << 40)))) + _field(3, bytes(8)), "exceeds the limit"),
        (_field(1, _header_bytes(_item(offset=8, size=0))), "first piece starts at offset 8"),
        (_field(1, _header_bytes(_item(), _item())) + _field(3, bytes(16)), "given twice"),
    ],
    ids=[
        "trailing-garbage", "header-length-overruns", "payload-length-overruns", "endless-varint",
        "truncated-varint", "payload-first",
        "header-twice", "unknown-field", "wrong-wire-type", "garbage-header", "data-in-header", "negative-size",
        "size-overruns", "payload-too-long", "short-of-shape", "more-than-shape", "bad-dtype", "huge-shape",
        "offset-on-first-piece", "entry-twice",
    ],
)  # fmt: skip
def test_malformed_frames_are_refused(frame: bytes, match: str) -> None:
    _refuse(frame, match)


def test_pieces_are_aligned_in_the_payload_and_anything_else_is_refused() -> None:
    # two 4-byte pieces: the second starts at payload offset 8, after 4 bytes of padding
    header = _header_bytes(_item("a", shape=(1,), size=4), _item("b", shape=(1,), size=4))
    ok = _field(1, header) + _field(3, np.float32(1).tobytes() + bytes(4) + np.float32(2).tobytes())
    assert [e.array.item() for e in wire.read_frame(ok, pb.PushRequest)[1]] == [1.0, 2.0]
    _refuse(_field(1, header) + _field(3, np.array([1, 2], np.float32).tobytes()), "overrun the payload")


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=200) | st.builds(lambda cut, noise: _good_frame()[:cut] + noise,
                                                 st.integers(0, 200), st.binary(max_size=8)))  # fmt: skip
def test_random_bytes_are_a_frame_or_a_wire_error(data: bytes) -> None:
    try:
        _, entries = wire.read_frame(data, pb.PushRequest)
    except WireError:
        return
    assert all(isinstance(e.array, np.ndarray) for e in entries)


# -- dense arrays kept in the pieces they arrived in (the PS's streamed pushes) ----------------------------------
def _assembled_from_frames(entries: list[Entry], chunk_bytes: int) -> Assembler:
    assembler = Assembler(keep_dense_pieces=True)
    for frame in wire.frames(entries, pb.PushRequest(step_id=1), chunk_bytes):
        assembler.add_pieces(wire.decode_frame(frame, pb.PushRequest)[1])
    return assembler


def test_a_dense_array_in_aligned_pieces_stays_in_them_without_a_copy() -> None:
    kernel = np.arange(40, dtype=np.float32).reshape(8, 5)
    small = np.arange(3, dtype=np.float64)
    ids, rows = np.array([2, 0, 1], np.int64), np.ones((3, 2), np.float32)
    entries = [Entry("kernel", DENSE, kernel), Entry("small", DENSE, small),
               Entry("emb", IDS, ids), Entry("emb", ROWS, rows)]  # fmt: skip
    whole, split = _assembled_from_frames(entries, chunk_bytes=48).split_entries()
    # kernel: 160 bytes in frames of 48 -> 4 runs of whole float32s; small arrived in one piece; sparse never splits
    assert set(split) == {"kernel"}
    runs = list(split["kernel"].runs())
    assert [start for start, _ in runs] == [0, 12, 24, 36]
    assert all(not run.flags.owndata and not run.flags.writeable for _, run in runs)  # views of the frames
    assert split["kernel"].join().tobytes() == kernel.tobytes() and split["kernel"].join().shape == (8, 5)
    assert split["kernel"].nbytes == kernel.nbytes
    assert [(e.name, e.kind) for e in whole] == [("small", DENSE), ("emb", IDS), ("emb", ROWS)]
    for got, want in zip(whole, entries[1:], strict=True):
        _assert_same(got.array, want.array)


def test_check_run_sees_each_kept_piece_as_it_arrives_and_can_refuse_the_rest() -> None:
    kernel = np.arange(40, dtype=np.float32)
    seen: list[tuple[str, list[float]]] = []

    def check(name: str, run: np.ndarray) -> None:
        seen.append((name, run.tolist()))
        if run[0] >= 24:
            raise WireError(f"{name}: refused")

    assembler = Assembler(keep_dense_pieces=True, check_run=check)
    frames = list(wire.frames([Entry("kernel", DENSE, kernel)], pb.PushRequest(), 48))  # 12 elements a frame
    for frame in frames[:2]:
        assembler.add_pieces(wire.decode_frame(frame, pb.PushRequest)[1])
    assert seen == [("kernel", kernel[:12].tolist()), ("kernel", kernel[12:24].tolist())]  # one call a piece
    with pytest.raises(WireError, match="kernel: refused"):
        assembler.add_pieces(wire.decode_frame(frames[2], pb.PushRequest)[1])


def test_split_arrays_say_whether_their_runs_were_checked() -> None:
    entries = [Entry("kernel", DENSE, np.arange(40, dtype=np.float32))]
    assert not _assembled_from_frames(entries, chunk_bytes=48).split_entries()[1]["kernel"].runs_checked
    checked = Assembler(keep_dense_pieces=True, check_run=lambda name, run: None)
    for frame in wire.frames(entries, pb.PushRequest(), 48):
        checked.add_pieces(wire.decode_frame(frame, pb.PushRequest)[1])
    assert checked.split_entries()[1]["kernel"].runs_checked


def test_pieces_cut_inside_an_element_are_joined_instead() -> None:
    kernel = np.arange(10, dtype=np.float32)  # frames of 7 bytes cut inside elements
    whole, split = _assembled_from_frames([Entry("kernel", DENSE, kernel)], chunk_bytes=7).split_entries()
    assert split == {}
    _assert_same(whole[0].array, kernel)


def test_kept_pieces_are_joined_when_whole_entries_are_asked_for() -> None:
    kernel = np.arange(40, dtype=np.float32)
    (entry,) = _assembled_from_frames([Entry("kernel", DENSE, kernel)], chunk_bytes=16).entries()
    _assert_same(entry.array, kernel)


def test_a_truncated_array_in_kept_pieces_is_refused() -> None:
    assembler = Assembler(keep_dense_pieces=True)
    frames = list(wire.frames([Entry("kernel", DENSE, np.arange(40, dtype=np.float32))], pb.PushRequest(), 16))
    for frame in frames[:-1]:
        assembler.add_pieces(wire.decode_frame(frame, pb.PushRequest)[1])
    with pytest.raises(WireError, match="got 144 of 160 bytes"):
        assembler.split_entries()
