"""``--set KEY.PATH=VALUE``: a spec's values changed from the command line, without editing the file.

``psctl up exp.yaml --set training.optimizer.learning_rate=0.003 --set name=lr-003`` runs the spec with those
two values replaced (a sweep of one file). The key path is the one spec errors print (``roles.ps.ports[1]``);
the value is YAML (``2000`` is a number, ``[a, b]`` a list, ``{name: adam}`` a mapping, ``null`` removes the
key's value). Mappings on the way that the spec leaves out are created. The overridden spec is validated as
the file is, and an error in a value that came from ``--set`` names that ``--set`` instead of a line of the
file. A cluster remembers its overrides: a supervisor started again reads the spec with them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from psctl.errors import SpecError
from psctl.spec.loader import KeyPath, dotted, load_value

#: One part of a key path: a key (``training``, ``learning_rate``) or a list index (``[1]``).
_PART = re.compile(r"(?P<key>[A-Za-z0-9_-]+)|\[(?P<index>\d+)\]")
_EXAMPLE = "write KEY.PATH=VALUE, e.g. --set training.steps=2000"


@dataclass(frozen=True)
class Override:
    path: KeyPath
    value: Any
    #: As the user wrote it (errors quote it).
    text: str
    #: The value's plain numbers as written, by key path below ``path`` (see SourceMap.numbers).
    numbers: Mapping[KeyPath, str] = field(default_factory=dict)


def parse_override(text: str) -> Override:
    """``training.steps=2000`` as a key path and its YAML value."""
    key, equals, value = text.partition("=")
    if not equals:
        raise SpecError(f"--set {text}: no '=' between the key path and the value; {_EXAMPLE}")
    path = _key_path(key.strip(), text)
    try:
        parsed, numbers = load_value(value, shown=f"--set {text}", at=path) if value.strip() else (None, {})
    except yaml.YAMLError as e:
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise SpecError(f"--set {text}: the value is not valid YAML ({problem}); quote a string that YAML would "
                        f"read otherwise, e.g. --set name='\"my: run\"'") from None
    return Override(path, parsed, text, numbers)


def _key_path(key: str, text: str) -> KeyPath:
    parts: list[str | int] = []
    at = 0
    while at < len(key):
        if parts and not key.startswith("[", at):
            if not key.startswith(".", at):
                break
            at += 1
        match = _PART.match(key, at)
        if match is None or (not parts and match.group("index") is not None):
            break
        parts.append(match.group("key") if match.group("index") is None else int(match.group("index")))
        at = match.end()
    if not parts or at != len(key):
        raise SpecError(f"--set {text}: {key!r} is not a key path (keys joined by dots, list items as [1]); "
                        f"{_EXAMPLE}")
    return tuple(parts)


def apply_overrides(data: Any, overrides: Sequence[Override], *, filename: str) -> Any:
    """``data`` (a loaded spec) with every override applied in order; an override whose path runs through a
    value that is neither a mapping nor a list long enough is refused, naming it."""
    if not overrides:
        return data
    root = data if data is not None else {}
    if not isinstance(root, dict):
        raise SpecError(f"{filename}: the spec is not a mapping of keys, so --set cannot change it; write the "
                        f"spec as key: value lines")
    made_by: dict[KeyPath, str] = {}  # the paths earlier overrides set: what an error says made them
    for override in overrides:
        node: Any = root
        for depth, part in enumerate(override.path):
            last = depth == len(override.path) - 1
            where = dotted(override.path[:depth]) or "the spec"
            made = next((f"--set {made_by[override.path[:n]]}" for n in range(depth, 0, -1)
                         if override.path[:n] in made_by), filename)
            if isinstance(part, int):
                if not isinstance(node, list) or part >= len(node):
                    have = (f"a list of {len(node)}" if isinstance(node, list) else "not set" if node is None
                            else f"not a list ({type(node).__name__})")
                    raise SpecError(f"--set {override.text}: {where} is {have} in {made}; set an item that is "
                                    "there, or the whole list (e.g. --set roles.ps.ports=[5000, 5001])")
            elif not isinstance(node, dict):
                raise SpecError(f"--set {override.text}: {where} is not a mapping in {made} (it is "
                                f"{type(node).__name__}); set {where} itself")
            if last:
                node[part] = override.value
                made_by[override.path] = override.text
            elif isinstance(part, str) and node.get(part) is None and isinstance(override.path[depth + 1], str):
                node[part] = {}  # a mapping the spec leaves out (its defaults apply to the rest of it)
                node = node[part]
            else:
                node = node[part] if isinstance(node, list) else node.get(part)
    return root
