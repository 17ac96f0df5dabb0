"""SSHRunner against real sshd test hosts (tests/sshbed.py): start, poll, signal and find processes on three
hosts, crashes, partitions and frozen hosts, and every connection error with its exact one-line message."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
from cluster_helpers import wait_until
from sshbed import SSHBed, sshbed_fixture  # noqa: F401 - provides the session fixture `sshbed`

from psctl.checkpoints import fetch_newest
from psctl.errors import CheckpointNotFound, LaunchError
from psctl.home import KEPT_RUNS
from psctl.launch import hosts
from psctl.launch.base import ProcessHandle, stop_processes
from psctl.launch.fanout import HostsError, check_results, run_on_all
from psctl.launch.hostset import RemoteHost
from psctl.launch.local import UNKNOWN_EXIT
from psctl.launch.remote import _PREFLIGHT, LOCATED_MODULES, HostDir, preflight, prepare_host
from psctl.launch.ssh import HostUnreachable, SSHRunner
from psctl.runtime.checkpoint import Snapshot, write_checkpoint
from psctl.spec.model import HostSpec

pytestmark = pytest.mark.ssh

SLEEPER = "import time; print('ready', flush=True); time.sleep(600)"
# Ignores SIGTERM and has a child in its process group: only SIGKILL of the whole group ends both.
STUBBORN = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print('ready', flush=True); time.sleep(600)"
)


@pytest.fixture(scope="module")
def runners(sshbed: SSHBed) -> Iterator[dict[str, SSHRunner]]:
    made = {name: sshbed.runner(name) for name in sshbed.hosts}
    yield made
    for runner in made.values():
        runner.close()


@pytest.fixture
def cluster_id(sshbed: SSHBed) -> Iterator[str]:
    """A cluster id of the test's own; whatever still carries it afterwards is killed (and fails the test)."""
    cid = f"sshtest-{uuid.uuid4().hex[:8]}"
    yield cid
    left = {name: processes_with(sshbed, name, cid) for name in sshbed.hosts}
    for name, pids in left.items():
        for pid in pids:
            sshbed.exec(name, f"kill -9 -{pid} 2>/dev/null || kill -9 {pid}")
    assert not any(left.values()), f"processes of cluster {cid} left behind: {left}"


def processes_with(bed: SSHBed, name: str, cid: str) -> list[int]:
    """Pids (in the host's own process table) whose environment has PSCTL_CLUSTER_ID=cid, read with ps."""
    out = bed.exec(name, "ps axeww -o pid=,stat=,args=", check=True).stdout
    found = []
    for line in out.splitlines():
        pid, state, rest = [*line.split(None, 2), "", ""][:3]
        if f"PSCTL_CLUSTER_ID={cid}" in rest.split() and not state.startswith("Z"):
            found.append(int(pid))
    return found


def start_sleeper(runner: SSHRunner, cid: str, log: Path, code: str = SLEEPER) -> ProcessHandle:
    return runner.start(
        argv=[runner.spec.python, "-c", code],
        env={"PSCTL_CLUSTER_ID": cid, "PSCTL_TEST_HOST": runner.host},
        cwd=str(log.parent.parent),
        log_path=log,
    )


def is_gone(runner: SSHRunner, handle: ProcessHandle) -> bool:
    return runner.poll(handle) == UNKNOWN_EXIT


def raises_within(seconds: float, fn: Callable[[], object]) -> tuple[LaunchError, float]:
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        fn()
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"took {elapsed:.1f}s"
    return info.value, elapsed


