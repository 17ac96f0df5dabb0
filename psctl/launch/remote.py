"""A cluster on SSH hosts: its folder on each host, the preflight check, and getting the code and keys there.

Each host holds the cluster under ``<workdir>/<cluster name>/`` with the same layout as the local cluster
folder (``logs/``, ``run/``, ``tls/``, ``checkpoints/``) plus ``files/``: the working folder of its roles,
where the spec's program, data and ``files:`` are copied (paths relative to the spec's folder stay relative;
others go under ``files/_abs/``). psctl itself is copied, once per version, to ``<workdir>/psctl-<version>-
<digest>/`` when the host's python has no psctl of the same version.

What a host must have already: sshd, a POSIX shell and ``tar``, Linux ``/proc``, and a python >= 3.10 that can
import numpy, grpcio and protobuf (``pip install numpy grpcio protobuf``).
"""

from __future__ import annotations

import hashlib
import io
import json
import shlex
import tarfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import psctl
from psctl.errors import LaunchError
from psctl.home import KEPT_RUNS, RoleFolders
from psctl.launch.base import sh_path
from psctl.spec.framework import scripts
from psctl.spec.model import ClusterSpec

if TYPE_CHECKING:  # paramiko is imported where a host is remote, not by every command
    from psctl.launch.ssh import SSHRunner

#: Below this much free space in a host's workdir, logs and checkpoints are likely to fill it.
MIN_FREE_BYTES = 1 << 30
#: Clock differences above this are reported: events and checkpoint ages compare the hosts' clocks.
MAX_CLOCK_SKEW = 1.0
SETUP_TIMEOUT = 900.0
#: What a role needs on the host besides psctl itself.
RUNTIME_MODULES = ("numpy", "grpc", "google.protobuf")
#: What a TensorFlow program's roles need besides (``training.framework: tensorflow``).
TENSORFLOW_MODULES = ("tensorflow",)
#: Modules the preflight finds installed without importing them: TensorFlow's import takes seconds (10-20 s
#: with three hosts' preflights on one 2-core machine), on every ``psctl up``; the roles import it themselves.
LOCATED_MODULES = frozenset(TENSORFLOW_MODULES)
#: The pip package of a module, where the names differ.
PACKAGES = {"grpc": "grpcio", "google.protobuf": "protobuf", "tensorflow": "tensorflow-cpu"}


@dataclass(frozen=True)
class HostDir(RoleFolders[PurePosixPath]):
    """A cluster's folder on one host (a remote path; ``~/`` is the remote user's home)."""

    @classmethod
    def of(cls, workdir: str, cluster: str) -> HostDir:
        return cls(PurePosixPath(workdir) / cluster)

    @property
    def files(self) -> PurePosixPath:
        """The roles' working folder: the program, data and ``files:`` copied from this machine."""
        return self.root / "files"


# -- what is copied ------------------------------------------------------------------------------------
def staged_name(local: Path, spec_dir: Path) -> str:
    """Where a local file goes under ``files/``: its path relative to the spec's folder, else under _abs/."""
    try:
        return local.relative_to(spec_dir).as_posix()
    except ValueError:
        return "_abs" + local.as_posix()


def _copied_program(training: Mapping[str, Any]) -> str | None:
    """The training program, if it is a local .py file (copied to every host); None for a module."""
    program = str(training.get("program", ""))
    return program if program.endswith(".py") else None


def _copied_data(training: Mapping[str, Any]) -> str | None:
    """The training data file, if it is one here (copied); None for a built-in set or a path on the hosts."""
    path = (training.get("data") or {}).get("path")
    return str(path) if path and not str(path).startswith("~") and Path(path).exists() else None


def staged_files(spec: ClusterSpec) -> dict[str, Path]:
    """Every local file or folder the roles need on their hosts: name under ``files/`` -> local path."""
    spec_dir = spec_folder(spec)
    paths = [Path(p) for p in spec.files]
    paths += [Path(p) for p in (_copied_program(spec.training), _copied_data(spec.training)) if p is not None]
    commands = [spec.training.get("command") or [], *(r.command or () for r in spec.roles.values())]
    paths += [spec_dir / script for words in commands for script in scripts(tuple(words))]  # a TF program's
    return {staged_name(p.resolve(), spec_dir): p.resolve() for p in paths}


