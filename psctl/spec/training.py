"""The ``training:`` section → the normalised dict every role receives as-is (JSON-serialisable).

Defaults are filled here so that every role, and every restart of it, sees the same explicit values.
The optimizer and partitioner are checked here first, for line-numbered messages, and then built once by
the runtime's own factories, whose defaults complete the dict: one source of truth for what the runtime
accepts.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.machinery
import importlib.util
import math
import os
import re
import stat
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from psctl.home import nearest_existing, psctl_home
from psctl.runtime.builtin_programs import BUILTIN_PREFIX, BUILTIN_PROGRAMS, arg_expected, data_mismatch
from psctl.runtime.call_size import AUTO
from psctl.runtime.data_config import DataConfigError, named_data_shape, parse_data_config
from psctl.runtime.limits import MAX_DATA_SHARDS
from psctl.runtime.optimizer_params import LEARNING_RATE, OPTIMIZER_PARAMS, Param, optimizer_config
from psctl.runtime.partitioners import (
    PARTITIONER_KINDS,
    PLACEMENTS,
    partitioner_from_config,
    partitioner_keys,
    required_partitioner_key,
)
from psctl.spec.checks import INT64_MAX, Checker, parse_duration, show, suggestion
from psctl.spec.framework import FRAMEWORKS, normalise_tensorflow
from psctl.spec.loader import KeyPath

TRAINING_KEYS = (
    "program", "args", "data", "batch_size", "optimizer", "mode", "replicas_to_aggregate",
    "total_replicas", "staleness", "steps", "seed", "partitioner", "checkpoint",
    "log_every_seconds", "eval_every_steps", "max_evaluations", "replica_timeout", "min_replicas",
    "distinct_replicas", "pipelined", "steps_per_execution", "framework", "command", "data_shards", "placement",
    "step_timeout",
)  # fmt: skip
MODES = ("async", "sync", "bounded")
#: Each partitioner kind's keys, required ones first.
PARTITIONER_KEYS: dict[str, tuple[str, ...]] = {kind: partitioner_keys(kind) for kind in PARTITIONER_KINDS}
CHECKPOINT_KEYS = ("dir", "every_steps", "every_seconds", "max_to_keep", "keep_every_hours")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_MAX_JSON_DEPTH = 32

T: KeyPath = ("training",)


def normalise_training(
    c: Checker, value: object, *, base_dir: Path, worker_replicas: int, worker_slots: int | None = None,
    allowed_paths: tuple[Path, ...] = (),
) -> dict[str, Any]:
    """Validate ``training:`` and return it with every default filled, in a fixed key order. ``worker_slots``:
    the most workers there can be (``max_replicas``; default ``worker_replicas``)."""
    t = c.mapping(T, value, TRAINING_KEYS, example="training: {program: psctl.models.mlp, steps: 1000}")
    framework = c.choice((*T, "framework"), t.get("framework", "psctl"), FRAMEWORKS, noun="framework")
    if framework == "tensorflow":
        return normalise_tensorflow(c, t, T, base_dir, _checkpoint(c, t.get("checkpoint"), base_dir, allowed_paths))
    if "command" in t:
        c.fail((*T, "command"), "only used with training.framework: tensorflow",
               "add framework: tensorflow to run your own TensorFlow program, or remove command", key=True)
    program = _program(
        c, c.require(T, t, "program", "add program: a module (psctl.models.mlp) or a .py file"), base_dir,
        allowed_paths
    )
    out: dict[str, Any] = {"program": program}
    args = t.get("args")
    if args is not None and not isinstance(args, dict):
        c.fail((*T, "args"), f"expected a mapping, got {show(args)}", "write e.g. args: {hidden_units: 100}")
    out["args"] = _json(c, (*T, "args"), args, 0) if args is not None else {}
    valid_args = BUILTIN_PROGRAMS.get(program, ())  # (a program of the user's checks its own)
    for key in out["args"] if valid_args else ():
        if key not in valid_args:
            c.fail((*T, "args", key), f"{program} takes no arg {show(key)}", suggestion(key, valid_args), key=True)
        expected = arg_expected(program, key, out["args"][key])
        if expected is not None:
            c.fail((*T, "args", key), f"expected {expected}, got {show(out['args'][key])}", f"write e.g. {key}: 64")
    out["data"] = _data(c, t.get("data"), base_dir, allowed_paths, builtin=program in BUILTIN_PROGRAMS)
    shape = named_data_shape(out["data"]) if valid_args else None  # (a data file's is the roles' to read)
    if shape is not None:
        for key, given in out["args"].items():
            mismatch = data_mismatch(key, given, getattr(shape, key, None))
            if mismatch is not None:
                c.fail((*T, "args", key), *mismatch)
    out["batch_size"] = _int(c, t, "batch_size", 100, minimum=1, example="100")
    out["optimizer"] = _optimizer(c, t.get("optimizer"))
    mode = c.choice((*T, "mode"), t.get("mode", "async"), MODES, noun="mode")
    out["mode"] = mode
    mode_keys = (("replicas_to_aggregate", "sync"), ("total_replicas", "sync"), ("staleness", "bounded"),
                 ("replica_timeout", "sync"), ("min_replicas", "sync"), ("distinct_replicas", "sync"),
                 ("pipelined", "async"), ("steps_per_execution", "async"))
    for key, wanted in mode_keys:
        if key in t and mode != wanted:
            c.fail(
                (*T, key),
                f"only used with training.mode: {wanted}, but training.mode is {mode}",
                f"remove {key} or set training.mode: {wanted}",
                key=True,
            )
    sync = mode == "sync"
    out["replicas_to_aggregate"] = _int(c, t, "replicas_to_aggregate", worker_replicas, minimum=1) if sync else None
    out["total_replicas"] = _int(c, t, "total_replicas", worker_replicas, minimum=1) if sync else None
    # Never a silent hang: replicas missing for replica_timeout either shrink the step (down to min_replicas)
    # or fail training with a message that says so.
    out["replica_timeout"] = c.duration((*T, "replica_timeout"), t.get("replica_timeout", 60.0)) if sync else None
    # a step hung in the program goes to another worker past its deadline (its own is restarted once stalled)
    out["step_timeout"] = _step_timeout(c, t.get("step_timeout", "auto"))
    out["min_replicas"] = None
    if sync:
        r = out["replicas_to_aggregate"]
        out["min_replicas"] = _int(c, t, "min_replicas", r, minimum=1, example=str(r))
        if out["min_replicas"] > r:
            c.fail((*T, "min_replicas"), f"{out['min_replicas']} is more than replicas_to_aggregate ({r})",
                   f"use at most {r}")
    out["distinct_replicas"] = (
        c.boolean((*T, "distinct_replicas"), t.get("distinct_replicas", False), fix="write true or false")
        if sync else None
    )
    most = worker_slots or worker_replicas
    if out["distinct_replicas"] and out["replicas_to_aggregate"] > most:
        # (without distinct_replicas, R above the workers is fine: they compute several batches a step)
        c.fail((*T, "replicas_to_aggregate"),
               f"{out['replicas_to_aggregate']} is more than the {most} worker(s) there can be, and "
               "distinct_replicas takes one gradient from each of them per step: no step could complete",
               f"use at most {most}, or raise roles.worker.replicas (or max_replicas)")
    if mode == "bounded" and "staleness" not in t:
        c.fail(
            (*T, "mode"),
            "mode bounded needs training.staleness",
            "add staleness: (how many steps a worker may run ahead of the slowest), e.g. staleness: 2",
        )
    out["staleness"] = _int(c, t, "staleness", 0, minimum=0, example="2") if mode == "bounded" else None
    out["pipelined"] = c.boolean((*T, "pipelined"), t.get("pipelined", False), fix="write true or false")
    out["steps_per_execution"] = _steps_per_execution(c, t.get("steps_per_execution", AUTO))
    out["steps"] = _int(c, t, "steps", None, minimum=1, example="1000")
    # Fixed for the cluster's life: workers come and go (psctl scale), the data's split does not.
    out["data_shards"] = _int(c, t, "data_shards", worker_replicas, minimum=1, example=str(worker_replicas))
    if out["data_shards"] > MAX_DATA_SHARDS:  # (the ps refuse a shard beyond it)
        c.fail((*T, "data_shards"), f"{out['data_shards']} is more than the {MAX_DATA_SHARDS} data shards a run may "
               "have", f"write at most {MAX_DATA_SHARDS}")
    train = shape.train_examples if shape is not None else None
    if train is not None and out["batch_size"] > train:  # (each batch would hold every example many times over;
        # 1e8 of digits took a worker's 24 GiB)
        c.fail((*T, "batch_size"), f"{out['batch_size']} is more than the data's {train} training examples",
               f"write batch_size: {min(100, train)} (at most {train})")
    if train is not None and out["data_shards"] > train:  # (a shard of none: its reader fails, or trains on nothing)
        named = f"data_shards {out['data_shards']}" if "data_shards" in t else \
            f"one data shard per worker ({out['data_shards']})"
        c.fail((*T, "data_shards"), f"{named} for {train} training examples leaves shards empty",
               f"write data_shards: {train} or fewer (each shard is read whole, in order)", key="data_shards" not in t)
    out["seed"] = _int(c, t, "seed", 0, minimum=0, example="0")
    out["partitioner"] = _partitioner(c, t.get("partitioner"))
    out["placement"] = c.choice((*T, "placement"), t.get("placement", "balanced"), PLACEMENTS, noun="placement")
    out["checkpoint"] = _checkpoint(c, t.get("checkpoint"), base_dir, allowed_paths)
    out["log_every_seconds"] = c.duration((*T, "log_every_seconds"), t.get("log_every_seconds", 1.0))
    out["eval_every_steps"] = _int(c, t, "eval_every_steps", 0, minimum=0, example="100")
    out["max_evaluations"] = _int(c, t, "max_evaluations", 0, minimum=0, example="10")
    return out


def _steps_per_execution(c: Checker, value: object) -> int | str:
    """``auto`` (calls sized from the steps' durations) or a fixed number of steps per call."""
    if value == AUTO:
        return AUTO
    return c.integer((*T, "steps_per_execution"), value, minimum=1,
                     fix=f"write {AUTO} (the default: calls sized by the steps' duration) or a whole number such as 10")


def _step_timeout(c: Checker, value: object) -> float | str:
    """``auto``, or seconds (0: no deadline)."""
    if value == "auto":
        return "auto"
    try:
        seconds = parse_duration(value)
    except ValueError:
        seconds = -1.0
    if seconds < 0:
        c.fail((*T, "step_timeout"), f"expected auto, 0 or a duration such as 10m, got {show(value)}",
               "write auto (a deadline from the steps' durations), 0 (none) or a duration: 90s, 10m")
    return c.duration((*T, "step_timeout"), value, positive=False)  # (its bounds, said of what was written)


def _int(c: Checker, t: dict[str, Any], key: str, default: int | None, *, minimum: int, example: str = "2") -> int:
    if key not in t and default is not None:
        return default
    if key not in t or t[key] is None:
        c.require(T, t, key, f"add {key}: {example}")
    return c.integer((*T, key), t[key], minimum=minimum, fix=f"write a whole number such as {example}")


def check_confined(
    c: Checker, path: KeyPath, target: str, base_dir: Path, allowed: tuple[Path, ...], *, what: str,
    also: tuple[Path, ...] = (), folder: bool = False,
) -> None:
    """A path the spec names must lie in the spec's folder (or ``also``), unless the user allowed its folder
    under security.allowed_paths: a spec written by someone else cannot point roles at other files. The fix
    allows the file's folder, or the ``folder`` itself (allowing its parent would open, for /etc, all of /)."""
    try:
        resolved = (base_dir / Path(target).expanduser()).resolve()
        roots = [r.resolve() for r in (base_dir, *also, *allowed)]
    except (OSError, RuntimeError, ValueError):
        c.fail(path, f"cannot resolve {show(target)}", "give a plain path")
    if any(resolved == root or root in resolved.parents for root in roots):
        return
    c.fail(
        path,
        f"{what} {resolved} is outside the spec's folder ({base_dir})",
        f"move it there, or allow {'it' if folder else 'its folder'} with security: "
        f"{{allowed_paths: [{resolved if folder else resolved.parent}]}}",
    )


def check_local_data(c: Checker, training: Mapping[str, Any], written: object) -> None:
    """A built-in program's data file (``written``: as the spec gives it), on a cluster whose roles all run on
    this machine: it must exist before they start, as they read it first thing."""
    path = (training.get("data") or {}).get("path")
    if path is None or training.get("program") not in BUILTIN_PROGRAMS:
        return
    resolved = Path(path).expanduser()
    if not resolved.exists():
        c.fail((*T, "data", "path"), f"{show(written)} does not exist (looked for {resolved})",
               "give a path relative to the spec's folder")
    if resolved.is_dir():
        c.fail((*T, "data", "path"), f"{show(written)} is a folder ({resolved}), not a data file",
               "give the path of the .npz or .csv file in it")


def check_local_checkpoint_folder(c: Checker, training: Mapping[str, Any], written: object) -> None:
    """The checkpoint folder of a cluster whose roles all run on this machine: where it exists already it must
    be a folder that can be written (else every save fails, and the trained model goes with the ps)."""
    folder = (training.get("checkpoint") or {}).get("dir")
    if folder is None:
        return
    where = (*T, "checkpoint", "dir")
    try:
        existing, kind = nearest_existing(Path(folder).expanduser())
    except OSError as exc:
        c.fail(where, f"{show(written)}: cannot reach {exc.filename}: {exc.strerror}",
               "give a folder you can write, or change its permissions")
    if not stat.S_ISDIR(kind):
        c.fail(where, f"{show(written)}: {existing} is a file, not a folder", "give a folder's path")
    if not os.access(existing, os.W_OK | os.X_OK):
        if _on_read_only_mount(existing):  # (no permission change helps there: said so, not "by this user")
            c.fail(where, f"{show(written)}: {existing} is on a read-only file system",
                   "give a folder on a file system mounted read-write, or remount it read-write")
        c.fail(where, f"{show(written)}: {existing} cannot be written by this user",
               "give a folder you can write, or change its permissions")


def check_checkpoints_its_own(c: Checker, name: str, training: Mapping[str, Any]) -> None:
    """The checkpoint folder of a cluster of this machine is not in another cluster's folder under PSCTL_HOME:
    those checkpoints are that cluster's, and this one would prune them as its own (and that one's resume,
    export and evaluator would read this one's)."""
    folder = (training.get("checkpoint") or {}).get("dir")
    if folder is None:
        return
    home = psctl_home().resolve()
    try:
        owner = Path(folder).expanduser().resolve().relative_to(home).parts[0]
    except (ValueError, IndexError):
        return
    if owner != name and (home / owner / "state.json").is_file():
        c.fail((*T, "checkpoint", "dir"), f"{folder} is in cluster {owner!r}'s folder: its checkpoints are that "
               f"cluster's, which {name!r} would prune as its own",
               f"give {name!r} a folder of its own (copy a checkpoint of {owner!r} into it to start from there)")


def _on_read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_local_program(c: Checker, program: str, base_dir: Path, *, pythonpaths: Mapping[str, Sequence[str]]) -> None:
    """A program module of the user's, on a cluster whose roles all run on this machine: its top-level package
    must be where each role that imports it will look (installed for this Python; their working folder, the
    spec's; ``pythonpaths``: each such role's entries of its ``env`` PYTHONPATH), else the cluster would start
    only for those roles to fail at import. Found without importing it (nothing of the user's runs here); a .py
    path, found already, is read (``_check_program_text``)."""
    if program.endswith(".py") or "/" in program:  # (a file this machine's python reads as the roles' will)
        _check_program_text(c, Path(program).name, Path(program))
        return
    if program in BUILTIN_PROGRAMS:
        return
    top = program.split(".")[0]
    try:
        if importlib.util.find_spec(top):  # installed: every role finds it
            return
        lacking = [role for role, pythonpath in pythonpaths.items() if importlib.machinery.PathFinder.find_spec(
            top, [str(base_dir), *(str((base_dir / p).resolve()) for p in pythonpath)]) is None]
    except (ImportError, ValueError):  # a finder that cannot tell, a name such as __main__: the roles will say
        return
    if not lacking:
        return
    finding = [r for r in pythonpaths if r not in lacking]
    if finding:
        c.fail((*T, "program"), f"no module {show(top)} for {', '.join(lacking)} to import: only the PYTHONPATH of "
               f"{', '.join(finding)} (roles.<role>.env) has it",
               f"give {', '.join(lacking)} the same env PYTHONPATH, or put the module beside the spec")
    c.fail((*T, "program"), f"no module {show(top)} for the roles to import: not in the spec's folder "
           f"({base_dir}) nor installed for {sys.executable}",
           "give the path of a .py file, put the module beside the spec, or install its package in this Python")


def _program(c: Checker, value: object, base_dir: Path, allowed: tuple[Path, ...] = ()) -> str:
    """A module name as given, or a .py path made absolute (relative to the spec's folder) that exists."""
    path = (*T, "program")
    fix = "give a module name such as psctl.models.mlp or the path of a .py file"
    text = c.string(path, value, fix=fix)
    if not (text.endswith(".py") or "/" in text):
        if not _MODULE.fullmatch(text):
            c.fail(path, f"{show(text)} is neither a module name nor a .py path", fix)
        if text.startswith(BUILTIN_PREFIX) and text not in BUILTIN_PROGRAMS:
            c.fail(path, f"psctl has no program {show(text)}", suggestion(text, tuple(BUILTIN_PROGRAMS)))
        return text
    try:
        resolved = (base_dir / Path(text).expanduser()).resolve()
        exists = resolved.is_file()
    except (OSError, RuntimeError, ValueError):
        resolved, exists = base_dir / text, False
    if not exists:
        c.fail(
            path,
            f"program file {show(text)} does not exist (looked for {resolved})",
            "give a path relative to the spec's folder, or a module name such as psctl.models.mlp",
        )
    check_confined(c, path, str(resolved), base_dir, allowed, what="program file")
    return str(resolved)


def _check_program_text(c: Checker, text: str, resolved: Path) -> None:
    """A program file of a cluster on this machine (whose roles run this python) parses and binds ``build`` at
    its top level (a def taking three arguments, or any other binding: an import, an assignment): read, not run
    (nothing of the user's runs here). It passed, and every role failed at its start."""
    path = (*T, "program")
    try:
        tree = ast.parse(resolved.read_bytes(), filename=str(resolved))
    except SyntaxError as exc:
        c.fail(path, f"program file {show(text)} does not parse: {type(exc).__name__}: {exc.msg} ({resolved}, "
               f"line {exc.lineno})", "fix the program")
    except (OSError, ValueError) as exc:
        c.fail(path, f"program file {show(text)} cannot be read: {exc}", "give a readable Python file")
    statements = list(_top_level(tree.body))
    if any((isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names))
           or (isinstance(n, ast.FunctionDef) and n.name == "__getattr__") for n in statements):
        return  # (what it binds is another module's, or its __getattr__'s, to say)
    builds = [n for n in statements if _binds_build(n)]
    if not builds:
        c.fail(path, f"program file {show(text)} defines no build(args, data, seed) ({resolved})",
               "add def build(args, data, seed): returning the program (README, \"Your own program\")")
    last = builds[-1]
    if isinstance(last, (ast.FunctionDef, ast.AsyncFunctionDef)) and not (last.args.vararg or last.args.posonlyargs):
        given = len(last.args.args)
        needed = given - len(last.args.defaults)
        if not needed <= 3 <= given:
            c.fail(path, f"build in program file {show(text)} takes {given} argument(s) ({resolved}, line "
                   f"{last.lineno}); the runtime calls build(args, data, seed)", "give it those three arguments")


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements that run at its import, those in its if/try/with blocks included."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from _top_level(handler.body)