# -- processes on every host ------------------------------------------------------------------------------
def test_start_poll_find_and_stop_on_every_host(
    sshbed: SSHBed, runners: dict[str, SSHRunner], cluster_id: str, tmp_path: Path
) -> None:
    cids = {name: f"{cluster_id}-{name}" for name in runners}
    logs = {name: tmp_path / name / "logs" / "role.log" for name in runners}  # the folder does not exist yet
    for name in runners:
        (tmp_path / name).mkdir()
    handles = check_results(
        run_on_all(list(runners.values()), lambda r: start_sleeper(r, cids[r.host], logs[r.host]))
    )
    assert sorted(handles) == sorted(runners)
    for name, handle in handles.items():
        runner = runners[name]
        assert handle.host == name and handle.create_time is not None
        assert abs(handle.create_time - time.time()) < 30
        assert runner.poll(handle) is None
        stale = dataclasses.replace(handle, create_time=handle.create_time - 5)  # same pid, another process
        assert runner.poll(stale) == UNKNOWN_EXIT
        runner.signal_group(stale, signal.SIGKILL)  # must not touch the live process that has the pid now
        assert runner.poll(handle) is None
        # its own session and process group, in that host's process table, running the sleeper once the
        # start's exec chain (setsid, nohup, env, python3) is through (ps shows "[python3]" mid-exec)
        def ps_row(name: str = name, pid: int = handle.pid) -> list[str] | None:
            row = sshbed.exec(name, f"ps -ww -o pid=,pgid=,sid=,args= -p {pid}").stdout.split(None, 3)
            return row if len(row) == 4 and "time.sleep(600)" in row[3] else None

        pid, pgid, sid, _ = wait_until(ps_row, timeout=10, what=f"the sleeper in {name}'s process table")
        assert int(pid) == int(pgid) == int(sid) == handle.pid
        environ = sshbed.exec(name, f"tr '\\0' '\\n' < /proc/{handle.pid}/environ").stdout.split()
        assert f"PSCTL_TEST_HOST={name}" in environ and f"PSCTL_CLUSTER_ID={cids[name]}" in environ
        assert runner.cluster_processes(cids[name]) == [handle]
        for other, other_runner in runners.items():
            if other != name:
                assert other_runner.cluster_processes(cids[name]) == []
        data = wait_until(partial(runner.read_file, str(logs[name])), timeout=10, what=f"{name}'s log")
        assert data == b"ready\n" and runner.read_file(str(logs[name]), 3) == b"dy\n"
        assert runner.read_file(str(logs[name]), 1, 3) == b"ead"  # (a long log is read a chunk at a time)
        assert runner.run(f"stat -c %a {logs[name]} {logs[name].parent}") == (0, "600\n700\n", "")

    check_results(run_on_all(list(runners.values()), lambda r: r.signal_group(handles[r.host], signal.SIGTERM)))
    for name, handle in handles.items():
        wait_until(partial(is_gone, runners[name], handle), timeout=10, what=f"{name} to stop")
        runners[name].signal_group(handle, signal.SIGTERM)  # gone already: not an error
    for name in runners:
        for cid in cids.values():
            assert runners[name].cluster_processes(cid) == []
            assert processes_with(sshbed, name, cid) == []


def test_stop_processes_escalates_to_the_whole_group(
    sshbed: SSHBed, runners: dict[str, SSHRunner], cluster_id: str, tmp_path: Path
) -> None:
    runner = runners["h1"]
    log = tmp_path / "logs" / "stubborn.log"
    handle = start_sleeper(runner, cluster_id, log, STUBBORN)
    wait_until(lambda: runner.read_file(str(log)) == b"ready\n", timeout=10, what="the stubborn role")
    assert len(runner.cluster_processes(cluster_id)) == 2  # the role and its child
    assert stop_processes(runner, [handle], grace=0.3) == []
    assert runner.poll(handle) == UNKNOWN_EXIT
    assert runner.cluster_processes(cluster_id) == [] and processes_with(sshbed, "h1", cluster_id) == []


