"""YAML text → plain Python data, plus the line of every key and value, by key path.

Why not ``yaml.safe_load``: it forgets where things came from, and the spec's promise is that every error
names its line. So the text is *composed* into a node tree with ``yaml.SafeLoader`` (only safe tags are
ever constructed), and the data is built from that tree here, path by path, recording each key's and each
value's line. The data keeps the types the user wrote; the lines live in a parallel :class:`SourceMap`.

Building the data ourselves is also where hostile input is stopped: duplicate keys, recursive aliases,
alias "bombs" that expand to millions of values, nesting too deep to walk, unknown or malformed tags.
Everything that can go wrong becomes a :class:`~psctl.errors.SpecError`; nothing else escapes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import yaml
from yaml.constructor import SafeConstructor
from yaml.error import Mark
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from psctl.errors import SpecError

#: A key path: mapping keys and list indices from the top of the document, e.g. ("roles", "ps", "port").
KeyPath = tuple[Any, ...]
Scalar = str | int | float | bool | None

#: Limits that keep a hostile or broken file from exhausting memory or the stack.
MAX_VALUES = 100_000
MAX_DEPTH = 64

_TAG = "tag:yaml.org,2002:"
_MERGE_TAG = _TAG + "merge"
#: Scalar tags we construct; their SafeConstructor functions are pure functions of the node.
_SCALAR_TAGS = frozenset(_TAG + t for t in ("null", "bool", "int", "float", "str", "timestamp"))
_SIMPLE_KEY = re.compile(r"[A-Za-z0-9_-]{1,40}")


def dotted(path: KeyPath) -> str:
    """``("roles", "ps", "ports", 1)`` → ``roles.ps.ports[1]``; odd keys are quoted to keep one line."""
    out = ""
    for part in path:
        if isinstance(part, int) and not isinstance(part, bool):
            out += f"[{part}]"
            continue
        text = part if isinstance(part, str) and _SIMPLE_KEY.fullmatch(part) else _short_repr(part)
        out += text if not out else f".{text}"
    return out


def _short_repr(value: object, limit: int = 40) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int too long to print (sys.get_int_max_str_digits)
        return "<a very large number>"
    return text if len(text) <= limit else text[: limit - 4] + "...'"


@dataclass(frozen=True)
class SourceMap:
    """Where each key path came from: the file name to show and the 1-based lines of keys and values.

    A path that is not in the map (a key the user left out) is reported at its nearest ancestor, which is
    where the missing key would go.
    """

    filename: str
    key_lines: Mapping[KeyPath, int] = field(default_factory=dict)
    value_lines: Mapping[KeyPath, int] = field(default_factory=dict)
    #: The paths whose values came from the command line (``--set``), and how each was written there.
    overrides: Mapping[KeyPath, str] = field(default_factory=dict)
    #: Each plain number as written (``0755``, ``1.10``): a key that wants a string (``env``) takes that text.
    numbers: Mapping[KeyPath, str] = field(default_factory=dict)

    def line(self, path: KeyPath, *, key: bool = False) -> int:
        """The line of ``path``'s key (``key=True``) or value, else of its nearest recorded ancestor."""
        for n in range(len(path), -1, -1):
            sub = path[:n]
            try:
                found = (self.key_lines.get(sub) if key else None) or self.value_lines.get(sub)
            except TypeError:  # an unhashable part: cannot be in the map
                found = None
            if found:
                return found
        return 1

    def where(self, path: KeyPath, *, key: bool = False) -> str:
        """Where ``path``'s value was written: ``{file}:{line}``, or ``--set {path}={value}`` for a value set on
        the command line (or inside one set there)."""
        for n in range(len(path), 0, -1):
            written = self.overrides.get(path[:n])
            if written is not None:
                return f"--set {written}"
        if path and path not in self.key_lines:  # a key the file lacks, made by a --set of a path below it
            made = next((text for over, text in self.overrides.items() if over[:len(path)] == path), None)
            if made is not None:
                return f"--set {made}"
        return f"{self.filename}:{self.line(path, key=key)}"

    def set_on_command_line(self, path: KeyPath) -> bool:
        """Whether ``path``'s value came from a ``--set`` (or from inside one)."""
        return self.where(path).startswith("--set ")

    def error(
        self, path: KeyPath, what: str, fix: str, *, key: bool = False, line: int | None = None,
        at: KeyPath | None = None,
    ) -> SpecError:
        """The one-line error the spec promises: ``{file}:{line}: {key.path}: {what}; {fix}``, located at
        ``line``, else where ``at`` (default: ``path``) was written. A value set by ``--set`` gets its fix's
        example in that form: ``write e.g. threads: 1`` reads ``write e.g. --set roles.ps.threads=1``."""
        where = f"{self.filename}:{line}" if line is not None else self.where(path if at is None else at, key=key)
        if where.startswith("--set ") and path and isinstance(path[-1], str):  # (an example, not prose)
            for lead in ("e.g. ", "write "):
                fix = fix.replace(f"{lead}{path[-1]}: ", f"{lead}--set {dotted(path)}=")
        return SpecError(f"{where}: {dotted(path)}: {what}; {fix}" if path else f"{where}: {what}; {fix}")


