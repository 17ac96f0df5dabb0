"""A cluster of the test's PSCTL_HOME, started with ``psctl up --detach`` and read through its files as an
operator would (state.json, events.jsonl, run/metrics.jsonl, the roles' logs): what the fault and chaos tests
drive and assert on."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import psutil
from cluster_helpers import wait_until
from conftest import PsctlEnv

from psctl.runtime.metrics import read_metrics

FINISHED = ("succeeded", "failed", "stopped")


class SupervisedCluster:
    def __init__(self, penv: PsctlEnv, name: str, spec_text: str) -> None:
        self.penv = penv
        self.name = name
        self.root = penv.home / name
        self.spec = penv.tmp_path / f"{name}.yaml"
        self.spec.write_text(spec_text, encoding="utf-8")

    # -- commands -------------------------------------------------------------------------------------
    def up(self, timeout: float = 90) -> str:
        """``psctl up --detach``; returns the cluster id (registered for the fixture's teardown)."""
        done = self.penv.run("up", "--detach", str(self.spec), timeout=timeout)
        assert done.returncode == 0, f"psctl up failed ({done.returncode}): {done.stdout}\n{done.stderr}"
        return str(self.penv.state(self.name)["cluster_id"])

    def status(self) -> dict[str, Any]:
        done = self.penv.run("status", self.name, "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    # -- files ----------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return self.penv.state(self.name)

    def role(self, role: str) -> dict[str, Any]:
        return self.penv.role(self.name, role)

    def progress_records(self) -> list[dict[str, Any]]:
        return [r for r in read_metrics(self.root / "run" / "metrics.jsonl") if r.get("event") == "progress"]

    def progress(self) -> int:
        """The chief's latest reported global step (what ``psctl status`` shows)."""
        records = self.progress_records()
        return int(records[-1]["global_step"]) if records else 0

    def events(self, role: str | None = None) -> list[dict[str, Any]]:
        try:
            lines = (self.root / "events.jsonl").read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        events = [json.loads(line) for line in lines if line.strip()]
        return [e for e in events if role is None or e["role"] == role]

    def log(self, role: str) -> str:
        """Every attempt's log of ``role``, in order."""
        logs = sorted((self.root / "logs").glob(f"{role}.*.log"), key=lambda p: int(p.name.split(".")[-2]))
        return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in logs)

    def result(self) -> dict[str, Any]:
        return json.loads((self.root / "run" / "result.json").read_text())  # type: ignore[no-any-return]

    def finished(self) -> bool:
        return str(self.state()["state"]) in FINISHED

    def describe(self) -> str:
        """What went on, for assertion messages: roles, the last events, the chief's log."""
        try:
            state = self.state()
            roles = ", ".join(f"{r['name']} {r['state']} attempt {r['attempt']}" for r in state["roles"])
            head = f"cluster {state['state']} ({state.get('reason', '')}); {roles}"
        except (OSError, ValueError, KeyError) as exc:
            head = f"no state: {exc}"
        events = "\n".join(json.dumps(e) for e in self.events()[-25:])
        return f"{head}\nevents:\n{events}\nchief log:\n{self.log('chief-0')[-3000:]}"

    # -- processes ------------------------------------------------------------------------------------
    def process(self, role: str) -> psutil.Process:
        """The live process of ``role``: the pid in state.json, checked by creation time and environment."""
        record = self.role(role)
        proc = psutil.Process(record["pid"])
        assert abs(proc.create_time() - record["create_time"]) < 0.05, f"pid {record['pid']} was reused"
        env = proc.environ()
        assert env.get("PSCTL_ROLE") == role and env.get("PSCTL_CLUSTER_ID") == self.state()["cluster_id"], env
        return proc

    # -- waiting --------------------------------------------------------------------------------------
    def wait_finished(self, timeout: float) -> dict[str, Any]:
        """Wait until the cluster has finished; it must have succeeded. Returns its state."""
        wait_until(self.finished, timeout=timeout, interval=0.2, what=f"cluster {self.name} to finish",
                   detail=self.describe)
        state = self.state()
        assert state["state"] == "succeeded", self.describe()
        return state


def gone(proc: psutil.Process) -> bool:
    """Dead, or a zombie awaiting its supervisor's reaping."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def sigkill(proc: psutil.Process) -> float:
    """SIGKILL ``proc`` and wait until it is dead; returns when the signal was sent (time.time())."""
    sent = time.time()
    proc.send_signal(signal.SIGKILL)
    wait_until(lambda: gone(proc), timeout=10, what=f"pid {proc.pid} to die")
    return sent