def test_run_put_file_and_read_file(runners: dict[str, SSHRunner], tmp_path: Path) -> None:
    runner = runners["h2"]
    assert runner.run("echo out; echo err >&2; exit 3") == (3, "out\n", "err\n")
    assert runner.run("hostname") == (0, "h2\n", "")
    assert runner.run("kill -9 $$")[0] == -1  # killed by a signal: paramiko ignores exit-signal
    local = tmp_path / "secret"
    local.write_bytes(b"key material\n")
    remote = tmp_path / "remote" / "deep" / "secret"
    runner.put_file(local, str(remote))
    assert stat.S_IMODE(remote.stat().st_mode) == 0o600 and runner.read_file(str(remote)) == b"key material\n"
    local.write_bytes(b"replaced\n")
    runner.put_file(local, str(remote), 0o640)
    assert stat.S_IMODE(remote.stat().st_mode) == 0o640 and remote.read_bytes() == b"replaced\n"
    assert sorted(p.name for p in remote.parent.iterdir()) == ["secret"]  # no partial file left
    home_dir = f".psctl-sshtest-{uuid.uuid4().hex[:8]}"  # paths relative to the remote home, both spellings
    try:
        runner.put_file(local, f"~/{home_dir}/secret")
        assert runner.read_file(f"{home_dir}/secret") == b"replaced\n"
        assert runner.run(f"cat {home_dir}/secret") == (0, "replaced\n", "")
    finally:
        runner.run(f"rm -rf ~/{home_dir}")
    with pytest.raises(FileNotFoundError):  # as for a local file: `logs -f` waits for a log to appear
        runner.read_file(str(tmp_path / "missing.log"))
    with pytest.raises(LaunchError) as info:
        runner.read_file(str(tmp_path))  # a folder
    assert info.value.format_message().startswith(f"host h2: cannot read '{tmp_path}': ")


def test_a_new_run_on_a_host_keeps_the_last_ones_logs_and_results(
        runners: dict[str, SSHRunner], tmp_path: Path) -> None:
    """As on this machine: preparing a host for another run of a name keeps the run before's logs/ and run/
    under history/N (the KEPT_RUNS newest) where it used to delete them. (The bed's hosts share this file system.)"""
    hostdir = HostDir(PurePosixPath(tmp_path) / "digits")
    local = Path(str(hostdir.root))
    for run in range(1, KEPT_RUNS + 3):
        prepare_host(runners["h2"], hostdir, tls_files={}, staged=None, psctl_copy=None, setup=[])
        assert not any((local / "logs").iterdir()) and not any((local / "run").iterdir())  # a fresh start
        (local / "logs" / "chief-0.1.log").write_text(f"run {run}\n")
        (local / "run" / "result.json").write_text(f"{run}\n")
    prepare_host(runners["h2"], hostdir, tls_files={}, staged=None, psctl_copy=None, setup=[])
    kept = sorted((local / "history").iterdir(), key=lambda p: int(p.name))
    assert [int(p.name) for p in kept] == list(range(3, KEPT_RUNS + 3))
    for folder in kept:
        assert (folder / "logs" / "chief-0.1.log").read_text() == f"run {folder.name}\n"
        assert (folder / "run" / "result.json").read_text() == f"{folder.name}\n"
    assert stat.S_IMODE((local / "history").stat().st_mode) == 0o700