def _binds_build(node: ast.stmt) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return node.name == "build"
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return any((a.asname or a.name).split(".")[0] == "build" for a in node.names)
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(n, ast.Name) and n.id == "build" for t in targets for n in ast.walk(t))
    return False


def _data(c: Checker, value: object, base_dir: Path, allowed: tuple[Path, ...] = (), *,
          builtin: bool = False) -> dict[str, Any]:
    """``{name: ...}`` (a built-in data set) or ``{path: ...}``; other keys are the program's options, which a
    ``builtin`` program's data sources check here (a program of the user's reads its data config itself)."""
    path = (*T, "data")
    fix = "write data: {name: digits} or data: {path: data/train.npz}"
    if not isinstance(value, dict):
        if value is None:
            c.fail(path, "required but missing", f"add {fix.removeprefix('write ')}", key=True)
        c.fail(path, f"expected a mapping, got {show(value)}", fix)
    data = _json(c, path, value, 0)
    if "name" in data and "path" in data:
        c.fail((*path, "path"), "give data.name or data.path, not both", "remove one of them", key=True)
    if "name" not in data and "path" not in data:
        close = [k for k in data if suggestion(k, ("name", "path")).startswith("did")]
        if close:
            c.fail((*path, close[0]), "unknown key", suggestion(close[0], ("name", "path")), key=True)
        c.fail(path, "needs name or path", fix)
    if "name" in data:
        data["name"] = c.string((*path, "name"), data["name"], fix="name a data set, e.g. digits")
    else:
        text = c.string((*path, "path"), data["path"], fix="give a file or folder path")
        # Relative paths mean "next to the spec"; ~ is left for the host that reads the data to expand.
        data["path"] = text if text.startswith("~") or Path(text).is_absolute() else str(base_dir / text)
        check_confined(c, (*path, "path"), data["path"], base_dir, allowed, what="data path")
    if builtin:
        _check_builtin_data(c, data)
    return data


