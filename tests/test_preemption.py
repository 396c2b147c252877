"""SIGTERM (a preemption) through the launcher: every worker saves at the same step and exits;
a relaunch resumes from that checkpoint with the losses of an uninterrupted run. Real jobs:
``python -m epljax.launch``, 2 processes calling ``epl.init()`` (gloo on 127.0.0.1)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from helpers import share_compiles
from test_launch_jobs import REPO, clean_env, kill_group

WORKER = os.path.join(os.path.dirname(__file__), "launch_scripts", "ckpt_worker.py")


def launcher(directory, *args):
  return [sys.executable, "-m", "epljax.launch", "--num_workers", "2", "--gpu_per_worker", "2",
          "--grace_period", "60", WORKER, "--dir", str(directory), *map(str, args)]


def finish(proc, seconds=180):
  try:
    out, _ = proc.communicate(timeout=seconds)
  except subprocess.TimeoutExpired:
    kill_group(proc)
    out, _ = proc.communicate(timeout=10)
    pytest.fail(f"the launcher did not end within {seconds} s:\n{out}")
  finally:
    kill_group(proc)
  return proc.returncode, out


def run(directory, *args):
  proc = subprocess.Popen(launcher(directory, *args), cwd=REPO, env=clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  return finish(proc)


def marks(out, word):
  """{worker: [values]} of the ``WORD value...`` lines each worker printed."""
  found = {0: [], 1: []}
  for w, rest in re.findall(rf"^\[worker (\d)\] {word} (.*)$", out, re.M):
    found[int(w)].append(rest)
  return found


def losses(out):
  by_worker = {w: dict(v.split() for v in vals) for w, vals in marks(out, "LOSS").items()}
  assert by_worker[0] == by_worker[1], out     # the global loss, the same on both workers
  return {int(k): v for k, v in by_worker[0].items()}


@pytest.mark.slow
def test_sigterm_saves_on_every_worker_at_the_same_step_and_a_relaunch_resumes(tmp_path,
                                                                              monkeypatch):
  # The three jobs run the same programs: the first compiles them (its worker 0 writes the
  # cache), the relaunches load them.
  share_compiles(monkeypatch, tmp_path / "compiled")
  run_dir = tmp_path / "run"
  proc = subprocess.Popen(launcher(run_dir, "--steps", 1000, "--every", 1000, "--sleep", 0.3),
                          cwd=REPO, env=clean_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  seen, deadline = [], time.monotonic() + 180
  while time.monotonic() < deadline:
    line = proc.stdout.readline()
    if not line:
      break
    seen.append(line)
    text = "".join(seen)
    if "[worker 0] LOSS 3 " in text and "[worker 1] LOSS 3 " in text:
      proc.send_signal(signal.SIGTERM)
      break
  code, rest = finish(proc)
  out = "".join(seen) + rest
  assert code == 128 + signal.SIGTERM, out
  preempted = marks(out, "PREEMPTED")
  assert len(preempted[0]) == 1 and preempted[0] == preempted[1], out   # the same step
  stop = int(preempted[0][0])
  assert 3 <= stop < 1000
  first = losses(out)
  assert sorted(first) == list(range(1, stop + 1))

  code, ref_out = run(tmp_path / "ref", "--steps", stop + 3, "--every", 1000)
  assert code == 0, ref_out
  expected = losses(ref_out)

  code, resumed_out = run(run_dir, "--steps", stop + 3, "--every", 1000)
  assert code == 0, resumed_out
  assert marks(resumed_out, "RESUMED") == {0: [str(stop)], 1: [str(stop)]}, resumed_out
  second = losses(resumed_out)
  assert sorted(second) == [stop + 1, stop + 2, stop + 3]
  assert {**first, **second} == expected
