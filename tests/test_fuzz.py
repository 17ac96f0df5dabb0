"""Fuzzing the two ways in from outside: the YAML spec and the parameter server's wire protocol.

The spec: whatever text ``load_spec_text`` is given — arbitrary characters, random YAML documents, or a valid
spec mutated line by line, character by character, value by value — it returns a ClusterSpec (which
``make_plan`` then plans or refuses with a SpecError) or raises a SpecError with exit code 2 and a one-line
message. Never any other exception, and the command line never prints a traceback.

The PS: random bytes as a serialized request, and PushRequests that are wrong in every way the wire allows
(dtypes, shapes, byte counts, row ids, NaN, kinds, offsets, declared sizes, huge repeated fields) are refused
with a status that says so (never OK, never UNKNOWN, which would mean an unhandled exception), the PS is
bit-for-bit what it was (variables, optimizer slots, counters, applied step ids), and it goes on serving. The
same for the framed rpcs, on a PS registered as the runtime registers it (raw bytes in: random bytes, cut and
mangled frames, and every bad push above as a frame).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from psctl.cli import cli
from psctl.errors import SpecError
from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime import limits, wire
from psctl.runtime.ps import ParameterServerServicer, VariableStore, add_to_server
from psctl.runtime.rpc import make_channel, make_server
from psctl.spec import ClusterSpec, Plan, load_spec_text, make_plan

# =================================================================================================================
# The spec
# =================================================================================================================
LOCAL = """\
name: fuzz
roles:
  chief: {}
  ps:
    replicas: 2
    port: 7100
    restart: {policy: on-failure, max_restarts: 3, backoff_seconds: 1s}
  worker:
    replicas: 2
    env: {OMP_NUM_THREADS: "1"}
    threads: 1
  evaluator: {}
training:
  program: psctl.models.mlp
  args: {hidden_units: 16}
  data: {name: digits}
  batch_size: 50
  optimizer: {name: adam, learning_rate: 0.01}
  mode: async
  steps: 100
  checkpoint: {every_steps: 50, max_to_keep: 2}
supervision:
  heartbeat_interval: 1s
  heartbeat_timeout: 10s
security:
  tls: true
"""
REMOTE = """\
name: fuzz-remote
hosts:
  - name: a
    address: 10.0.0.11
    user: train
  - {name: b, address: b.example.com, port: 2222}
roles:
  chief: {host: a, port: 7000}
  ps: {hosts: [a, b], port: 7100, replicas: 2}
  worker:
    hosts: [a, b]
    ports: [7200, 7201, 7202]
    replicas: 3
training:
  program: psctl.models.mlp
  data: {name: digits}
  mode: sync
  replicas_to_aggregate: 3
  steps: 1000
"""
VALID = (LOCAL, REMOTE)
#: Scalars YAML reads in surprising ways, and tokens with a meaning of their own.
TRICKY = (
    "~", "null", "", "''", '""', "yes", "no", "on", "off", "y", "True", "0", "-1", "007", "0x1F", "0o17", "0b101",
    "1_000", "1e400", "-1e400", ".inf", "-.inf", ".nan", "99999999999999999999999999", "-9223372036854775809",
    "1.5", "1s", "-3s", "1h30m", "2001-12-14", "2001-12-14t21:59:43.10-05:00", "12:30:45", "!!binary aGVsbG8=",
    "!!str 5", "!!int x", "!!float", "!!python/object:os.system", "!!set {a, b}", "!!omap [a: 1]", "*a", "&a x",
    "&a [*a]", "<<: {a: 1}", "[]", "{}", "[1, [2, [3]]]", "{a: {b: {c: d}}}", "- x", "? x", "|", ">-", "%YAML 1.1",
    "---", "...", "'\\x00'", '"\\u0000"', '"\\ud800"', "\t", "#", "a: b: c", "localhost", "127.0.0.1", "::1",
    "ps-0", "chief", "worker", "PSCTL_CLUSTER", "../x.py", "/etc/passwd", "~/x.py", "x" * 300,
)  # fmt: skip
YAML_CHARS = ":{}[],-#&*!|>'\"%@`?\\ \t\n0123456789abcxyz._~"


def yaml_scalar_text(value: object) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()


scalar_values = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
    st.integers(min_value=-(2**70), max_value=2**70),
)  # fmt: skip
scalar_texts = st.one_of(
    st.sampled_from(TRICKY),
    scalar_values.map(yaml_scalar_text),
    st.text(alphabet=YAML_CHARS, max_size=10),
)

#: A text mutation: (kind, position, other position, text); positions are taken modulo the text's size.
Op = tuple[str, int, int, str]
OP_KINDS = ("delete", "duplicate", "swap", "char", "insert", "truncate", "value", "indent", "dedent")
ops = st.lists(
    st.tuples(
        st.sampled_from(OP_KINDS),
        st.integers(0, 10_000),
        st.integers(0, 10_000),
        st.one_of(scalar_texts, st.text(alphabet=YAML_CHARS, min_size=1, max_size=1), st.characters()),
    ),
    min_size=1,
    max_size=4,
)


def mutate(text: str, mutations: list[Op]) -> str:
    """Apply line-level (delete, duplicate, swap, indentation), character-level and value-level mutations."""
    for kind, a, b, payload in mutations:
        lines = text.split("\n")
        i, j = a % len(lines), b % len(lines)
        if kind == "delete":
            del lines[i]
        elif kind == "duplicate":
            lines.insert(i, lines[i])
        elif kind == "swap":
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == "indent":
            lines[i] = "  " + lines[i]
        elif kind == "dedent":
            lines[i] = lines[i][2:] if lines[i].startswith("  ") else lines[i].lstrip()
        elif kind == "value":  # the value after the first ": " (or the whole line's item after "- ")
            line = lines[i]
            for sep in (": ", "- "):
                if sep in line:
                    lines[i] = line[: line.index(sep) + len(sep)] + payload
                    break
            else:
                lines[i] = line + ": " + payload
        else:
            pos = a % (len(text) + 1)
            if kind == "char":
                text = text[:pos] + payload[:1] + text[pos + 1 :]
            elif kind == "insert":
                text = text[:pos] + payload + text[pos:]
            else:  # truncate
                text = text[:pos]
            continue
        text = "\n".join(lines)
    return text


@st.composite
def structural_mutants(draw: st.DrawFn) -> str:
    """A valid spec's data with one value replaced, one key removed or one unknown key added, dumped back."""
    data = yaml.safe_load(draw(st.sampled_from(VALID)))
    paths: list[tuple[Any, ...]] = []

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        paths.append(path)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        elif isinstance(node, list):
            for k, v in enumerate(node):
                walk(v, (*path, k))

    walk(data, ())
    path = draw(st.sampled_from(paths[1:]))
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    action = draw(st.sampled_from(("replace", "delete", "add")))
    if action == "delete":
        del parent[path[-1]]
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=8) | st.integers() | st.booleans())] = draw(yaml_values)
    else:
        parent[path[-1]] = draw(yaml_values)
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