def _check_builtin_data(c: Checker, data: dict[str, Any]) -> None:
    """What the built-in programs' data sources would refuse at start (psctl.runtime.data_config), refused at
    its key now."""
    try:
        parse_data_config(data)
    except DataConfigError as exc:
        if exc.word:  # a data set or an option that does not exist
            fix = suggestion(exc.word, exc.choices) if exc.choices else "it takes none: remove it"
        elif exc.example is not None:
            fix = f"write e.g. {exc.key}: {exc.example!r}"
        else:
            fix = exc.fix
        where = (*T, "data", exc.key) if exc.key else (*T, "data")
        c.fail(where, exc.problem, fix, key=exc.word == exc.key)


def _optimizer(c: Checker, value: object) -> dict[str, Any]:
    path = (*T, "optimizer")
    if value is None:
        value = {}
    elif isinstance(value, str):  # shorthand: optimizer: sgd
        value = {"name": value}
    all_params = sorted({p for params in OPTIMIZER_PARAMS.values() for p in params})
    o = c.mapping(path, value, ("name", "learning_rate", *all_params), example="{name: adam, learning_rate: 0.01}")
    name = c.choice((*path, "name"), o.get("name", "adam"), tuple(OPTIMIZER_PARAMS), noun="optimizer")
    lr = c.number((*path, "learning_rate"), o.get("learning_rate", LEARNING_RATE.default),
                  above=LEARNING_RATE.above, fix=f"write a positive number such as {LEARNING_RATE.example}")
    params: dict[str, float] = {}
    for key, raw in o.items():
        if key in ("name", "learning_rate"):
            continue
        if key not in OPTIMIZER_PARAMS[name]:
            takes = ", ".join(OPTIMIZER_PARAMS[name]) or "no parameters besides learning_rate"
            c.fail((*path, key), f"not a parameter of optimizer {name!r}", f"{name} takes {takes}", key=True)
        params[key] = _optimizer_param(c, (*path, key), key, OPTIMIZER_PARAMS[name][key], raw)
    try:
        config = optimizer_config(name, lr, params)
    except ValueError as e:  # the runtime is stricter than the checks above: its word is final
        c.fail(path, str(e), "fix the optimizer's parameters")
    return {"name": name, **config}