def load_yaml(text: str, *, filename: str) -> tuple[Any, SourceMap]:
    """Parse ``text``; return its data (None for an empty document) and the lines of every path in it."""
    loader: _LineLoader | None = None
    try:
        loader = _LineLoader(text)  # checks every character up front: may raise ReaderError
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = _one_line(e.problem or e.context or "cannot parse")
        if e.context and e.problem:
            context = _one_line(e.context)
            if not context.startswith("while"):
                problem = f"{context}, {problem}"
            elif e.context_mark is not None and e.context_mark.line + 1 != line:
                problem += f" ({context} that starts on line {e.context_mark.line + 1})"
        raise SpecError(
            f"{filename}:{line}: invalid YAML: {problem}; check the indentation, colons and quotes on this line"
        ) from None
    except yaml.YAMLError as e:  # ReaderError: a character YAML does not allow
        position = getattr(e, "position", 0) or 0
        line = text.count("\n", 0, position) + 1 if isinstance(position, int) else 1
        char = getattr(e, "character", None)
        code = f" (#x{char:04x})" if isinstance(char, int) else ""
        raise SpecError(
            f"{filename}:{line}: invalid YAML: {_one_line(str(getattr(e, 'reason', e)))}{code}; "
            "remove the control character (the spec must be printable UTF-8 text)"
        ) from None
    except RecursionError:
        raise SpecError(f"{filename}:1: invalid YAML: nested too deeply to read; flatten the structure") from None
    finally:
        if loader is not None:
            loader.dispose()
    builder = _Builder(filename)
    data = None if node is None else builder.build(node, (), 0, set())
    return data, SourceMap(filename, builder.key_lines, builder.value_lines, numbers=builder.numbers)


def load_value(text: str, *, shown: str, at: KeyPath) -> tuple[Any, dict[KeyPath, str]]:
    """One value written on the command line (``--set``) for key path ``at``, read as the spec's values are
    (YAML 1.2's numbers), and its numbers as written; raises PyYAML's error for text that is not YAML, and a
    SpecError located at ``shown`` (the --set as written) for what the spec refuses in any file (a tag)."""
    loader = _LineLoader(text)
    try:
        node = loader.get_single_node()
    finally:
        loader.dispose()
    if node is None:
        return None, {}
    builder = _Builder(shown, at=at)
    return builder.build(node, (), 0, set()), builder.numbers


def _yaml_12_number(tag: str, text: str) -> int | float | None:
    """A number in YAML 1.2's forms (``0o17``, ``0x1f``, ``007`` is 7); None for PyYAML's constructor to read
    (``.inf``, an explicitly tagged YAML 1.1 form). Raises ValueError for a tagged scalar that is no number."""
    if tag == _TAG + "int" and _INT.fullmatch(text):
        base = {"0o": 8, "0x": 16}.get(text[:2], 10)
        return int(text[2:] if base != 10 else text, base)
    if tag == _TAG + "float" and _DECIMAL.fullmatch(text):
        return float(text)
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _Alias(Node):
    """An alias (``*name``) where it is written, standing for the anchored node it names."""

    id = "alias"

    def __init__(self, target: Node, start_mark: Mark, end_mark: Mark) -> None:
        super().__init__(target.tag, target.value, start_mark, end_mark)
        self.target = target