SCHEMA_WORDS = (
    "name", "hosts", "roles", "training", "supervision", "security", "address", "user", "port", "ports", "chief",
    "ps", "worker", "evaluator", "replicas", "host", "restart", "env", "threads", "program", "args", "data",
    "batch_size", "optimizer", "mode", "steps", "checkpoint", "tls", "policy", "heartbeat_interval", "learning_rate",
)  # fmt: skip
yaml_values = st.recursive(
    scalar_values,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.sampled_from(SCHEMA_WORDS) | st.text(max_size=6), children, max_size=4),
    ),
    max_leaves=8,
)
random_documents = st.dictionaries(st.sampled_from(SCHEMA_WORDS), yaml_values, max_size=6).map(
    lambda d: yaml.safe_dump(d, sort_keys=False, allow_unicode=True)
) | yaml_values.map(lambda v: yaml.safe_dump(v, allow_unicode=True))


def assert_one_line(error: SpecError) -> None:
    message = error.format_message()
    assert error.exit_code == 2
    assert message and message.splitlines() == [message], repr(message)
    assert message.startswith("<fuzz>:"), message  # names where the mistake is


#: Explicitly tagged scalars PyYAML cannot construct, e.g. ``name: !!float`` (empty), ``!!bool maybe``,
#: ``!!timestamp x``: its constructors raise IndexError, KeyError or AttributeError, which the loader must turn
#: into a SpecError (see test_tagged_scalars_yaml_cannot_read_are_spec_errors).
TAGGED_SCALARS = ("!!float", "!!int", "!!int _", "!!int +", "!!bool", "!!bool maybe", "!!timestamp", "!!timestamp x")


def check_spec(text: str) -> str:
    """The promise: a ClusterSpec (then a Plan or a SpecError) or a SpecError; anything else escapes and fails."""
    try:
        spec = load_spec_text(text, filename="<fuzz>")
    except SpecError as error:
        assert_one_line(error)
        return "refused"
    assert isinstance(spec, ClusterSpec)
    try:
        plan = make_plan(spec, check_ports=False)
    except SpecError as error:
        assert_one_line(error)
        return "plan refused"
    assert isinstance(plan, Plan) and plan.instances
    return "planned"


SPEC_SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_the_valid_specs_are_valid() -> None:
    for text in VALID:
        assert check_spec(text) == "planned"


@SPEC_SETTINGS
@given(text=st.text(max_size=300) | st.text(alphabet=YAML_CHARS, max_size=300))
def test_arbitrary_text_is_a_spec_or_a_spec_error(text: str) -> None:
    check_spec(text)


@SPEC_SETTINGS
@given(text=random_documents)
def test_random_yaml_documents_are_a_spec_or_a_spec_error(text: str) -> None:
    check_spec(text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(VALID), mutations=ops)
def test_a_mutated_valid_spec_is_a_spec_or_a_spec_error(base: str, mutations: list[Op]) -> None:
    check_spec(mutate(base, mutations))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=structural_mutants())