def _optimizer_param(c: Checker, path: KeyPath, key: str, param: Param, raw: object) -> float:
    if param.flag:
        return 1.0 if c.boolean(path, raw, fix=f"write {key}: true or {key}: false") else 0.0
    return c.number(path, raw, above=param.above, at_least=param.at_least, below=param.below,
                    fix=f"write a number such as {param.example}")


def _partitioner(c: Checker, value: object) -> dict[str, Any] | None:
    path = (*T, "partitioner")
    if value is None:
        return None
    all_keys = sorted({k for keys in PARTITIONER_KEYS.values() for k in keys})
    p = c.mapping(path, value, ("kind", *all_keys), example="{kind: fixed, num_shards: 2}")
    kind = c.choice(
        (*path, "kind"),
        c.require(path, p, "kind", "add kind: fixed, min_size or max_size"),
        tuple(PARTITIONER_KEYS),
        noun="partitioner kind",
    )
    for key in p:
        if key != "kind" and key not in PARTITIONER_KEYS[kind]:
            c.fail(
                (*path, key),
                f"not used by partitioner kind {kind!r}",
                f"{kind} takes {', '.join(PARTITIONER_KEYS[kind])}",
                key=True,
            )
    required = required_partitioner_key(kind)
    if required is not None:
        c.require(path, p, required, f"add {required}: (an integer >= 1)")
    config: dict[str, Any] = {"kind": kind}
    for key in PARTITIONER_KEYS[kind]:
        if p.get(key) is not None:
            config[key] = c.integer((*path, key), p[key], minimum=1, fix="write a whole number such as 2")
    try:
        built = partitioner_from_config(config)
    except ValueError as e:
        c.fail(path, str(e), "fix the partitioner's settings")
    if dataclasses.is_dataclass(built) and not isinstance(built, type):
        config.update(dataclasses.asdict(built))  # the runtime's defaults, made explicit
    return config