def spec_folder(spec: ClusterSpec) -> Path:
    return spec.path.parent.resolve() if spec.path else Path.cwd()


def remote_training(spec: ClusterSpec, hostdir: HostDir) -> dict[str, Any]:
    """The training section as a role on a host sees it: copied paths point at their copies there."""
    training = json.loads(json.dumps(spec.training))
    spec_dir = spec_folder(spec)

    def copy_of(local: str) -> str:
        return str(hostdir.files / staged_name(Path(local).resolve(), spec_dir))

    program, data_path = _copied_program(training), _copied_data(training)
    if program is not None:
        training["program"] = copy_of(program)
    if data_path is not None:
        training["data"]["path"] = copy_of(data_path)
    checkpoint = training.get("checkpoint")
    if isinstance(checkpoint, dict) and not checkpoint.get("dir"):
        training["checkpoint"] = {**checkpoint, "dir": str(hostdir.checkpoints)}
    return training


def tar_gz(entries: Iterable[tuple[str, Path]]) -> bytes:
    """A gzipped tar of ``(name in the archive, local file or folder)``; no caches, owner-only modes."""

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if "__pycache__" in info.name.split("/") or info.name.endswith(".pyc"):
            return None
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode = 0o700 if info.isdir() else 0o600
        return info

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as archive:
        for name, path in entries:
            archive.add(str(path), arcname=name, filter=clean)
    return buffer.getvalue()


