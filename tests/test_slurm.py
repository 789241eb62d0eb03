"""scripts/slurm_train.sbatch under a real single-node Slurm (issue 32): Debian's slurm-wlm and munge,
started here as root on this machine (munged, slurmctld and slurmd on free ports, in a temporary
folder, stopped afterwards). Nothing is a stand-in: sbatch, srun, scancel and scontrol are Slurm's
own; the job trains on the CPU XLA device with two workers (torchrun, gloo). Skipped, saying why,
only when this is not root or slurm-wlm cannot be installed with apt-get.

What it proves: a job trains, a second job resumes it and the run keeps one summary; a job cancelled
(scancel) or whose node is lost (the node set DOWN) leaves a run that a new job resumes and finishes;
a job Slurm requeues after its node is lost (Slurm's default) continues its run by itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, cpu_env

SBATCH = ROOT / "scripts" / "slurm_train.sbatch"
TRAIN = ["--model", "vit-nano", "--checkpoint-every", "2", "--no-progress", "--no-tensorboard", "--num-workers", "0"]
pytestmark = pytest.mark.slow  # daemons, and training jobs of a minute or more each


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _slurm_installed() -> str | None:
    """None when slurmd is here (installed now if need be), else why the tests are skipped."""
    if os.geteuid() != 0:
        return "starting munged, slurmctld and slurmd needs root"
    if shutil.which("slurmd") and shutil.which("munged"):
        return None
    if not shutil.which("apt-get"):
        return "no slurmd here and no apt-get to install slurm-wlm and munge"
    proc = subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"],
                          capture_output=True, text=True, timeout=900, env={**os.environ,
                                                                            "DEBIAN_FRONTEND": "noninteractive"})
    if proc.returncode != 0 or not shutil.which("slurmd"):
        return f"apt-get could not install slurm-wlm and munge: {(proc.stderr or proc.stdout).strip()[-300:]}"
    return None


def _conf(base: Path, host: str) -> str:
    return "\n".join([
        "ClusterName=ci", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        # cred_expire is also how long a requeued job waits before it starts again (default 120 s)
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={base}/munge.sock,cred_expire=45",
        f"StateSaveLocation={base}/state", f"SlurmdSpoolDir={base}/spool",
        f"SlurmctldPidFile={base}/slurmctld.pid", f"SlurmdPidFile={base}/slurmd.pid",
        f"SlurmctldLogFile={base}/slurmctld.log", f"SlurmdLogFile={base}/slurmd.log",
        # No cgroups in a CI container: processes are tracked by their parent ids.
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "ReturnToService=2",
        "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
        f"NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN",
        f"PartitionName=ci Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""])


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running single-node Slurm; yields the environment its clients (and the jobs) need."""
    if why := _slurm_installed():
        pytest.skip(why)
    base = tmp_path_factory.mktemp("slurm")
    (base / "state").mkdir()
    (base / "spool").mkdir()
    key = base / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname()
    (base / "slurm.conf").write_text(_conf(base, host))
    env = {k: v for k, v in cpu_env().items() if not k.startswith(("SLURM", "NEURON_"))}
    env.update(SLURM_CONF=str(base / "slurm.conf"), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    started = []
    try:
        # --force: munged as root, with a key of this test's own (both refused by default)
        for argv, pid in ((["munged", "--force", f"--key-file={key}", f"--socket={base}/munge.sock",
                            f"--pid-file={base}/munged.pid", f"--log-file={base}/munged.log",
                            f"--seed-file={base}/munged.seed"], base / "munged.pid"),
                          (["slurmctld"], base / "slurmctld.pid"), (["slurmd"], base / "slurmd.pid")):
            subprocess.run(argv, env=env, check=True, capture_output=True, timeout=60)
            started.append(pid)
        for _ in range(60):
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout
            if state.strip() == "idle":
                break
            time.sleep(1)
        else:
            pytest.fail(f"the Slurm node never became idle: {state!r}; {(base / 'slurmd.log').read_text()[-2000:]}")
        yield env
    finally:
        for pid_file in reversed(started):  # only the daemons this fixture started, by their pid
            try:
                os.kill(int(pid_file.read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass


def job_env(slurm: dict, tmp_path: Path) -> dict:
    return {**slurm, "NEURON_TRAIN_VENV": "", "NEURON_TRAIN_PROCS_PER_NODE": "2", "NEURON_TRAIN_DOCTOR": "0",
            "NEURON_TRAIN_CACHE_DIR": str(tmp_path / "cache"), "NEURON_TRAIN_RDZV_PORT": str(free_port())}


def submit(env: dict, tmp_path: Path, *train: str, wait: bool = True,
           requeue: bool = True) -> tuple[str, subprocess.CompletedProcess]:
    """sbatch the real script on the one node (--nodes=1 overrides its #SBATCH --nodes=2)."""
    proc = subprocess.run(["sbatch", "--parsable", *(["--wait"] if wait else []), "--nodes=1",
                           *([] if requeue else ["--no-requeue"]),
                           f"--output={tmp_path}/job-%j.out", str(SBATCH), *TRAIN, *train],
                          env=env, capture_output=True, text=True, timeout=900)
    job = proc.stdout.strip().split(";")[0]
    return job, proc


def output(tmp_path: Path, job: str) -> str:
    return (tmp_path / f"job-{job}.out").read_text(errors="replace")


def test_a_job_trains_a_second_resumes_and_the_run_has_one_summary(slurm, tmp_path):
    env, run = job_env(slurm, tmp_path), tmp_path / "run"
    first, proc = submit(env, tmp_path, "--max-steps", "4", "--output-dir", str(run))
    assert proc.returncode == 0, proc.stderr + output(tmp_path, first)[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    second, proc = submit(env, tmp_path, "--max-steps", "6", "--output-dir", str(run), "--resume")
    assert proc.returncode == 0, proc.stderr + output(tmp_path, second)[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"]) == (6, 2)
    assert summary["resumed_from"] == str(run / "checkpoints" / "step-00000004.pt")
    assert sorted(p.name for p in run.glob("summary*")) == ["summary.json"]  # one summary, replaced whole
    assert "slurm_train: 1 nodes" in output(tmp_path, first)


def wait_for_checkpoint(run: Path, job: str, env: dict, tmp_path: Path) -> None:
    for _ in range(600):
        if list((run / "checkpoints").glob("*.pt.sha256")):
            return
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True)
        assert state.stdout.strip(), f"job {job} ended before its first checkpoint: {output(tmp_path, job)[-3000:]}"
        time.sleep(1)
    pytest.fail(f"no checkpoint of job {job} after 10 minutes")


def wait_gone(job: str, env: dict) -> str:
    for _ in range(180):
        if not subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip():
            break
        time.sleep(1)
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in shown.split() if w.startswith("JobState=")), "")


def wait_processes_gone(run: Path) -> None:
    """Until no process of the job is left: its run directory is in their command lines (the batch
    script, torchrun's agent with its rendezvous store, the workers with the run's lock)."""
    needle = str(run).encode()

    def running() -> bool:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if needle in cmdline.read_bytes():
                    return True
            except OSError:
                pass  # gone meanwhile
        return False

    for _ in range(120):
        if not running():
            return
        time.sleep(1)
    pytest.fail(f"processes of {run} still running 2 minutes after their job ended")


def lose_the_node(env: dict) -> None:
    """The node is lost: Slurm kills what ran there, then (ReturnToService=2) takes it back."""
    host = socket.gethostname()
    subprocess.run(["scontrol", "update", f"NodeName={host}", "State=DOWN", "Reason=lost-in-test"], env=env,
                   check=True)
    subprocess.run(["scontrol", "update", f"NodeName={host}", "State=RESUME"], env=env, capture_output=True)


@pytest.mark.parametrize("how", ["scancel", "node-lost"])
def test_a_job_cancelled_or_on_a_lost_node_leaves_a_run_a_new_job_finishes(slurm, tmp_path, how):
    env, run = job_env(slurm, tmp_path), tmp_path / "run"
    # --no-requeue: the lost node ends the job (NODE_FAIL) rather than starting it again
    job, proc = submit(env, tmp_path, "--max-steps", "100000", "--output-dir", str(run), wait=False, requeue=False)
    assert proc.returncode == 0, proc.stderr
    wait_for_checkpoint(run, job, env, tmp_path)
    if how == "scancel":  # SIGTERM to the job's steps, then SIGKILL after KillWait
        subprocess.run(["scancel", job], env=env, check=True)
    else:
        lose_the_node(env)
    assert wait_gone(job, env) in ("CANCELLED", "NODE_FAIL", "FAILED"), output(tmp_path, job)[-3000:]
    if how == "scancel":  # the loop's SIGTERM path: a checkpoint at the step boundary, and how to go on
        assert ("stopped by SIGTERM at step" in output(tmp_path, job)
                and "continue with --resume" in output(tmp_path, job))
    # Slurm ends the job at once, but on a node that is still up its processes may take a while to
    # stop (SIGTERM: a checkpoint at the step boundary). Until then the run is theirs (its lock) and
    # so is the rendezvous port (the agent's store): a new job would be refused, or meet the old store.
    wait_processes_gone(run)
    newest = max((run / "checkpoints").glob("step-*.pt"))
    step = int(newest.stem.split("-")[1])
    for _ in range(60):  # the node back in service
        if subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                          text=True).stdout.strip() == "idle":
            break
        time.sleep(1)
    again, proc = submit(env, tmp_path, "--max-steps", str(step + 2), "--output-dir", str(run), "--resume")
    assert proc.returncode == 0, proc.stderr + output(tmp_path, again)[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"], summary["resumed_from"]) == (step + 2, 2, str(newest))


def test_a_job_requeued_after_its_node_is_lost_continues_its_run(slurm, tmp_path):
    """Slurm requeues a batch job whose node failed and runs its script again with the same flags:
    the script adds --resume, so the second start continues from the newest checkpoint instead of
    being refused ("already holds a run")."""
    env, run = job_env(slurm, tmp_path), tmp_path / "run"
    job, proc = submit(env, tmp_path, "--max-steps", "100000", "--output-dir", str(run), wait=False)
    assert proc.returncode == 0, proc.stderr
    wait_for_checkpoint(run, job, env, tmp_path)
    lose_the_node(env)
    for _ in range(600):  # the requeued start: its resumed config, then a checkpoint of its own
        resumed = sorted(run.glob("config.resume-*.yaml"))
        if resumed and max(ckpt_steps(run)) > int(resumed[0].stem.split("-")[-1]):
            break
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True)
        assert state.stdout.strip(), f"requeued job {job} ended: {output(tmp_path, job)[-3000:]}"
        time.sleep(1)
    else:
        pytest.fail(f"the requeued job {job} did not continue its run in 10 minutes: {output(tmp_path, job)[-3000:]}")
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    assert "Restarts=1" in shown.split()
    assert "requeued by Slurm (restart 1): continuing the run with --resume" in output(tmp_path, job)
    subprocess.run(["scancel", job], env=env, check=True)
    assert wait_gone(job, env) == "CANCELLED"
    assert "already holds a run" not in output(tmp_path, job)


def ckpt_steps(run: Path) -> list[int]:
    return [int(p.stem.split("-")[1]) for p in (run / "checkpoints").glob("step-*.pt")] or [0]