def _checkpoint(c: Checker, value: object, base_dir: Path, allowed: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = (*T, "checkpoint")
    k = c.mapping(path, value, CHECKPOINT_KEYS, example="{dir: checkpoints, every_steps: 200}", none_ok=True)
    whole = "write a whole number such as 200"
    directory = c.optional_string((*path, "dir"), k.get("dir"), fix="give a folder path")
    if directory is not None:
        check_confined(c, (*path, "dir"), directory, base_dir, allowed, what="checkpoint folder",
                       also=(psctl_home(),), folder=True)
        # relative means next to the spec; ~ is left for the host that writes the checkpoints to expand
        if not (directory.startswith("~") or Path(directory).is_absolute()):
            directory = str(base_dir / directory)
    return {
        # null: the launcher puts checkpoints under <PSCTL_HOME>/<name>/checkpoints.
        "dir": directory,
        "every_steps": c.integer((*path, "every_steps"), k.get("every_steps", 0), minimum=0, fix=whole),
        "every_seconds": c.duration((*path, "every_seconds"), k.get("every_seconds", 60.0), positive=False),
        "max_to_keep": c.integer((*path, "max_to_keep"), k.get("max_to_keep", 5), minimum=1, fix="write e.g. 5"),
        "keep_every_hours": c.number(
            (*path, "keep_every_hours"),
            k.get("keep_every_hours", 0.0),
            at_least=0,
            fix="write a number of hours, or 0 to keep none extra",
        ),
    }


def _json(c: Checker, path: KeyPath, value: object, depth: int) -> Any:
    """A deep copy of free-form ``value`` that JSON can carry unchanged, else a SpecError at the culprit."""
    if depth > _MAX_JSON_DEPTH:
        c.fail(path, "nested too deeply", "flatten it")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if abs(value) > INT64_MAX:
            c.fail(path, "integer does not fit in 64 bits", "use a smaller number or quote it")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            c.fail(path, f"{show(value)} cannot be sent to the roles as JSON", "use a finite number")
        return value
    if isinstance(value, list):
        return [_json(c, (*path, i), item, depth + 1) for i, item in enumerate(value)]
    if isinstance(value, dict):
        c.string_keys(path, value)
        return {k: _json(c, (*path, k), v, depth + 1) for k, v in value.items()}
    c.fail(path, f"cannot send {show(value)} to the roles as JSON", "quote it to make it a string")
