"""Running one operation on many hosts at once: every host's result or error, then one error for all.

In the manner of Fabric's ThreadingGroup: one bad host never hides what happened on the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

from psctl.errors import LaunchError, PsctlError


class HasHost(Protocol):
    @property
    def host(self) -> str: ...


R = TypeVar("R", bound=HasHost)
T = TypeVar("T")


class HostsError(LaunchError):
    """One operation failed on some hosts: carries every host's result, and lists each failure on a line."""

    def __init__(self, results: Mapping[str, object]) -> None:
        self.results = dict(results)
        self.failures = {h: r for h, r in self.results.items() if isinstance(r, BaseException)}
        self.succeeded = {h: r for h, r in self.results.items() if not isinstance(r, BaseException)}
        lines = [f"{len(self.failures)} of {len(self.results)} hosts failed:"]
        lines += [f"  {_one_line(h, exc)}" for h, exc in sorted(self.failures.items())]
        super().__init__("\n".join(lines))


def _one_line(host: str, exc: BaseException) -> str:
    text = exc.format_message() if isinstance(exc, PsctlError) else f"host {host}: {type(exc).__name__}: {exc}"
    return " ".join(text.split())


def run_on_all(runners: Sequence[R], fn: Callable[[R], T]) -> dict[str, T | Exception]:
    """``fn(runner)`` for every runner in parallel threads (up to 64 at once); every host's result or exception.

    Never raises for a host's failure: one bad host does not hide what happened on the others (see
    :func:`check_results`).
    """
    names = [r.host for r in runners]
    if len(set(names)) != len(names):
        raise ValueError(f"hosts given twice: {sorted({n for n in names if names.count(n) > 1})}")
    if not runners:
        return {}
    with ThreadPoolExecutor(max_workers=min(64, len(runners)), thread_name_prefix="psctl-ssh") as pool:
        futures = {r.host: pool.submit(fn, r) for r in runners}
    results: dict[str, T | Exception] = {}
    for name, future in futures.items():
        exc = future.exception()
        if exc is not None and not isinstance(exc, Exception):
            raise exc  # KeyboardInterrupt and the like are not a host's failure
        results[name] = exc if exc is not None else future.result()
    return results


def check_results(results: Mapping[str, T | Exception]) -> dict[str, T]:
    """Every host's result if all succeeded; else one :class:`HostsError` carrying all of them."""
    if any(isinstance(r, Exception) for r in results.values()):
        raise HostsError(results)
    return {h: r for h, r in results.items() if not isinstance(r, Exception)}
