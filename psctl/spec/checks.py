"""Typed field checks that fail with the spec's one-line, line-numbered error.

Each check takes the key path and the raw value the user wrote and returns the value as its proper type,
or raises :class:`~psctl.errors.SpecError` saying what is wrong and how to fix it. Booleans are never
numbers here (``replicas: true`` is a mistake, not 1), and non-finite or absurdly large numbers are refused
so that nothing downstream (JSON, protobuf int64, float()) can trip over them.
"""

from __future__ import annotations

import datetime
import difflib
import math
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from psctl.spec.loader import KeyPath, SourceMap

INT64_MAX = 2**63 - 1

_DURATION = re.compile(r"(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ms|s|m|h))+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SECONDS = re.compile(r"\d+(?:\.\d*)?|\.\d+")
#: The longest duration a spec may give: longer waits overflow the system's (a poll's milliseconds end at
#: ~596 h) and left a cluster hanging or a role crashing; none of psctl's waits needs more than days.
MAX_DURATION = 7 * 24 * 3600.0


def show(value: object) -> str:
    """A short, one-line rendering of a user's value for an error message, in YAML's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, int) and value.bit_length() > 64:
        return "a number too large"
    if isinstance(value, (datetime.date, datetime.datetime)):
        return f"the date {value.isoformat()}"
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + "...'"


def parse_duration(value: object) -> float:
    """Seconds from a number of seconds or a string such as ``"500ms"``, ``"5s"``, ``"2m"``, ``"1h30m"``.

    Raises ValueError for anything else, including negative, non-finite and boolean values.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a duration, got {show(value)}")
    if isinstance(value, str):
        text = value.strip()
        if _SECONDS.fullmatch(text):  # ("10", quoted: seconds, as 10 is)
            seconds = float(text)
        elif not _DURATION.fullmatch(text):
            raise ValueError(f"expected a duration, got {show(value)}")
        else:
            seconds = sum(float(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION_PART.findall(text))
    else:
        try:
            seconds = float(value)
        except OverflowError:
            raise ValueError(f"duration {show(value)} is too large") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"expected a duration >= 0, got {show(value)}")
    return seconds


def seconds_text(seconds: float) -> str:
    """``1.0`` → ``1s``, ``0.5`` → ``0.5s``: how durations are echoed back in messages."""
    return f"{seconds:g}s"


def suggestion(word: object, choices: Sequence[str]) -> str:
    """``did you mean 'x'?`` when ``word`` is close to one of ``choices``, else the list of choices."""
    close: list[str] = []
    if isinstance(word, str):  # (the case is the likeliest slip: ASYNC is async, not sync)
        close = [c for c in choices if c.lower() == word.lower()] or difflib.get_close_matches(word, choices, n=1)
    return f"did you mean {close[0]!r}?" if close else f"expected one of: {', '.join(choices)}"


class Checker:
    """The typed checks, bound to one spec's :class:`SourceMap` so that every error has its line."""

    def __init__(self, source: SourceMap, sections: Sequence[tuple[str, Sequence[str]]] = ()) -> None:
        self.source = source
        #: Each section of the spec (as a user writes its path) with its keys: an unknown key that is another
        #: section's is said to belong there (a top-level `steps:` was asked "did you mean 'setup'?").
        self.sections = sections

    def fail(self, path: KeyPath, what: str, fix: str, *, key: bool = False, at: KeyPath | None = None) -> NoReturn:
        """Raise the spec error for ``path``, at the line of ``at`` (default: ``path`` itself)."""
        raise self.source.error(path, what, fix, key=key, at=at)

    def mapping(
        self, path: KeyPath, value: object, allowed: Sequence[str], *, example: str, none_ok: bool = False
    ) -> dict[str, Any]:
        """``value`` as a mapping whose keys are all strings from ``allowed`` (null is {} if ``none_ok``)."""
        if value is None and none_ok:
            return {}
        if not isinstance(value, dict):
            self.fail(path, f"expected a mapping, got {show(value)}", f"write key: value pairs, e.g. {example}")
        self.string_keys(path, value)
        for key in value:
            if key not in allowed:
                self.fail((*path, key), "unknown key", self._unknown_key_fix(key, allowed), key=True)
        return value

    def _unknown_key_fix(self, key: str, allowed: Sequence[str]) -> str:
        """A key of this mapping it is close to (a typo: `host` for `hosts`, `steps` for `every_steps`), else the
        sections whose key it is (written in the wrong place: a top-level `steps:` was asked "did you mean
        'setup'?"), else the nearest key or the list of them."""
        near = [k for k in allowed if k.endswith(f"_{key}") or k.startswith(f"{key}_")]
        near = near or difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
        homes = [name for name, keys in self.sections if key in keys]
        if near or not homes:
            return f"did you mean {near[0]!r}?" if near else suggestion(key, allowed)
        places = " or ".join(f"{home}.{key}" if home else f"{key} at the top level" for home in homes)
        return f"it belongs elsewhere: {places}"

    def as_written(self, path: KeyPath, value: object) -> object:
        """A plain number at ``path`` as the file wrote it (``0755``, ``1.10``), for keys whose values are text
        (an environment variable's, a Slurm time limit); anything else as it is."""
        if isinstance(value, int | float) and not isinstance(value, bool):
            return self.source.numbers.get(path, str(value) if isinstance(value, int) else repr(value))
        return value

    def string_keys(self, path: KeyPath, value: dict[Any, Any]) -> None:
        for key in value:
            if not isinstance(key, str):
                self.fail(
                    path,
                    f"keys must be strings, got {show(key)}",
                    "quote the key (YAML reads yes/no/on/off as booleans and digits as numbers)",
                    key=True,
                    at=(*path, key),
                )

    def require(self, path: KeyPath, mapping: dict[str, Any], key: str, fix: str) -> Any:
        """``mapping[key]``; missing (or null) is reported at the parent's line."""
        value = mapping.get(key)
        if value is None:
            self.fail((*path, key), "required but missing", fix, key=True)
        return value

    def integer(self, path: KeyPath, value: object, *, minimum: int, maximum: int | None = None, fix: str) -> int:
        """A whole number (not a bool, not 2.0) in ``minimum..maximum``; never beyond int64."""
        wanted = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < minimum
            or value > (INT64_MAX if maximum is None else maximum)
        ):
            self.fail(path, f"expected an integer {wanted}, got {show(value)}", fix)
        return value

    def number(
        self,
        path: KeyPath,
        value: object,
        *,
        above: float | None = None,
        at_least: float | None = None,
        below: float | None = None,
        fix: str,
    ) -> float:
        """A finite real number (int or float, not bool) as a float, within the given open/closed bounds."""
        bounds = [f"> {above:g}" if above is not None else "", f">= {at_least:g}" if at_least is not None else ""]
        bounds.append(f"< {below:g}" if below is not None else "")
        wanted = " and ".join(b for b in bounds if b)
        what = f"expected a number {wanted}, got {show(value)}" if wanted else f"expected a number, got {show(value)}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(path, what, fix)
        try:
            number = float(value)
        except OverflowError:
            self.fail(path, what, fix)
        if (
            not math.isfinite(number)
            or (above is not None and not number > above)
            or (at_least is not None and not number >= at_least)
            or (below is not None and not number < below)
        ):
            self.fail(path, what, fix)
        return number

    def duration(self, path: KeyPath, value: object, *, positive: bool = True) -> float:
        """Seconds from a number or a string such as 500ms / 5s / 2m / 1h (> 0 if ``positive``)."""
        fix = "write a number of seconds or a number with a unit: 500ms, 5s, 2m, 1h"
        try:
            seconds = parse_duration(value)
        except ValueError:
            self.fail(path, f"expected a duration such as 5s, got {show(value)}", fix)
        if positive and seconds <= 0:
            self.fail(path, f"expected a duration > 0, got {show(value)}", fix)
        if seconds > MAX_DURATION:
            self.fail(path, f"expected a duration of at most 7 days ({seconds_text(MAX_DURATION)}), got "
                      f"{show(value)}", "write a shorter one")
        return seconds

    def string(
        self, path: KeyPath, value: object, *, fix: str, pattern: re.Pattern[str] | None = None, rule: str = ""
    ) -> str:
        """A non-empty string without control characters (and matching ``pattern``, described by ``rule``)."""
        if not isinstance(value, str) or not value:
            if isinstance(value, (int, float, datetime.date)) and not isinstance(value, bool):  # (007, 2024-01-01)
                fix = f"{fix}, or quote it: YAML reads it unquoted as a number or a date"
            self.fail(path, f"expected a string, got {show(value) if value != '' else 'an empty string'}", fix)
        if pattern is not None and not pattern.fullmatch(value):
            self.fail(path, f"{show(value)} is not valid: {rule}", fix)
        if any(ch < " " or ch == "\x7f" for ch in value):
            self.fail(path, f"{show(value)} contains a control character", "remove it")
        return value

    def optional_string(self, path: KeyPath, value: object, *, fix: str) -> str | None:
        return None if value is None else self.string(path, value, fix=fix)

    def boolean(self, path: KeyPath, value: object, *, fix: str) -> bool:
        if not isinstance(value, bool):
            self.fail(path, f"expected true or false, got {show(value)}", fix)
        return value

    def choice(self, path: KeyPath, value: object, choices: Sequence[str], *, noun: str) -> str:
        """One of ``choices``; a near miss gets a did-you-mean."""
        if value not in choices or not isinstance(value, str):
            close = suggestion(value, choices)
            listed = ", ".join(choices)
            fix = f"{close} (one of: {listed})" if close.startswith("did") else f"use one of: {listed}"
            self.fail(path, f"unknown {noun} {show(value)}", fix)
        return value

    def items(self, path: KeyPath, value: object, *, fix: str) -> list[Any]:
        """A YAML list."""
        if not isinstance(value, list):
            self.fail(path, f"expected a list, got {show(value)}", fix)
        return value
