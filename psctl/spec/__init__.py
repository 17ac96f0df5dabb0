"""The YAML cluster spec: load → defaults → validate (with line numbers) → plan.

Every mistake in a spec is a :class:`~psctl.errors.SpecError` (exit code 2) whose one-line message is
``{file}:{line}: {key.path}: {what is wrong}; {how to fix it}``. No other exception escapes for any text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from psctl.errors import SpecError
from psctl.spec.checks import parse_duration
from psctl.spec.loader import SourceMap, load_yaml
from psctl.spec.model import (
    ROLE_NAMES,
    ClusterSpec,
    HostSpec,
    RestartPolicy,
    RoleSpec,
    SupervisionSpec,
)
from psctl.spec.overrides import apply_overrides, parse_override
from psctl.spec.plan import Plan, RoleInstance, make_plan

__all__ = [
    "ROLE_NAMES",
    "ClusterSpec",
    "HostSpec",
    "Plan",
    "RestartPolicy",
    "RoleInstance",
    "RoleSpec",
    "SourceMap",
    "SpecError",
    "SupervisionSpec",
    "load_spec",
    "load_spec_text",
    "make_plan",
    "parse_duration",
]


#: A spec is a few KB; one for a thousand hosts some hundreds. Beyond this it is not one (``/dev/zero``).
MAX_SPEC_BYTES = 4 * 2**20


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> ClusterSpec:
    """Read and validate the spec file at ``path`` with ``overrides`` (``--set`` arguments, see
    ``psctl.spec.overrides``) applied; messages name the file as the user wrote it."""
    shown = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)  # bounded: a device or a runaway file is refused, not read whole
        if len(raw) > MAX_SPEC_BYTES:
            raise SpecError(f"{shown}: not a cluster spec: larger than {MAX_SPEC_BYTES // 2**20} MiB; give the "
                            "spec's YAML file")
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{shown}: cannot read the spec: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        fix = ("check the path" if isinstance(e, FileNotFoundError | IsADirectoryError | NotADirectoryError)
               else "check its permissions")
        raise SpecError(f"{shown}: cannot read the spec: {e.strerror or e}; {fix}") from None
    except ValueError as e:  # e.g. a NUL in the path
        raise SpecError(f"{shown}: cannot read the spec: {e}") from None
    return _load(text, shown=shown, path=Path(path).absolute(), overrides=overrides)


def load_spec_text(text: str, *, filename: str = "<string>", overrides: Sequence[str] = ()) -> ClusterSpec:
    """Validate spec ``text`` as if read from ``filename`` (used in messages, for the default name and as
    the folder relative paths start from; a ``<pseudo-name>`` means the current directory)."""
    pseudo = filename.startswith("<") and filename.endswith(">")
    return _load(text, shown=filename, path=None if pseudo else Path(filename).absolute(), overrides=overrides)


def _load(text: str, *, shown: str, path: Path | None, overrides: Sequence[str]) -> ClusterSpec:
    # imported here: validation loads the runtime's optimizers and partitioners (numpy), which what only reads
    # a cluster's recorded spec and plan (psctl status, logs, the supervisor's state) never needs
    from psctl.spec.schema import build_spec

    parsed = [parse_override(o) for o in overrides]  # a malformed one is refused before the file is read
    data, source = load_yaml(text, filename=shown)
    data = apply_overrides(data, parsed, filename=shown)
    numbers = {**source.numbers, **{(*o.path, *sub): text for o in parsed for sub, text in o.numbers.items()}}
    source = replace(source, overrides={o.path: o.text for o in parsed}, numbers=numbers)
    base_dir = path.parent if path is not None else Path.cwd()
    default_name = path.stem if path is not None else shown.strip("<>")
    spec = build_spec(data, source, path=path, base_dir=base_dir, default_name=default_name)
    return replace(spec, overrides=tuple(overrides), text=text)