def _target(node: Node) -> Node:
    return node.target if isinstance(node, _Alias) else node


#: YAML 1.2's plain numbers (its core schema). PyYAML resolves YAML 1.1's, which read ``1:30:00`` as 5400
#: (base 60), ``0755`` as 493 (octal), ``1_000`` as 1000, and ``1e-3`` (no dot) as a string.
_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_DECIMAL = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_FLOAT = re.compile(rf"{_DECIMAL.pattern}|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")


def _yaml_12_numbers(resolvers: dict[str | None, list[tuple[str, re.Pattern[str]]]]) -> dict[Any, Any]:
    """SafeLoader's implicit resolvers with its int and float ones replaced by YAML 1.2's."""
    kept: dict[Any, list[tuple[str, re.Pattern[str]]]] = {
        first: [(tag, regexp) for tag, regexp in pairs if tag not in (_TAG + "int", _TAG + "float")]
        for first, pairs in resolvers.items()
    }
    for tag, pattern in ((_TAG + "int", _INT), (_TAG + "float", _FLOAT)):
        anchored = re.compile(f"^(?:{pattern.pattern})$")
        for first in "-+0123456789.":
            kept.setdefault(first, []).append((tag, anchored))
    return kept


class _LineLoader(yaml.SafeLoader):
    """SafeLoader whose node tree keeps each alias's own position (the stock composer returns the anchored
    node itself, so a value reached through an alias would be reported at the anchor's line), and whose plain
    numbers are YAML 1.2's."""

    yaml_implicit_resolvers = _yaml_12_numbers(yaml.SafeLoader.yaml_implicit_resolvers)

    def compose_node(self, parent: Node | None, index: object) -> Node:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            return _Alias(super().compose_node(parent, index), event.start_mark, event.end_mark)
        return super().compose_node(parent, index)  # type: ignore[no-any-return]

    def fetch_flow_collection_start(self, token_class: type) -> None:  # type: ignore[override]
        # PyYAML's scanner slows down badly with flow nesting depth: refuse deep nesting before it does.
        if self.flow_level >= MAX_DEPTH:
            raise yaml.scanner.ScannerError(None, None, f"nested more than {MAX_DEPTH} levels deep", self.get_mark())
        super().fetch_flow_collection_start(token_class)  # type: ignore[misc]