def test_start_in_a_missing_folder_fails_clearly(runners: dict[str, SSHRunner], tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as info:
        runners["h1"].start(argv=["true"], env={}, cwd="/nope/work", log_path=tmp_path / "x.log")
    assert info.value.format_message() == (
        "host h1: cannot start true: sh: 1: cd: can't cd to /nope/work; check the working folder '/nope/work' "
        "and the log folder exist or can be created"
    )


def test_command_timeout_on_a_live_host(runners: dict[str, SSHRunner]) -> None:
    runner = runners["h1"]
    error, _ = raises_within(3.0, lambda: runner.run("sleep 5", timeout=0.5))
    assert error.format_message() == "host h1: command timed out after 0.5s: sleep 5"
    assert runner.run("true") == (0, "", "")


def test_check_python(sshbed: SSHBed, runners: dict[str, SSHRunner]) -> None:
    expected = subprocess.run([sshbed.python, "-c", "import platform; print(platform.python_version())"],
                              capture_output=True, text=True, check=True).stdout.strip()
    assert runners["h1"].check_python() == expected
    with sshbed.runner("h1", python="/nope/python3") as runner:
        for call in (runner.check_python, lambda: runner.cluster_processes("x")):
            with pytest.raises(LaunchError) as info:
                call()
            assert info.value.format_message() == "host h1: python '/nope/python3' not found; set hosts[].python"
    with sshbed.runner("h1", python="/bin/sh") as runner, pytest.raises(LaunchError) as info:
        runner.check_python()
    message = info.value.format_message()
    assert message.startswith("host h1: python '/bin/sh' is not a Python (it said: "), message
    assert message.endswith("); set hosts[].python to a python >= 3.10") and len(message) < 250, message


# -- connection errors ------------------------------------------------------------------------------------
def test_constructor_does_no_io_and_close_is_repeatable() -> None:
    runner = SSHRunner(HostSpec(name="hx", address="10.231.0.99"))
    runner.close()
    runner.close()


def test_unreachable_address(sshbed: SSHBed) -> None:
    with SSHRunner(sshbed.spec("h1", name="hx", address="10.231.0.99"), ssh_config=None) as runner:
        error, _ = raises_within(6.5, lambda: runner.run("true"))
    assert isinstance(error, HostUnreachable)
    assert error.format_message() == (
        "host hx (10.231.0.99:22): unreachable: no route to host; check the address and the network"
    )


def test_wrong_key(sshbed: SSHBed, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    with sshbed.runner("h1", identity_file=str(sshbed.other_key)) as runner, pytest.raises(LaunchError) as info:
        runner.run("true")
    assert info.value.format_message() == (
        "host h1: authentication failed for user root; check identity_file or ssh-agent"
    )
    with sshbed.runner("h1", identity_file="/nope/key") as runner, pytest.raises(LaunchError) as info:
        runner.run("true")
    assert info.value.format_message() == "host h1: identity_file '/nope/key' not found; set hosts[].identity_file"


def test_unknown_host_key_is_rejected(sshbed: SSHBed, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts"
    empty.touch()
    with SSHRunner(sshbed.spec("h1"), known_hosts=empty, ssh_config=None) as runner, pytest.raises(
        LaunchError
    ) as info:
        runner.run("true")
    assert info.value.format_message() == (
        "host h1: unknown host key; add it to known_hosts (ssh-keyscan) or set host_key_policy: accept-new"
    )
    assert empty.read_text() == ""


def test_run_on_all_reports_every_host(sshbed: SSHBed, runners: dict[str, SSHRunner]) -> None:
    refused = SSHRunner(sshbed.spec("h3", name="bad", port=2222), known_hosts=sshbed.known_hosts, ssh_config=None)
    silent = SSHRunner(sshbed.spec("h3", name="hx", address="10.231.0.99"), ssh_config=None)
    start = time.monotonic()
    results = run_on_all([runners["h1"], refused, runners["h2"], silent], lambda r: r.run("hostname")[1].strip())
    assert time.monotonic() - start < 6.5  # in parallel: the slowest host, not the sum
    assert results["h1"] == "h1" and results["h2"] == "h2"
    assert isinstance(results["bad"], HostUnreachable) and isinstance(results["hx"], HostUnreachable)
    with pytest.raises(HostsError) as info:
        check_results(results)
    assert info.value.format_message() == (
        "2 of 4 hosts failed:\n"
        "  host bad (10.231.0.13:2222): unreachable: connection refused; check the port and that sshd runs\n"
        "  host hx (10.231.0.99:22): unreachable: no route to host; check the address and the network"
    )
    assert info.value.succeeded == {"h1": "h1", "h2": "h2"} and set(info.value.failures) == {"bad", "hx"}
    assert check_results(run_on_all([runners["h1"], runners["h2"]], lambda r: r.host)) == {"h1": "h1", "h2": "h2"}


def test_resolve_uses_ssh_config_for_what_the_spec_leaves_open(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text(
        "Host alias\n  HostName 10.231.0.11\n  User admin\n  Port 2200\n  IdentityFile /keys/id\n"
        "  UserKnownHostsFile /keys/known\n"
    )
    target = hosts.resolve(HostSpec(name="h1", address="alias"), ssh_config=config)
    assert (target.hostname, target.port, target.user, target.key_filenames) == ("10.231.0.11", 2200, "admin",
                                                                                  ("/keys/id",))
    assert target.known_hosts == Path("/keys/known") and target.known_hosts_name == "[10.231.0.11]:2200"
    spec = HostSpec(name="h1", address="alias", user="root", port=22, identity_file="/mine")
    target = hosts.resolve(spec, ssh_config=config, known_hosts=tmp_path / "kh")
    assert (target.user, target.key_filenames, target.known_hosts) == ("root", ("/mine",), tmp_path / "kh")


def test_resolve_follows_proxy_jump_chains_and_connect_timeout(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text(
        "Host inner\n  HostName 10.0.0.9\n  ProxyJump gw2\n  ConnectTimeout 7\n"
        "Host gw2\n  HostName 10.0.0.2\n  User hop\n  ProxyJump admin@gw1:2222\n"
        "Host gw1\n  HostName 10.0.0.1\n  IdentityFile /keys/gw1\n"
        "Host loop\n  ProxyJump loop\n"
        "Host viacmd\n  ProxyCommand nc %h %p\n"
    )
    target = hosts.resolve(HostSpec(name="h9", address="inner", identity_file="/keys/id"), ssh_config=config)
    assert (target.hostname, target.connect_timeout) == ("10.0.0.9", 7.0)
    gw2 = target.jump
    assert gw2 is not None and (gw2.hostname, gw2.user, gw2.port, gw2.key_filenames) == (
        "10.0.0.2", "hop", 22, ("/keys/id",))  # no key of its own: the host's
    gw1 = gw2.jump
    assert gw1 is not None and (gw1.hostname, gw1.user, gw1.port, gw1.key_filenames, gw1.jump) == (
        "10.0.0.1", "admin", 2222, ("/keys/gw1",), None)
    # The spec's proxy_jump wins over the config, and "none" turns the config's off.
    spec = HostSpec(name="h9", address="inner", proxy_jump="u@[fd00::1]:2022,10.0.0.3")
    target = hosts.resolve(spec, ssh_config=config)
    assert target.jump is not None and target.jump.hostname == "10.0.0.3"
    assert target.jump.jump is not None and (target.jump.jump.user, target.jump.jump.hostname,
                                             target.jump.jump.port) == ("u", "fd00::1", 2022)
    assert hosts.resolve(HostSpec(name="h9", address="inner", proxy_jump="none"), ssh_config=config).jump is None
    with pytest.raises(hosts.ConfigError, match="more than 8 ProxyJump hops"):
        hosts.resolve(HostSpec(name="h", address="loop"), ssh_config=config)
    with pytest.raises(hosts.ConfigError, match="ProxyCommand is not supported"):
        hosts.resolve(HostSpec(name="h", address="viacmd"), ssh_config=config)


def test_a_jump_host_whose_name_resolves_to_nothing_blames_proxy_jump(monkeypatch: pytest.MonkeyPatch) -> None:
    """(The name lookup fails here without asking any resolver: the message is what is tested.)"""
    import socket

    from psctl.launch import ssh

    def no_such_name(address: tuple[str, int], timeout: float | None = None) -> socket.socket:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(ssh.socket, "create_connection", no_such_name)
    runner = SSHRunner(HostSpec(name="h1", address="10.0.0.9", proxy_jump="bastion"), ssh_config=None)
    with pytest.raises(LaunchError) as caught:
        runner.run("true")
    assert caught.value.format_message() == (
        "host h1: jump host bastion:22: unreachable: unknown address; check hosts[].proxy_jump of h1: 'bastion' is "
        "neither a host of the spec nor an address this machine resolves")
    runner.close()


def test_a_jump_through_a_host_of_the_spec_uses_that_hosts_settings_and_jumps() -> None:
    gw1 = HostSpec(name="gw1", address="10.0.0.1", user="ops", port=2222, identity_file="/keys/gw1",
                   host_key_policy="accept-new")
    gw2 = HostSpec(name="gw2", address="10.0.0.2", identity_file="/keys/gw2", proxy_jump="gw1", jump_hosts=(gw1,))
    host = HostSpec(name="h", address="10.0.0.9", identity_file="/keys/h", proxy_jump="gw2", jump_hosts=(gw2,))
    target = hosts.resolve(host, ssh_config=None)
    hop2 = target.jump
    assert hop2 is not None and (hop2.hostname, hop2.key_filenames) == ("10.0.0.2", ("/keys/gw2",))
    hop1 = hop2.jump  # gw2's own jump host, with gw1's settings
    assert hop1 is not None and (hop1.hostname, hop1.user, hop1.port, hop1.key_filenames, hop1.host_key_policy,
                                 hop1.jump) == ("10.0.0.1", "ops", 2222, ("/keys/gw1",), "accept-new", None)
    # hops written before a host of the spec replace that host's own jumps (OpenSSH's -J a,b)
    via = hosts.resolve(dataclasses.replace(host, proxy_jump="root@10.0.0.7,gw2"), ssh_config=None)
    assert via.jump is not None and via.jump.jump is not None
    assert (via.jump.hostname, via.jump.jump.hostname, via.jump.jump.user) == ("10.0.0.2", "10.0.0.7", "root")
    with pytest.raises(hosts.ConfigError, match="port 1-65535"):
        hosts.resolve(dataclasses.replace(host, proxy_jump="root@10.0.0.7:99999"), ssh_config=None)
    # the supervisor reads the hosts back from the cluster's state file: the jump hosts survive the round trip
    stored = json.loads(json.dumps(RemoteHost(host, "/w").to_dict()))
    assert RemoteHost.from_dict(stored).spec == host


def test_a_host_reached_only_through_a_jump_host(sshbed: SSHBed) -> None:
    """h2 accepts SSH only from the other hosts: reached through h1 (ProxyJump), commands and SFTP work."""
    sshbed.ssh_only_from_hosts("h2")
    try:
        with SSHRunner(sshbed.spec("h2"), known_hosts=sshbed.known_hosts, ssh_config=None,
                       connect_timeout=2) as direct, pytest.raises(HostUnreachable) as info:
            direct.run("true")
        assert "connection timed out after 2s" in info.value.format_message()
        h1 = sshbed.hosts["h1"].address
        with sshbed.runner("h2", proxy_jump=f"root@{h1}:22") as runner:
            assert runner.run("hostname") == (0, "h2\n", "")
            runner.put_bytes(b"through the jump\n", "/tmp/psctl-jump-test", mode=0o600)
            assert runner.read_file("/tmp/psctl-jump-test") == b"through the jump\n"
            runner.run("rm -f /tmp/psctl-jump-test")
        # The jump host's key is verified like any host's.
        with SSHRunner(sshbed.spec("h2", proxy_jump=h1), known_hosts=sshbed.known_hosts.with_name("none"),
                       ssh_config=None) as runner, pytest.raises(LaunchError) as info:
            runner.run("true")
        assert info.value.format_message() == (
            f"host h2: jump host {h1}:22: unknown host key; add it to known_hosts (ssh-keyscan) or set "
            "host_key_policy: accept-new"
        )
    finally:
        sshbed.heal("h2")


def test_fetch_newest_skips_a_corrupt_checkpoint_and_refuses_paths_outside_it(sshbed: SSHBed, tmp_path: Path) -> None:
    """export's copy over SFTP: the newest checkpoint that verifies; a manifest cannot name files elsewhere."""
    folder = tmp_path / "ckpts"  # the test hosts share this machine's file system
    for step in (100, 200, 300):
        write_checkpoint(folder, Snapshot(step, [step], {"w": np.full((3, 2), step, np.float32)}, {}))
    (folder / "ckpt-000000000300" / "arrays.npz").write_bytes(b"truncated")  # the newest is corrupt
    evil = folder / "ckpt-000000000200" / "manifest.json"
    manifest = json.loads(evil.read_text())
    manifest["files"]["../../escaped"] = {"bytes": 1, "sha256": "0"}
    evil.write_text(json.dumps(manifest))
    into = tmp_path / "fetched"
    into.mkdir()
    with sshbed.runner("h1") as runner:
        where, snapshot = fetch_newest(runner, str(folder), into)
        assert where == f"h1:{folder}/ckpt-000000000100"
        assert snapshot.global_step == 100 and snapshot.variables["w"].tolist() == [[100.0, 100.0]] * 3
        assert not (tmp_path / "escaped").exists()
        with pytest.raises(CheckpointNotFound, match=f"no checkpoint folder {tmp_path}/none on h1"):
            fetch_newest(runner, str(tmp_path / "none"), into)


# -- faults (these restart hosts: keep them last) ---------------------------------------------------------
def test_partition_is_reported_within_seconds_and_heals(sshbed: SSHBed) -> None:
    with SSHRunner(sshbed.spec("h3"), known_hosts=sshbed.known_hosts, ssh_config=None,
                   connect_timeout=2, command_timeout=2) as runner:
        assert runner.run("true") == (0, "", "")
        sshbed.partition("h3")
        try:
            error, _ = raises_within(4.0, lambda: runner.run("true"))
            assert error.format_message() == (
                "host h3 (10.231.0.13:22): unreachable: no reply within 2s; check that the host is up and the "
                "network (the next call reconnects)"
            )
            error, _ = raises_within(4.0, lambda: runner.run("true"))
            assert error.format_message() == (
                "host h3 (10.231.0.13:22): unreachable: connection timed out after 2s; check the address and "
                "that sshd runs"
            )
        finally:
            sshbed.heal("h3")
        assert runner.run("hostname") == (0, "h3\n", "")
        sshbed.partition("h3", how="link")
        try:
            error, _ = raises_within(4.0, lambda: runner.run("true"))
            assert isinstance(error, HostUnreachable)
        finally:
            sshbed.heal("h3")
        assert runner.run("hostname") == (0, "h3\n", "")


def test_frozen_host_is_reported_within_seconds(sshbed: SSHBed) -> None:
    with SSHRunner(sshbed.spec("h3"), known_hosts=sshbed.known_hosts, ssh_config=None,
                   connect_timeout=2, command_timeout=2) as runner:
        assert runner.run("true") == (0, "", "")
        sshbed.freeze("h3")
        try:
            error, _ = raises_within(4.0, lambda: runner.run("true"))
        finally:
            sshbed.thaw("h3")
        assert error.format_message() == (
            "host h3 (10.231.0.13:22): unreachable: no reply within 2s; check that the host is up and the "
            "network (the next call reconnects)"
        )
        assert runner.run("hostname") == (0, "h3\n", "")


def test_crashed_host_is_reported_within_seconds_and_reconnects(
    sshbed: SSHBed, runners: dict[str, SSHRunner], cluster_id: str, tmp_path: Path
) -> None:
    runner = runners["h2"]
    handle = start_sleeper(runner, cluster_id, tmp_path / "logs" / "role.log")
    assert runner.poll(handle) is None
    sshbed.kill_sshd("h2")  # PID 1 of h2: every process on it dies
    try:
        expected = "host h2 (10.231.0.12:22): unreachable: connection refused; check the port and that sshd runs"
        for call in (lambda: runner.poll(handle), lambda: runner.run("true")):
            error, _ = raises_within(8.0, call)
            assert isinstance(error, HostUnreachable) and error.format_message() == expected
    finally:
        sshbed.restart_sshd("h2")
    assert runner.run("hostname") == (0, "h2\n", "")
    assert runner.poll(handle) == UNKNOWN_EXIT  # a fresh process table: its pid may be taken, not by it
    assert runner.cluster_processes(cluster_id) == []


def test_accept_new_records_the_key_and_a_changed_key_is_refused(sshbed: SSHBed, tmp_path: Path) -> None:
    known = tmp_path / "ssh" / "known_hosts"  # neither exists yet
    key_before = sshbed.known_hosts.read_text().splitlines()[0]  # h1's line
    with SSHRunner(sshbed.spec("h1", host_key_policy="accept-new"), known_hosts=known, ssh_config=None) as runner:
        assert runner.run("hostname") == (0, "h1\n", "")
    assert known.read_text() == key_before + "\n"
    assert stat.S_IMODE(known.stat().st_mode) == 0o600 and stat.S_IMODE(known.parent.stat().st_mode) == 0o700
    with SSHRunner(sshbed.spec("h1"), known_hosts=known, ssh_config=None) as runner:  # reject: now known
        assert runner.run("true") == (0, "", "")

    sshbed.regenerate_host_key("h1")
    changed = SSHRunner(sshbed.spec("h1", host_key_policy="accept-new"), known_hosts=known, ssh_config=None)
    with changed, pytest.raises(LaunchError) as info:
        changed.run("true")
    assert info.value.format_message() == (
        f"host h1: host key CHANGED (possible attack); remove the old key from {known} if the change is expected"
    )
    assert known.read_text() == key_before + "\n"  # nothing recorded
    with sshbed.runner("h1") as runner:  # the bed's known_hosts has the new key
        assert runner.run("hostname") == (0, "h1\n", "")


@pytest.mark.parametrize("printed", ['{"python": "3.11"}', '{"python": "3.11", "psctl": null, "cpus": "many", '
                                     '"free": 1, "times": [0, 0], "missing": [], "busy": []}'])
def test_a_host_whose_python_prints_an_odd_report_is_a_one_line_error(sshbed: SSHBed, tmp_path: Path,
                                                                       printed: str) -> None:
    """(hosts[].python a wrapper that prints something else last: `up` ended in a KeyError's traceback.)"""
    fake = tmp_path / "odd-python"
    fake.write_text(f"#!/bin/sh\necho '{printed}'\n")
    fake.chmod(0o755)
    with sshbed.runner("h1", python=str(fake)) as runner, pytest.raises(LaunchError) as caught:
        preflight(runner, {}, {})
    assert caught.value.format_message().startswith(
        f"host h1: python {str(fake)!r} printed a report psctl cannot read ("), caught.value.format_message()


def test_the_preflight_finds_tensorflow_installed_without_importing_it(tmp_path: Path) -> None:
    """The host's script (run here with this python, as SSH runs it there): a module of LOCATED_MODULES is only
    looked for (TensorFlow's import takes seconds on every host, on every `psctl up`), any other is imported."""
    (tmp_path / "tensorflow").mkdir()  # installed, but breaks when imported: found, so not imported
    (tmp_path / "tensorflow" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (tmp_path / "brokenmod").mkdir()
    (tmp_path / "brokenmod" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    assert "tensorflow" in LOCATED_MODULES and "brokenmod" not in LOCATED_MODULES

    def missing(modules: list[str], located: list[str]) -> list[str]:
        args = json.dumps({"modules": modules, "located": located, "ports": [], "workdir": str(tmp_path)})
        done = subprocess.run([sys.executable, "-c", _PREFLIGHT, args], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=True)
        return list(json.loads(done.stdout.strip().splitlines()[-1])["missing"])

    assert missing(["numpy", "tensorflow", "brokenmod"], ["tensorflow"]) == ["brokenmod"]
    assert missing(["tensorflow"], []) == ["tensorflow"]  # imported, it fails: what the located check skips
    assert missing(["nosuchmodule_psctl"], ["nosuchmodule_psctl"]) == ["nosuchmodule_psctl"]