def test_a_structurally_mutated_spec_is_a_spec_or_a_spec_error(text: str) -> None:
    check_spec(text)


@pytest.mark.parametrize("tagged", TAGGED_SCALARS)
def test_tagged_scalars_yaml_cannot_read_are_spec_errors(tagged: str) -> None:
    for text in (f"name: {tagged}\n", LOCAL.replace("steps: 100", f"steps: {tagged}")):
        with pytest.raises(SpecError) as info:
            load_spec_text(text, filename="<fuzz>")
        assert_one_line(info.value)


HOSTILE = (
    "a: &a [*a]\n",  # a recursive alias
    "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
    "e: [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n",  # an alias bomb
    "[" * 200 + "]" * 200,  # nesting too deep (PyYAML's scanner is quadratic in the depth: kept small)
    "name: !!python/object/apply:os.system [echo pwned]\n",
    LOCAL.replace("tls: true", "tls: true\n  tls: false"),  # a duplicate key
)


def test_the_command_line_never_prints_a_traceback_for_a_fuzzed_spec(tmp_path: Path) -> None:
    rng = random.Random(20240601)
    texts = [*HOSTILE, LOCAL]
    tokens = [*TRICKY, *YAML_CHARS]
    for _ in range(8):
        mutations = [
            (rng.choice(OP_KINDS), rng.randrange(10_000), rng.randrange(10_000), rng.choice(tokens))
            for _ in range(rng.randint(1, 3))
        ]
        texts.append(mutate(rng.choice(VALID), mutations))
    files = []
    for i, text in enumerate(texts):
        path = tmp_path / f"fuzz-{i}.yaml"
        path.write_text(text, encoding="utf-8")
        files.append(path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(bytes(rng.randrange(256) for _ in range(300)) + b"\xff\xfe")
    files.append(binary)
    outcomes = set()
    runner = CliRunner()
    for path in files:
        result = runner.invoke(cli, ["validate", str(path)])
        output = result.stdout + result.stderr
        assert "Traceback" not in output, (path.read_bytes()[:200], output)
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        assert result.exit_code in (0, 2), (result.exit_code, output)
        if result.exit_code == 2:
            (line,) = result.stderr.strip().splitlines()
            assert line.startswith(f"error: {path}"), line
            assert result.stdout == ""
        outcomes.add(result.exit_code)
    assert outcomes == {0, 2}, "the fuzzed files should include valid and invalid specs"


@pytest.mark.parametrize("key", ["[/]", "[bold]x", "[/red]"])
def test_a_spec_error_shows_what_the_user_wrote_verbatim(tmp_path: Path, key: str) -> None:
    """Spec text that looks like rich markup is printed as written (it once crashed the CLI with MarkupError)."""
    path = tmp_path / "markup.yaml"
    path.write_text(LOCAL.replace("  evaluator: {}\n", f"  evaluator: {{}}\n  '{key}': 1\n"), encoding="utf-8")
    result = CliRunner().invoke(cli, ["validate", str(path)])
    output = result.stdout + result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output
    assert result.exit_code == 2, (result.exit_code, output, result.exception)
    (line,) = result.stderr.strip().splitlines()
    assert f"roles.'{key}': unknown key" in line, line


# =================================================================================================================
# The parameter server's wire protocol
# =================================================================================================================
SPECS = [
    pb.VariableSpec(name="w", dtype="float32", shape=[4, 3], full_shape=[4, 3], initializer="glorot_uniform", seed=1),
    pb.VariableSpec(name="emb", dtype="float32", shape=[10, 2], full_shape=[10, 2], initializer="normal", seed=2),
    pb.VariableSpec(name="b", dtype="float64", shape=[3], full_shape=[3], initializer="ones", seed=3),
    pb.VariableSpec(name="s", dtype="float32", shape=[], full_shape=[], initializer="ones", seed=4),
    pb.VariableSpec(name="h", dtype="float16", shape=[5], full_shape=[5], initializer="ones", seed=5),
]
SHAPES = {s.name: tuple(s.shape) for s in SPECS}
DTYPES = {s.name: s.dtype for s in SPECS}
WORKER = ("worker:0", 5)  # the task and incarnation of the one push applied before fuzzing
EMPTY = np.zeros(0, dtype=np.float32)  # a DENSE entry of a pull names a whole shard (as PsClient sends it)


def tensor(name: str, kind: int, array: np.ndarray) -> pb.NamedTensor:
    item = pb.NamedTensor(name=name, kind=kind)
    wire.to_tensor(array, item.tensor)
    return item


def raw_tensor(name: str, kind: int, dtype: str, shape: list[int], data: bytes, offset: int = 0) -> pb.NamedTensor:
    item = pb.NamedTensor(name=name, kind=kind)
    item.tensor.dtype = dtype
    item.tensor.shape[:] = shape
    item.tensor.data = data
    item.tensor.offset = offset
    return item


def good_entry(name: str = "w") -> pb.NamedTensor:
    return tensor(name, wire.DENSE, np.full(SHAPES[name], 0.25, dtype=DTYPES[name]))


@dataclass
class Ps:
    address: str
    store: VariableStore
    channel: grpc.Channel
    stub: pb_grpc.ParameterServerStub
    step_ids: Iterator[int]

    def raw(self, method: str) -> Callable[..., bytes]:
        return self.channel.unary_unary(  # type: ignore[no-any-return]
            f"/psctl.ParameterServer/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )

    def push_request(self, *entries: pb.NamedTensor, **fields: Any) -> pb.PushRequest:
        """A push whose header is valid (a fresh step id, the worker's current incarnation)."""
        header: dict[str, Any] = dict(step_id=next(self.step_ids), task=WORKER[0], incarnation=WORKER[1])
        header.update(fields)
        return pb.PushRequest(entries=list(entries), **header)

    def snapshot(self) -> tuple[Any, ...]:
        """Every variable and slot, pulled by a valid client (so the PS still serves), plus its counters."""
        request = pb.PullRequest(include_slots=True)
        wire.add_entries(request.entries, (wire.Entry(s.name, wire.DENSE, EMPTY) for s in SPECS))
        pulled = self.stub.Pull(request, timeout=30)
        state = self.stub.GetState(pb.StateRequest(include_step_ids=True), timeout=30)
        arrays = tuple((e.name, e.kind, e.tensor.dtype, tuple(e.tensor.shape), e.tensor.data) for e in pulled.entries)
        return arrays, state.SerializeToString()

    def refused(self, send: Callable[[], Any], *codes: grpc.StatusCode) -> grpc.StatusCode:
        """``send`` fails with a meaningful status (one of ``codes`` if given) and changes nothing."""
        before = self.snapshot()
        with pytest.raises(grpc.RpcError) as info:
            send()
        code = info.value.code()  # type: ignore[attr-defined]
        details = info.value.details()  # type: ignore[attr-defined]
        assert code != grpc.StatusCode.UNKNOWN, f"unhandled exception in the PS: {details}"
        assert code != grpc.StatusCode.OK
        if codes:
            assert code in codes, (code, details)
        assert self.snapshot() == before, f"a refused request ({code}: {details}) changed the PS"
        return code  # type: ignore[no-any-return]


def start_ps(optimizer: str, cluster_id: str, *, framed: bool = False) -> tuple[grpc.Server, Ps]:
    """A PS with the generated registration (plain rpcs under test), or (``framed``) psctl's own."""
    store = VariableStore(cluster_id=cluster_id)
    server, port = make_server("127.0.0.1:0", max_workers=4)
    register = add_to_server if framed else pb_grpc.add_ParameterServerServicer_to_server
    register(ParameterServerServicer(store), server)
    server.start()
    address = f"127.0.0.1:{port}"
    channel = make_channel(address)
    ps = Ps(address, store, channel, pb_grpc.ParameterServerStub(channel), iter(range(1000, 10**9)))
    ps.stub.Init(
        pb.InitRequest(variables=SPECS, optimizer=pb.OptimizerConfig(name=optimizer, learning_rate=0.1),
                       cluster_id=cluster_id),
        timeout=30,
    )  # fmt: skip
    return server, ps


def serve_fuzz_ps(*, framed: bool) -> Iterator[Ps]:
    server, handle = start_ps("adam", "fuzz", framed=framed)
    try:
        # One real update first, so counters, step ids, slots and the worker's incarnation are not all zero.
        ids = tensor("emb", wire.IDS, np.array([1, 7], dtype=np.int64))
        rows = tensor("emb", wire.ROWS, np.ones((2, 2), dtype=np.float32))
        reply = handle.stub.Push(
            handle.push_request(good_entry("w"), ids, rows, step_id=1, increment_global_step=True, shard=0,
                                position=3),
            timeout=30,
        )  # fmt: skip
        assert reply.applied and reply.global_step == 1
        yield handle
    finally:
        handle.channel.close()
        server.stop(grace=None).wait(timeout=10)


@pytest.fixture(scope="module")
def ps() -> Iterator[Ps]:
    yield from serve_fuzz_ps(framed=False)


# -- random bytes --------------------------------------------------------------------------------------------------
def _valid_push() -> pb.PushRequest:
    """A push the PS would accept, but for its step id 0."""
    return pb.PushRequest(step_id=0, task="worker:0", incarnation=5, entries=[good_entry("w"), good_entry("b")])


def _valid_push_bytes() -> bytes:
    return _valid_push().SerializeToString()  # type: ignore[no-any-return]


@st.composite
def mangled(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` (a serialized message or frame), then bytes flipped, cut, inserted or repeated."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(("flip", "cut", "insert", "repeat")))
        if action == "flip" and pos < len(data):
            data[pos] ^= draw(st.integers(1, 255))
        elif action == "cut":
            del data[pos:]
        elif action == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif action == "repeat":
            data += data[pos:]
    return bytes(data)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.binary(max_size=300) | mangled(_valid_push_bytes()))
def test_random_bytes_as_a_push_are_refused(ps: Ps, payload: bytes) -> None:
    # Protobuf reads many byte strings as *some* message. Ending with step_id = 0 (the last value of a field
    # wins) makes any push they happen to spell invalid, so every request here must be refused.
    payload += b"\x08\x00"
    try:
        parsed: pb.PushRequest | None = pb.PushRequest.FromString(payload)
    except DecodeError:
        parsed = None
    assume(parsed is None or parsed.step_id == 0)
    code = ps.refused(lambda: ps.raw("Push")(payload, timeout=30))
    if parsed is None:  # not a PushRequest at all: gRPC's own decoding refuses it
        assert code == grpc.StatusCode.INTERNAL
    else:
        assert code == grpc.StatusCode.INVALID_ARGUMENT


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.binary(max_size=300))
def test_random_bytes_to_every_other_rpc_never_crash_the_ps(ps: Ps, payload: bytes) -> None:
    before = ps.snapshot()
    for method in ("Pull", "GetState", "Init", "Assign"):
        try:
            ps.raw(method)(payload, timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() != grpc.StatusCode.UNKNOWN, (method, exc.details())  # type: ignore[attr-defined]
        else:
            # Accepted only where reading is all it does, or an Init of exactly the same variables (a no-op).
            assert method in ("Pull", "GetState", "Init"), method
    assert ps.snapshot() == before


# -- malformed pushes ----------------------------------------------------------------------------------------------
NAMES = st.sampled_from(sorted(SHAPES))
BAD_DTYPES = st.sampled_from(
    ["", "float128", "complex64", "object", "str", "<f4", ">f4", "f4", "float", "int", "U8", "V4", "datetime64",
     "float32 ", "FLOAT32", "bfloat16", "O", "void", "bool_"]
) | st.text(max_size=12).filter(lambda s: s not in wire.DTYPES)  # fmt: skip
NON_FINITE = st.sampled_from([np.nan, np.inf, -np.inf])


@st.composite
def bad_entries(draw: st.DrawFn) -> list[pb.NamedTensor]:
    """One push's entries, wrong in one drawn way (and possibly alongside valid ones)."""
    name = draw(NAMES)
    shape, dtype = SHAPES[name], DTYPES[name]
    size = int(np.prod(shape, dtype=np.int64))
    itemsize = np.dtype(dtype).itemsize
    how = draw(st.sampled_from([
        "dtype", "bytes", "shape", "non-finite", "ids-range", "ids-dtype", "ids-rank", "rows-shape",
        "rows-non-finite", "ids-without-rows", "rows-without-ids", "declared-size", "rank", "negative-dim",
        "kind", "offset", "unknown-name", "wrong-dtype", "twice", "ids-on-scalar",
    ]))  # fmt: skip
    good = np.full(shape, 0.5, dtype=dtype)
    if how == "dtype":
        entries = [raw_tensor(name, wire.DENSE, draw(BAD_DTYPES), list(shape), good.tobytes())]
    elif how == "bytes":
        n = draw(st.integers(0, 4 * size * itemsize + 8).filter(lambda n: n != size * itemsize))
        entries = [raw_tensor(name, wire.DENSE, dtype, list(shape), bytes(n))]
    elif how == "shape":
        other = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
        assume(other != shape)
        entries = [tensor(name, wire.DENSE, np.zeros(other, dtype=dtype))]
    elif how == "non-finite":
        bad = good.copy().reshape(-1)
        bad[draw(st.integers(0, max(size - 1, 0)))] = draw(NON_FINITE)
        entries = [tensor(name, wire.DENSE, bad.reshape(shape))]
    elif how.startswith(("ids", "rows")) and how != "ids-on-scalar":
        rows = SHAPES["emb"][0]
        ids = np.array(draw(st.lists(st.integers(0, rows - 1), min_size=1, max_size=6)), dtype=np.int64)
        values = np.full((len(ids), 2), 0.5, dtype=np.float32)
        if how == "ids-range":
            bad_id = draw(st.integers(rows, 2**63 - 1) | st.integers(-(2**63), -1))
            ids[draw(st.integers(0, len(ids) - 1))] = bad_id
        elif how == "ids-dtype":
            ids = ids.astype(draw(st.sampled_from(["float32", "float64", "bool", "float16"])))
        elif how == "ids-rank":
            ids = ids.reshape(1, -1)
        elif how == "rows-shape":
            values = np.full(draw(st.sampled_from([(len(ids) + 1, 2), (len(ids), 3), (len(ids),), ()])), 0.5,
                             dtype=np.float32)  # fmt: skip
        elif how == "rows-non-finite":
            values[draw(st.integers(0, len(ids) - 1)), draw(st.integers(0, 1))] = draw(NON_FINITE)
        entries = [tensor("emb", wire.IDS, ids), tensor("emb", wire.ROWS, values)]
        if how == "ids-without-rows":
            entries = entries[:1]
        elif how == "rows-without-ids":
            entries = entries[1:]
    elif how == "ids-on-scalar":
        entries = [tensor("s", wire.IDS, np.array([0], dtype=np.int64)),
                   tensor("s", wire.ROWS, np.zeros((1,), dtype=np.float32))]  # fmt: skip
    elif how == "declared-size":  # a declared size far past the limit, with next to no bytes
        dims = draw(st.lists(st.integers(2**16, 2**62), min_size=2, max_size=4))
        entries = [raw_tensor(name, wire.DENSE, dtype, [*dims, draw(st.integers(0, 3))], b"")]
    elif how == "rank":
        entries = [raw_tensor(name, wire.DENSE, dtype, [1] * draw(st.integers(wire.MAX_RANK + 1, 64)), bytes(itemsize))]
    elif how == "negative-dim":
        dims = list(shape) or [1]
        dims[draw(st.integers(0, len(dims) - 1))] = draw(st.integers(-(2**63), -1))
        entries = [raw_tensor(name, wire.DENSE, dtype, dims, good.tobytes())]
    elif how == "kind":
        entries = [tensor(name, draw(st.sampled_from([wire.SLOT, 4, 7, 1000, -1])), good)]
    elif how == "offset":
        entries = [raw_tensor(name, wire.DENSE, dtype, list(shape), good.tobytes(),
                              offset=draw(st.integers(1, 2**62) | st.integers(-(2**63), -1)))]  # fmt: skip
    elif how == "unknown-name":
        other = draw(st.text(max_size=16).filter(lambda s: s not in SHAPES))
        entries = [tensor(other, wire.DENSE, good)]
    elif how == "wrong-dtype":
        other = draw(st.sampled_from(sorted(wire.DTYPES - {dtype})))
        entries = [tensor(name, wire.DENSE, good.astype(other))]
    elif how == "twice":
        entries = [tensor(name, wire.DENSE, good), tensor(name, wire.DENSE, good)]
    else:  # pragma: no cover
        raise AssertionError(how)
    # All or nothing: a valid gradient for another variable in the same push must not be applied either.
    if draw(st.booleans()):
        others = [n for n in SHAPES if n not in {e.name for e in entries} and n != "s"]
        entries.insert(draw(st.integers(0, len(entries))), good_entry(draw(st.sampled_from(others))))
    return entries


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=bad_entries(), stream=st.booleans())
def test_malformed_pushes_are_refused_and_change_nothing(ps: Ps, entries: list[pb.NamedTensor], stream: bool) -> None:
    request = ps.push_request(*entries, increment_global_step=True)
    if stream:  # the same request through the chunked rpc, in one chunk
        ps.refused(lambda: ps.stub.PushStream(iter([pb.PushChunk(part=request)]), timeout=30),
                   grpc.StatusCode.INVALID_ARGUMENT)  # fmt: skip
    else:
        ps.refused(lambda: ps.stub.Push(request, timeout=30), grpc.StatusCode.INVALID_ARGUMENT)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.tuples(st.integers(-8, 64), st.integers(0, 64)), min_size=1, max_size=5))
def test_streamed_pieces_that_do_not_tile_the_array_are_refused(ps: Ps, pieces: list[tuple[int, int]]) -> None:
    """Pieces of "w" (48 bytes of zeros) at drawn offsets and lengths: only an exact in-order tiling is valid."""
    starts = list(itertools.accumulate((length for _, length in pieces), initial=0))
    assume(not ([offset for offset, _ in pieces] == starts[:-1] and starts[-1] == 48))
    chunks = [
        pb.PushChunk(part=pb.PushRequest(entries=[raw_tensor("w", wire.DENSE, "float32", [4, 3], bytes(n), offset)]))
        for offset, n in pieces
    ]
    chunks[0].part.CopyFrom(ps.push_request(*chunks[0].part.entries))  # the header travels in the first chunk
    ps.refused(lambda: ps.stub.PushStream(iter(chunks), timeout=30), grpc.StatusCode.INVALID_ARGUMENT)


def test_a_push_with_step_id_zero_or_no_chunks_is_refused(ps: Ps) -> None:
    ps.refused(lambda: ps.stub.Push(ps.push_request(good_entry(), step_id=0), timeout=30),
               grpc.StatusCode.INVALID_ARGUMENT)  # fmt: skip
    ps.refused(lambda: ps.stub.PushStream(iter([]), timeout=30), grpc.StatusCode.INVALID_ARGUMENT)


@pytest.mark.parametrize(
    "what",
    ["many-duplicate-entries", "many-unknown-entries", "huge-shape-field", "many-ids-one-out-of-range",
     "many-nan-free-rows-one-nan"],
)  # fmt: skip
def test_huge_repeated_fields_are_refused(ps: Ps, what: str) -> None:
    if what == "many-duplicate-entries":
        entries = [good_entry("w")] * 10_000
    elif what == "many-unknown-entries":
        entry = tensor("v", wire.DENSE, np.zeros(1, np.float32))
        entries = [good_entry("w")] + [pb.NamedTensor(name=f"v{i}", tensor=entry.tensor) for i in range(5_000)]
    elif what == "huge-shape-field":
        entries = [raw_tensor("w", wire.DENSE, "float32", [1] * 1_000_000, bytes(4))]
    else:
        # As many rows as fit in half of a message (8 bytes of id and 8 of row values each).
        ids = np.tile(np.arange(10, dtype=np.int64), limits.MAX_MESSAGE_BYTES // 2 // 16 // 10)
        values = np.full((len(ids), 2), 0.5, dtype=np.float32)
        if what == "many-ids-one-out-of-range":
            ids[-1] = 10
        else:
            values[-1, -1] = np.nan
        entries = [tensor("emb", wire.IDS, ids), tensor("emb", wire.ROWS, values)]
    request = ps.push_request(*entries)
    assert request.ByteSize() < limits.MAX_MESSAGE_BYTES  # refused by the PS itself, not by gRPC's size limit
    ps.refused(lambda: ps.stub.Push(request, timeout=60), grpc.StatusCode.INVALID_ARGUMENT)


def test_an_oversized_message_is_refused_by_size(ps: Ps) -> None:
    # A client without psctl's send limit; the PS's receive limit must stop the message.
    with grpc.insecure_channel(ps.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        push = channel.unary_unary(
            "/psctl.ParameterServer/Push", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        n = limits.MAX_MESSAGE_BYTES + 1
        request = ps.push_request(raw_tensor("w", wire.DENSE, "uint8", [n], bytes(n))).SerializeToString()
        assert len(request) > limits.MAX_MESSAGE_BYTES
        ps.refused(lambda: push(request, timeout=60), grpc.StatusCode.RESOURCE_EXHAUSTED)
        # ... and the PS goes on answering the same client.
        assert ps.stub.GetState(pb.StateRequest(), timeout=30).initialized


def test_refused_requests_leave_a_ps_that_still_applies_valid_pushes(ps: Ps) -> None:
    # This one changes the shared PS; every other check here compares the PS before and after one request of its
    # own, so none depends on the order the tests run in.
    before = ps.store.applied_updates
    reply = ps.stub.Push(ps.push_request(good_entry("w"), increment_global_step=True), timeout=30)
    assert reply.applied and ps.store.applied_updates == before + 1


# -- malformed pulls and assigns -----------------------------------------------------------------------------------
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=bad_entries())
def test_malformed_pulls_are_refused_or_answered_never_crash(ps: Ps, entries: list[pb.NamedTensor]) -> None:
    request = pb.PullRequest(entries=entries)
    before = ps.snapshot()
    try:
        ps.stub.Pull(request, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())  # type: ignore[attr-defined]
    assert ps.snapshot() == before


@pytest.fixture
def sgd_ps() -> Iterator[Ps]:
    server, handle = start_ps("sgd", "fuzz-sgd")
    try:
        yield handle
    finally:
        handle.channel.close()
        server.stop(grace=None).wait(timeout=10)


def test_incomplete_or_malformed_assigns_are_refused(ps: Ps) -> None:
    whole = [good_entry(s.name) for s in SPECS]
    cases = [
        whole[:-1],  # a variable missing
        whole,  # Adam's slots missing
        [*whole[:-1], tensor("h", wire.DENSE, np.full(5, np.nan, dtype=np.float16))],
        [*whole, tensor("w#nope", wire.SLOT, np.zeros((4, 3), np.float32))],
        [*whole, tensor("w", wire.IDS, np.array([0], np.int64))],
    ]
    for entries in cases:
        request = pb.AssignRequest(entries=entries, global_step=12345)
        ps.refused(lambda request=request: ps.stub.Assign(request, timeout=30), grpc.StatusCode.INVALID_ARGUMENT)


def test_a_complete_assign_to_a_ps_without_optimizer_slots_is_applied(sgd_ps: Ps) -> None:
    values = {s.name: np.full(tuple(s.shape), 3.0, dtype=s.dtype) for s in SPECS}
    request = pb.AssignRequest(entries=[tensor(n, wire.DENSE, v) for n, v in values.items()], global_step=42)
    before = sgd_ps.snapshot()
    try:
        sgd_ps.stub.Assign(request, timeout=30)
    except grpc.RpcError as exc:
        assert sgd_ps.snapshot() == before, "a failed assign must leave the PS as it was (all or nothing)"
        raise AssertionError(f"assign failed: {exc.code()}: {exc.details()}") from None  # type: ignore[attr-defined]
    assert sgd_ps.store.global_step == 42
    request = pb.PullRequest()
    wire.add_entries(request.entries, (wire.Entry(n, wire.DENSE, EMPTY) for n in values))
    pulled = sgd_ps.stub.Pull(request, timeout=30)
    assert {e.name: e.tensor.data for e in pulled.entries} == {n: v.tobytes() for n, v in values.items()}


@pytest.fixture
def sync_ps() -> Iterator[Ps]:
    store = VariableStore(cluster_id="fuzz-sync")
    server, port = make_server("127.0.0.1:0", max_workers=4)
    pb_grpc.add_ParameterServerServicer_to_server(ParameterServerServicer(store), server)
    server.start()
    channel = make_channel(f"127.0.0.1:{port}")
    handle = Ps(f"127.0.0.1:{port}", store, channel, pb_grpc.ParameterServerStub(channel), iter(range(1000, 10**9)))
    try:
        handle.stub.Init(
            pb.InitRequest(variables=SPECS, optimizer=pb.OptimizerConfig(name="sgd", learning_rate=0.1),
                           cluster_id="fuzz-sync", replicas_to_aggregate=2),
            timeout=30,
        )  # fmt: skip
        yield handle
    finally:
        channel.close()
        server.stop(grace=None).wait(timeout=10)


def test_a_refused_synchronous_push_does_not_fence_anyone(sync_ps: Ps) -> None:
    bogus = sync_ps.push_request(good_entry("w"), incarnation=10**12, local_step=99)
    sync_ps.refused(lambda: sync_ps.stub.Push(bogus, timeout=30), grpc.StatusCode.INVALID_ARGUMENT)
    # The refused push must not have changed anything, the fencing table included: the worker's own push works.
    reply = sync_ps.stub.Push(sync_ps.push_request(good_entry("w"), local_step=0), timeout=30)
    assert reply.applied


# -- framed rpcs ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fps() -> Iterator[Ps]:
    """The same PS and history as ``ps``, registered with add_to_server: the framed rpcs read raw bytes."""
    yield from serve_fuzz_ps(framed=True)


def as_frame(request: Any, frame_type: Any = pb.PushRequestFrame) -> bytes:
    """A plain request as a frame: every tensor's bytes moved to the payload (8-byte aligned), as psctl lays it out."""
    header = type(request)()
    header.CopyFrom(request)
    payload = bytearray()
    for item in header.entries:
        data, item.tensor.data = item.tensor.data, b""
        item.tensor.size = len(data)
        payload += bytes(-len(payload) % wire.FRAME_ALIGN) + data
    return frame_type(header=header, payload=bytes(payload)).SerializeToString()  # type: ignore[no-any-return]


def _valid_push_frame() -> bytes:
    return as_frame(_valid_push())


def _could_apply(frame: bytes) -> bool:
    """Whether ``frame`` reads as a push with a step id (random bytes rarely do; those may rightly be applied)."""
    try:
        header, _ = wire.decode_frame(frame, pb.PushRequest)
    except wire.WireError:
        return False
    return header.step_id != 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.binary(max_size=300) | mangled(_valid_push_frame()))
def test_random_bytes_as_a_framed_push_are_refused(fps: Ps, payload: bytes) -> None:
    assume(not _could_apply(payload))
    fps.refused(lambda: fps.raw("PushFramed")(payload, timeout=30), grpc.StatusCode.INVALID_ARGUMENT)
    push_stream = fps.channel.stream_unary(f"/{wire.PS_SERVICE}/PushFramedStream")
    fps.refused(lambda: push_stream(iter([payload]), timeout=30), grpc.StatusCode.INVALID_ARGUMENT)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(st.binary(max_size=200) | mangled(_valid_push_frame()), min_size=1, max_size=3))
def test_random_bytes_to_the_other_framed_rpcs_never_crash_the_ps(fps: Ps, frames: list[bytes]) -> None:
    before = fps.snapshot()
    path = f"/{wire.PS_SERVICE}/"
    calls = {
        "PullFramed": lambda: fps.raw("PullFramed")(frames[0], timeout=30),
        "PullFramedStream": lambda: list(fps.channel.unary_stream(path + "PullFramedStream")(frames[0], timeout=30)),
        "AssignFramedStream": lambda: fps.channel.stream_unary(path + "AssignFramedStream")(iter(frames), timeout=30),
    }
    for method, call in calls.items():
        try:
            call()
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, exc.details())  # type: ignore[attr-defined]
        else:
            assert method.startswith("Pull"), method  # reading is all a pull does
    assert fps.snapshot() == before


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=bad_entries(), stream=st.booleans())
def test_malformed_framed_pushes_are_refused_and_change_nothing(
    fps: Ps, entries: list[pb.NamedTensor], stream: bool
) -> None:
    frame = as_frame(fps.push_request(*entries, increment_global_step=True))
    if stream:
        push_stream = fps.channel.stream_unary(f"/{wire.PS_SERVICE}/PushFramedStream")
        fps.refused(lambda: push_stream(iter([frame]), timeout=30), grpc.StatusCode.INVALID_ARGUMENT)
    else:
        fps.refused(lambda: fps.raw("PushFramed")(frame, timeout=30), grpc.StatusCode.INVALID_ARGUMENT)


def test_a_valid_framed_push_from_a_plain_protobuf_client_is_applied(fps: Ps) -> None:
    before = fps.store.applied_updates
    reply = pb.PushResponseFrame.FromString(
        fps.raw("PushFramed")(as_frame(fps.push_request(good_entry("w"), good_entry("h"))), timeout=30)
    )
    assert reply.header.applied and fps.store.applied_updates == before + 1