def psctl_bundle() -> tuple[str, bytes]:
    """(folder name ``psctl-<version>-<digest>``, the package as a tar.gz) of the psctl running here."""
    package = Path(psctl.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return f"psctl-{psctl.__version__}-{digest.hexdigest()[:12]}", tar_gz([("psctl", package)])


# -- preflight -------------------------------------------------------------------------------------------
#: Runs on the host with its python (any 3.x, to report an old one): one round trip for every check.
_PREFLIGHT = r"""
import importlib.util, json, os, socket, sys, time
started = time.time()
args = json.loads(sys.argv[1])
out = {"python": "%d.%d.%d" % tuple(sys.version_info[:3]), "cpus": os.cpu_count() or 1, "missing": []}
for name in args["modules"]:
    try:
        if name not in args["located"]:
            __import__(name)
        elif importlib.util.find_spec(name) is None:
            raise ImportError(name)
    except Exception:
        out["missing"].append(name)
try:
    import psctl
    out["psctl"] = psctl.__version__
except Exception:
    out["psctl"] = None
out["busy"] = []
for port in args["ports"]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", port))
    except OSError as e:
        out["busy"].append([port, e.errno, e.strerror])
    finally:
        s.close()
probe = os.path.expanduser(args["workdir"])
while not os.path.isdir(probe):
    probe = os.path.dirname(probe) or "/"
st = os.statvfs(probe)
out["free"] = st.f_bavail * st.f_frsize
out["times"] = [started, time.time()]
print(json.dumps(out))
"""


@dataclass
class HostReport:
    """What the preflight found on one host; ``problems`` are one line each, naming the host and the fix."""

    host: str
    python: str = ""
    psctl: str | None = None
    cpus: int = 1
    free_bytes: int = 0
    clock_skew: float = 0.0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def copy_psctl(self) -> bool:
        return self.psctl != psctl.__version__


def preflight(runner: SSHRunner, ports: Mapping[int, str], port_keys: Mapping[int, str], *,
              modules: Sequence[str] = RUNTIME_MODULES) -> HostReport:
    """Check one host: reachable and authenticated (else LaunchError), its python and ``modules``, the roles'
    ports free, disk space in the workdir, clock skew. ``ports``: port -> role name; ``port_keys``: port ->
    the spec key that chose it."""
    spec = runner.spec
    args = json.dumps({"modules": list(modules), "located": sorted(LOCATED_MODULES & set(modules)),
                       "ports": sorted(ports), "workdir": spec.workdir})
    sent = time.time()
    code, out, err = runner.run(f"{sh_path(spec.python)} -c {shlex.quote(_PREFLIGHT)} {shlex.quote(args)}",
                                timeout=max(runner.command_timeout, 20.0))
    received = time.time()
    if code != 0:
        raise runner.python_error(code, err)
    try:
        found = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise LaunchError(f"host {runner.host}: python {spec.python!r} printed no report ({out[:80]!r}); "
                          "set hosts[].python") from None
    try:  # (what a host printed: of the shape the script prints, or refused in words, not a traceback)
        report = HostReport(host=runner.host, python=str(found["python"]), psctl=found["psctl"],
                            cpus=int(found["cpus"]), free_bytes=int(found["free"]))
        remote_start, remote_end = (float(t) for t in found["times"])
        missing = [str(m) for m in found["missing"]]
        busy = [(int(port), int(errno_), str(strerror)) for port, errno_, strerror in found["busy"]
                if int(port) in ports]
    except (KeyError, TypeError, ValueError) as exc:
        raise LaunchError(f"host {runner.host}: python {spec.python!r} printed a report psctl cannot read "
                          f"({type(exc).__name__}: {exc}; {out.strip()[-80:]!r}); set hosts[].python") from None
    report.clock_skew = ((remote_start - sent) + (remote_end - received)) / 2  # NTP's offset estimate
    where = f"host {runner.host}"
    if tuple(int(p) for p in report.python.split(".")[:2]) < (3, 10):
        report.problems.append(f"{where}: python {spec.python!r} is {report.python}; psctl needs 3.10 or newer; "
                               "set hosts[].python")
    if missing:
        packages = " ".join(PACKAGES.get(m, m) for m in missing)
        report.problems.append(
            f"{where}: python {spec.python!r} cannot import {', '.join(missing)}; install them there "
            f"(pip install {packages}) or set hosts[].python to one that has them"
        )
    for port, errno_, strerror in busy:
        what = "needs root to bind" if errno_ in (1, 13) else "is already in use"
        fix = "pick a port above 1023" if errno_ in (1, 13) else "pick another port or stop what holds it"
        report.problems.append(f"{where}: port {port} ({ports[port]}) {what} ({strerror}); {fix} "
                               f"({port_keys[port]})")
    if report.free_bytes < MIN_FREE_BYTES:
        report.problems.append(
            f"{where}: only {report.free_bytes >> 20} MiB free under {spec.workdir}; free some space or set "
            "hosts[].workdir to a larger disk"
        )
    if abs(report.clock_skew) > MAX_CLOCK_SKEW:
        way = "ahead of" if report.clock_skew > 0 else "behind"
        report.warnings.append(f"{where}: clock is {abs(report.clock_skew):.1f}s {way} this machine's; sync it "
                               "(chrony or ntp): event times and checkpoint ages compare clocks")
    return report


# -- preparing a host --------------------------------------------------------------------------------------
def upload_tar(runner: SSHRunner, data: bytes, folder: PurePosixPath | str, *, marker: str | None = None) -> None:
    """Unpack a tar.gz into ``folder`` on the host; with ``marker``, skip if ``folder/marker`` exists and
    create it last (so a copy cut half-way is redone, and a complete one is shared)."""
    target = sh_path(folder)
    if marker is not None:
        code, _, _ = runner.run(f"test -e {sh_path(f'{folder}/{marker}')}")
        if code == 0:
            return
    archive = f"{folder}.{time.time_ns()}.tar.gz"
    runner.put_bytes(data, archive)
    script = f"mkdir -p -m 700 {target} && tar -xzof {sh_path(archive)} -C {target}"
    if marker is not None:
        script += f" && : > {sh_path(f'{folder}/{marker}')}"
    code, _, err = runner.run(f"{script}; status=$?; rm -f {sh_path(archive)}; exit $status", timeout=60.0)
    if code != 0:
        raise LaunchError(f"host {runner.host}: cannot unpack into {folder}: {err.strip()[-200:] or code}; "
                          "check the disk and that tar is installed")


def prepare_host(
    runner: SSHRunner,
    hostdir: HostDir,
    *,
    tls_files: Mapping[str, Path],
    staged: bytes | None,
    psctl_copy: tuple[str, bytes] | None,
    setup: Sequence[str],
) -> str | None:
    """Create the cluster's folder, copy keys, files and (if needed) psctl, run ``setup:``; returns the
    PYTHONPATH entry of the psctl copy, or None when the host's own psctl is used."""
    dirs = " ".join(sh_path(d) for d in (hostdir.root, hostdir.logs, hostdir.run_dir, hostdir.tls_dir,
                                          hostdir.files, hostdir.checkpoints))
    # A new cluster of the same name starts with no logs, metrics or results of the last one (an evaluator would
    # read an old result.json as "training is done"): they are kept under history/, as on this machine.
    code, _, err = runner.run(f"{keep_last_run_script(hostdir)} && mkdir -p -m 700 {dirs} && chmod 700 {dirs}")
    if code != 0:
        raise LaunchError(f"host {runner.host}: cannot create {hostdir.root}: {err.strip() or code}; "
                          "set hosts[].workdir to a folder the user can write")
    for name, local in tls_files.items():
        runner.put_file(local, str(hostdir.tls_dir / name), mode=0o600)
    if staged is not None:
        upload_tar(runner, staged, hostdir.files)
    pythonpath = None
    if psctl_copy is not None:
        folder_name, bundle = psctl_copy
        folder = PurePosixPath(runner.spec.workdir) / folder_name
        upload_tar(runner, bundle, folder, marker=".complete")
        pythonpath = str(folder)
    for i, command in enumerate(setup):
        code, out, err = runner.run(f"cd {sh_path(hostdir.files)} && {command}", timeout=SETUP_TIMEOUT)
        if code != 0:
            last = (err.strip() or out.strip() or f"exit code {code}").splitlines()[-1]
            raise LaunchError(f"host {runner.host}: {setup_failed(i, command, code, last)}")
    return pythonpath


def keep_last_run_script(hostdir: HostDir) -> str:
    """Shell that moves the last run's ``logs/`` and ``run/`` on a host to ``history/N`` (numbered on from the
    newest there, as ``ClusterDir.keep_last_run`` does here) and keeps the KEPT_RUNS newest."""
    history = sh_path(hostdir.root / "history")
    stale = f"{sh_path(hostdir.logs)} {sh_path(hostdir.run_dir)}"
    runs = f"ls {history} 2>/dev/null | grep -xE '[0-9]+' | sort -n"
    return (f"{{ for d in {stale}; do [ -e \"$d\" ] && break; d=; done; [ -z \"$d\" ] || {{ "
            f"n=$({runs} | tail -n 1); n=$(( ${{n:-0}} + 1 )); mkdir -p -m 700 {history} {history}/$n && "
            f"for d in {stale}; do if [ -e \"$d\" ]; then mv \"$d\" {history}/$n/ || exit 1; fi; done && "
            f"{runs} -r | tail -n +{KEPT_RUNS + 1} | while read -r old; do rm -rf {history}/\"$old\"; done; }}; }}")


def setup_failed(index: int, command: str, code: int, last: str) -> str:
    """What ``setup:`` command ``index`` failing says, on a host or on this machine: ``last``, its output's last
    line."""
    return f"setup[{index}] `{command}` failed (exit {code}): {last}; fix the command under setup:"


def remove_files(runner: SSHRunner, hostdir: HostDir, *, keep_checkpoints: bool = True) -> None:
    """Delete the cluster's folder on the host (keys included); checkpoints stay (if there are any) unless
    told otherwise."""
    keep = " ! -name checkpoints" if keep_checkpoints else ""
    root = sh_path(hostdir.root)
    code, _, err = runner.run(
        f"test -d {root} || exit 0; find {root} -mindepth 1 -maxdepth 1{keep} -exec rm -rf {{}} +; "
        f"rmdir {sh_path(hostdir.checkpoints)} 2>/dev/null; rmdir {root} 2>/dev/null; exit 0", timeout=60.0
    )
    if code != 0:
        raise LaunchError(f"host {runner.host}: cannot delete {hostdir.root}: {err.strip() or code}")