class _Builder:
    """Builds data from a node tree, recording lines; stops recursion, bombs and odd tags."""

    def __init__(self, filename: str, *, at: KeyPath | None = None) -> None:
        self.filename = filename
        #: Building a value given on the command line for this key path (its errors name no line).
        self.at = at
        self.key_lines: dict[KeyPath, int] = {}
        self.value_lines: dict[KeyPath, int] = {}
        self.count = 0
        self.numbers: dict[KeyPath, str] = {}
        self._constructor = SafeConstructor()  # only for its scalar constructors

    def fail(self, node: Node, path: KeyPath, what: str, fix: str) -> NoReturn:
        if self.at is not None:
            raise SpecError(f"{self.filename}: {dotted((*self.at, *path))}: {what}; {fix}")
        raise SourceMap(self.filename).error(path, what, fix, line=node.start_mark.line + 1)

    def _tick(self, node: Node, path: KeyPath) -> None:
        self.count += 1
        if self.count > MAX_VALUES:
            self.fail(
                node,
                path,
                f"the spec holds more than {MAX_VALUES} values (aliases expanded)",
                "a cluster spec is small: remove the repeated aliases",
            )

    def build(self, written: Node, path: KeyPath, depth: int, active: set[int]) -> Any:
        self._tick(written, path)
        self.value_lines[path] = written.start_mark.line + 1
        if depth > MAX_DEPTH:
            self.fail(written, path, f"nested more than {MAX_DEPTH} levels deep", "flatten the structure")
        node = _target(written)
        if isinstance(node, ScalarNode):
            return self.scalar(node, path)
        if id(node) in active:
            self.fail(written, path, "an alias refers to a value that contains it", "remove the recursive alias")
        active.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                if node.tag != _TAG + "seq":
                    self.fail(node, path, f"unsupported YAML tag {node.tag!r}", "remove the tag")
                return [self.build(item, (*path, i), depth + 1, active) for i, item in enumerate(node.value)]
            if isinstance(node, MappingNode):
                return self.mapping(node, path, depth, active)
            self.fail(node, path, "unsupported YAML node", "write plain mappings, lists and values")
        finally:
            active.discard(id(node))

    def scalar(self, node: ScalarNode, path: KeyPath, *, is_key: bool = False) -> Scalar:
        if node.tag not in _SCALAR_TAGS:
            self.fail(node, path, f"unsupported YAML tag {node.tag!r}", "remove the tag (plain values only)")
        if node.tag in (_TAG + "int", _TAG + "float") and not node.style and not is_key:
            self.numbers[path] = node.value
        try:
            number = _yaml_12_number(node.tag, node.value)
            if number is not None:
                return number
            construct = self._constructor.yaml_constructors[node.tag]
            return construct(self._constructor, node)  # type: ignore[no-any-return]
        except Exception:  # PyYAML's constructors raise IndexError, KeyError... on odd tagged scalars
            self.fail(node, path, f"cannot read {_short_repr(node.value)} as its YAML type", "quote it or fix it")

    def mapping(self, node: MappingNode, path: KeyPath, depth: int, active: set[int]) -> dict[Any, Any]:
        result: dict[Any, Any] = {}
        explicit, merged = self.pairs(node, path, active)
        tagged = [(k, v, False) for k, v in explicit] + [(k, v, True) for k, v in merged]
        for key_node, value_node, from_merge in tagged:
            key = self.key(key_node, path)
            if key in result:
                if from_merge:  # YAML merge: explicit keys, then earlier merged maps, win
                    continue
                self.fail(key_node, (*path, key), "duplicate key", "remove one of the two")
            sub = (*path, key)
            self.key_lines[sub] = key_node.start_mark.line + 1
            result[key] = self.build(value_node, sub, depth + 1, active)
        return result

    def pairs(
        self, node: MappingNode, path: KeyPath, active: set[int]
    ) -> tuple[list[tuple[Node, Node]], list[tuple[Node, Node]]]:
        """The node's own key/value pairs, and those it merges in with ``<<`` (flattened, in order)."""
        if node.tag != _TAG + "map":
            self.fail(node, path, f"unsupported YAML tag {node.tag!r}", "remove the tag")
        explicit: list[tuple[Node, Node]] = []
        merged: list[tuple[Node, Node]] = []
        for key_node, value_node in node.value:
            self._tick(key_node, path)
            if key_node.tag != _MERGE_TAG:
                explicit.append((key_node, value_node))
                continue
            value_node = _target(value_node)
            sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
            for source in map(_target, sources):
                if not isinstance(source, MappingNode):
                    self.fail(source, path, "`<<` can merge only mappings", "merge an alias of a mapping")
                if id(source) in active or source is node:
                    self.fail(source, path, "`<<` merges a mapping into itself", "remove the recursive merge")
                active.add(id(source))
                try:
                    inner_explicit, inner_merged = self.pairs(source, path, active)
                finally:
                    active.discard(id(source))
                merged.extend(inner_explicit + inner_merged)
        return explicit, merged

    def key(self, written: Node, path: KeyPath) -> Any:
        node = _target(written)
        if not isinstance(node, ScalarNode):
            self.fail(written, path, "a mapping key must be a plain value, not a list or mapping", "use a string key")
        return self.scalar(node, path, is_key=True)
