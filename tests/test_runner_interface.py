"""Every launch backend offers exactly the Runner interface (STYLE.md habit 3), plus the extras listed here."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import psctl.launch
from psctl.launch.base import Runner
from psctl.launch.local import LocalRunner
from psctl.launch.ssh import SSHRunner

#: Public methods a backend offers beyond the interface, documented in its class docstring.
EXTRAS: dict[type[Runner], set[str]] = {
    LocalRunner: set(),
    SSHRunner: {"run", "put_file", "put_bytes", "get_file", "listdir", "check_python", "python_error"},
}


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def all_backends() -> set[type[Runner]]:
    for module in pkgutil.iter_modules(psctl.launch.__path__, "psctl.launch."):
        importlib.import_module(module.name)
    found: set[type[Runner]] = set()
    todo = list(Runner.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("psctl.") and not inspect.isabstract(cls):
            found.add(cls)
        todo += cls.__subclasses__()
    return found


def test_every_backend_is_checked() -> None:
    assert all_backends() == set(EXTRAS), "a new launch backend: add it (and its extras) to EXTRAS"


@pytest.mark.parametrize("backend", list(EXTRAS), ids=[cls.__name__ for cls in EXTRAS])
def test_backend_matches_the_runner_interface(backend: type[Runner]) -> None:
    interface = public_methods(Runner)
    methods = public_methods(backend)
    assert set(methods) == set(interface) | EXTRAS[backend]
    for name, signature in interface.items():
        assert str(methods[name]) == str(signature), f"{backend.__name__}.{name} differs from Runner.{name}"


def test_extras_are_documented() -> None:
    for backend, extras in EXTRAS.items():
        for name in extras:
            assert name in (backend.__doc__ or ""), f"{backend.__name__} does not document its extra {name}"
            assert getattr(backend, name).__doc__, f"{backend.__name__}.{name} has no docstring"
