"""A real Slurm cluster on this machine for the Slurm backend's tests: munge, slurmctld and one slurmd (Debian's
packages ``slurmctld slurmd munge``; ``.ci/run`` installs them), started by the ``slurm`` fixture with a
configuration of its own (``SLURM_CONF``) and stopped after. One node named ``localhost`` claims 16 CPUs and
oversubscribes them, so a whole psctl cluster fits in one allocation on a 2-core machine.

The fixture skips where root or the daemons are missing, except under ``CI`` where it fails (as the SSH bed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sshbed import skip_or_fail

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
CONFIG = """\
ClusterName=psctltest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
KillWait=10
InactiveLimit=0
MinJobAge=5
NodeName=localhost CPUs=16 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=60 State=UP OverSubscribe=FORCE:4
PartitionName=short Nodes=ALL MaxTime=5 State=UP OverSubscribe=FORCE:4
"""


@dataclass
class SlurmBed:
    root: Path
    conf: Path

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=60, check=check)

    def jobs(self) -> list[str]:
        """Ids of the jobs Slurm knows now (pending, running, completing)."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def steps(self, job: str) -> dict[str, str]:
        """The running steps of ``job``: name -> step id (``JOB.STEP``)."""
        out = self.run("squeue", "-h", "-s", "-j", job, "-o", "%i %j").stdout
        return {name: step for step, name in (line.split(None, 1) for line in out.splitlines() if " " in line)}

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in (self.root / "slurmctld.log",
                                                                          self.root / "slurmd.log") if p.exists())


def _munge_running() -> bool:
    return subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0


def _start_munge() -> None:
    if _munge_running():
        return
    os.makedirs("/run/munge", exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, capture_output=True, timeout=30)


def _wait_idle(bed: SlurmBed, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = bed.run("sinfo", "-h", "-o", "%t", check=False).stdout.split()
        if out and all(state in ("idle", "mix", "alloc") for state in out):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the Slurm node did not come up within {timeout:.0f}s:\n{bed.logs()}")


def slurmbed_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmBed]:
    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if os.geteuid() != 0:
        skip_or_fail("the Slurm tests start slurmctld, slurmd and munged: they need root")
    if missing:
        skip_or_fail(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd munge")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(CONFIG.format(root=root, ctld_port=16817, d_port=16818))
    bed = SlurmBed(root, conf)
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        _start_munge()
        for daemon in ("slurmctld", "slurmd"):
            with open(root / f"{daemon}.out", "wb") as out:
                daemons.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env={**os.environ, **bed.env},
                                                start_new_session=True, stdout=out, stderr=subprocess.STDOUT))
        _wait_idle(bed)
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        for proc in daemons:
            os.killpg(proc.pid, signal.SIGKILL)
        skip_or_fail(f"the Slurm test bed could not start: {exc}")
    try:
        yield bed
    finally:
        for job in bed.jobs():
            bed.run("scancel", job, check=False)
        for proc in daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in daemons:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)

