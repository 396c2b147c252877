"""How a launched job ends: preemption, failing workers, hangs. Real jobs through
``python -m epljax.launch``: 2 processes that call ``epl.init()`` (gloo on 127.0.0.1) and train
(``launch_scripts/faults.py``). Every wait has a timeout; what is left is killed at the end.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import share_compiles
from test_launch_jobs import REPO, clean_env, kill_group, wait_gone

FAULTS = os.path.join(os.path.dirname(__file__), "launch_scripts", "faults.py")


class Job:
  """The launcher running ``faults.py`` with ``workers`` workers of 1 CPU device."""

  def __init__(self, tmp_path, spec, *flags, workers=2):
    self.dir = tmp_path
    self.logs = tmp_path / "logs"
    self.workers = workers
    self.start = time.monotonic()
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "epljax.launch", "--num_workers", str(workers), "--gpu_per_worker",
         "1",
         "--log_dir", str(self.logs), *map(str, flags), FAULTS, str(tmp_path), spec],
        cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)

  def wait_for(self, name, seconds=90):
    deadline = time.monotonic() + seconds
    while not all((self.dir / f"{name}{i}").exists() for i in range(self.workers)):
      if self.proc.poll() is not None or time.monotonic() > deadline:
        out = self.finish(5)[1]
        pytest.fail(f"no {name} files after {seconds} s:\n{out}")
      time.sleep(0.1)

  def finish(self, seconds=90):
    """(exit code, output, seconds since the start)."""
    try:
      out, _ = self.proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
      kill_group(self.proc)
      out, _ = self.proc.communicate(timeout=10)
      pytest.fail(f"the launcher did not end within {seconds} s:\n{out}")
    finally:
      kill_group(self.proc)
    return self.proc.returncode, out, time.monotonic() - self.start

  def pids(self):
    return [int((self.dir / f"pid{i}").read_text()) for i in range(self.workers)]

  def log(self, i):
    return str(self.logs / f"worker_{i}.log")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
  """One compilation cache for the module's jobs, which run the same programs: the first job
  compiles them (its worker 0 writes the cache), the others load them."""
  return tmp_path_factory.mktemp("compiled")


@pytest.fixture
def job(tmp_path, monkeypatch, compiled):
  share_compiles(monkeypatch, compiled)
  jobs = []

  def start(spec, *flags, workers=2):
    jobs.append(Job(tmp_path, spec, *flags, workers=workers))
    return jobs[-1]

  yield start
  for j in jobs:
    kill_group(j.proc)


def test_sigterm_reaches_every_worker_which_stops_at_the_same_step_and_exits(job):
  j = job("preempt", "--grace_period", 60)
  j.wait_for("ready")
  j.proc.send_signal(signal.SIGTERM)
  signalled = time.monotonic()
  code, out, _ = j.finish()
  assert code == 128 + signal.SIGTERM, out
  assert "received SIGTERM: forwarded to the 2 running worker(s); waiting up to 60 s" in out
  assert ("every worker ended after SIGTERM: worker 0 exited with code 0, worker 1 exited "
          "with code 0") in out
  steps = [int((j.dir / f"stopped{i}").read_text()) for i in range(2)]
  assert steps[0] == steps[1] >= 2, (steps, out)
  assert time.monotonic() - signalled < 30
  assert wait_gone(j.pids()) == []


def test_a_single_worker_sees_sigterm_through_stop_requested_too(job):
  j = job("preempt", workers=1)
  j.wait_for("ready")
  j.proc.send_signal(signal.SIGTERM)
  code, out, _ = j.finish()
  assert code == 128 + signal.SIGTERM, out
  assert "every worker ended after SIGTERM: worker 0 exited with code 0" in out
  assert int((j.dir / "stopped0").read_text()) >= 1


def test_workers_that_ignore_sigterm_are_killed_after_the_grace_period(job):
  j = job("ignore_term", "--grace_period", 2)
  j.wait_for("ready")
  j.proc.send_signal(signal.SIGTERM)
  signalled = time.monotonic()
  code, out, _ = j.finish()
  assert code == 128 + signal.SIGTERM, out
  assert "killed worker(s) [0, 1] (SIGKILL): still running after the grace period" in out
  assert 2 <= time.monotonic() - signalled < 15
  assert wait_gone(j.pids()) == []


FAILURES = [
    ("raise@0:3", 1, "exited with code 1", "ValueError: worker 0 failed at step 3"),
    ("exit@1:3", 3, "exited with code 3", "worker 1: exit at step 3"),
    ("kill@1:3", 128 + signal.SIGKILL, "was killed by SIGKILL", "worker 1: kill at step 3"),
    ("raise_before@1", 1, "exited with code 1", "RuntimeError: failed before epl.init()"),
]


@pytest.mark.parametrize("spec, code, how, logged", FAILURES, ids=[f[0] for f in FAILURES])
def test_a_failing_worker_ends_the_job_within_30_s_and_is_the_one_named(job, spec, code, how,
                                                                       logged):
  j = job(spec)
  if "before" not in spec:
    j.wait_for("ready")
  failed_at = time.monotonic()
  rc, out, _ = j.finish()
  bad = int(spec.split("@")[1][0])
  assert rc == code, out
  # The peer is either stopped by the launcher or ends by itself first (its collective lost
  # worker `bad`); the message says which, and names `bad` either way.
  peer = (f"(stopped the 1 other running worker\\(s\\)|already ended: worker {1 - bad} "
          f"(exited with code \\d+|was killed by SIG[A-Z]+))")
  assert re.search(f"epljax.launch: worker {bad} \\(on {os.uname().nodename}\\) {how}; {peer}. "
                   f"Its log: {re.escape(j.log(bad))}\n", out), out
  assert logged in open(j.log(bad)).read()
  assert time.monotonic() - failed_at < 30, out
  assert wait_gone(j.pids()) == []


def test_a_hung_worker_ends_the_job_after_hang_timeout_and_is_the_one_named(job):
  j = job("hang@1:4", "--hang_timeout", 10)
  j.wait_for("ready")
  rc, out, _ = j.finish()
  assert rc == 124, out
  assert (f"epljax.launch: worker 1 (on {os.uname().nodename}) made no progress (no step, no "
          f"output) for ") in out
  assert "over --hang_timeout 10; killed it" in out
  assert f"Its log: {j.log(1)}" in out
  assert wait_gone(j.pids()) == []


def test_output_counts_as_progress_and_silence_past_hang_timeout_ends_the_job(tmp_path):
  script = tmp_path / "talk.sh"
  script.write_text("for i in 1 2 3 4 5 6; do echo tick $i; sleep 0.5; done; sleep 600\n")
  start = time.monotonic()
  proc = subprocess.Popen([sys.executable, "-m", "epljax.launch", "--num_workers", "2",
                           "--gpu_per_worker", "1", "--hang_timeout", "2", str(script)],
                          cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=60)
  finally:
    kill_group(proc)
  assert proc.returncode == 124, out
  assert "[worker 0] tick 6" in out and "[worker 1] tick 6" in out   # 3 s of output: alive
  assert re.search(r"epljax.launch: worker [01] \(on .*\) made no progress \(no step, no "
                   r"output\) for \d+ s before its first step, over --hang_timeout 2", out), out
  assert 5 < time.monotonic() - start < 30
