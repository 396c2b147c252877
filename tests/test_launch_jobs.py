"""Real jobs through ``python -m epljax.launch``: 2 processes, gloo on 127.0.0.1.

Every test starts its processes in its own session and kills what is left at the end.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from epljax.launch import runtime

HERE = os.path.dirname(__file__)
REPO = os.path.dirname(HERE)
TRAIN = os.path.join(HERE, "launch_scripts", "train_dp.py")


def clean_env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith("EPL_")}
  env.update(extra)
  return env


def launch(*args, timeout=180, **popen):
  """Runs the launcher to the end; returns (exit code, output, seconds)."""
  start = time.monotonic()
  proc = subprocess.Popen([sys.executable, "-m", "epljax.launch", *map(str, args)], cwd=REPO,
                          env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True, **popen)
  try:
    out, _ = proc.communicate(timeout=timeout)
  finally:
    kill_group(proc)
  return proc.returncode, out, time.monotonic() - start


def kill_group(proc):
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat") as f:    # a zombie waiting for its parent is gone too
    return f.read().split()[2] != "Z"


def wait_gone(pids, seconds=10):
  deadline = time.monotonic() + seconds
  while any(alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  return [p for p in pids if alive(p)]


GLOO = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
ODD_ARGS = ["a b", "$HOME", "it's", "x;echo no", "--num_workers", ""]


def test_shell_script_gets_its_arguments_unchanged_and_prefixed_logged_output(tmp_path):
  script = tmp_path / "run.sh"
  script.write_text(textwrap.dedent(f"""\
      for a in "$@"; do echo "arg=[$a]"; done
      echo "worker=$EPL_WORKER_INDEX of $EPL_NUM_WORKERS at $EPL_COORDINATOR_ADDRESS"
      echo "flags=$XLA_FLAGS"
      echo '{GLOO}'
      """))
  (tmp_path / "logs").mkdir()
  (tmp_path / "logs" / "worker_1.log").write_text("a crashed run's traceback\n")
  code, out, _ = launch("--num_workers", 2, "--gpu_per_worker", 3, "--log_dir", tmp_path / "logs",
                        script, *ODD_ARGS, timeout=60)
  assert code == 0, out
  # The launcher keeps the other XLA flags (conftest's) and sets the device count last.
  kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
  flags = " ".join([*kept, "--xla_force_host_platform_device_count=3"])
  for i in range(2):
    lines = [line for line in out.splitlines() if line.startswith(f"[worker {i}] ")]
    assert [line.split("] ", 1)[1] for line in lines[:6]] == [f"arg=[{a}]" for a in ODD_ARGS]
    assert f"[worker {i}] worker={i} of 2 at 127.0.0.1:" in out
    assert f"[worker {i}] flags={flags}" in out
    log = (tmp_path / "logs" / f"worker_{i}.log").read_text()
    assert log.startswith("arg=[a b]\n") and f"worker={i} of 2" in log
    assert log.endswith(GLOO + "\n")       # the log keeps gloo's lines; the console does not
  assert "Gloo" not in out
  # The earlier run's log is kept (rotated), not overwritten.
  assert (tmp_path / "logs" / "worker_1.log.1").read_text() == "a crashed run's traceback\n"
  assert not (tmp_path / "logs" / "worker_0.log.1").exists()


def test_python_script_runs_with_this_interpreter(tmp_path):
  script = tmp_path / "show.py"
  script.write_text("import os, sys\nprint(sys.executable, sys.argv[1:], "
                    "os.environ['EPL_WORKER_INDEX'])\n")
  code, out, _ = launch("--num_workers", 2, "--gpu_per_worker", 1, script, *ODD_ARGS, timeout=60)
  assert code == 0, out
  for i in range(2):
    assert f"[worker {i}] {sys.executable} {ODD_ARGS!r} {i}" in out


def test_a_failing_worker_stops_the_job_and_is_named_with_its_log(tmp_path):
  script = tmp_path / "fail.py"
  script.write_text(textwrap.dedent(f"""\
      import os, sys, time
      i = os.environ["EPL_WORKER_INDEX"]
      open(os.path.join({str(tmp_path)!r}, "pid" + i), "w").write(str(os.getpid()))
      if i == "1":
        time.sleep(1)
        print("giving up", flush=True)
        sys.exit(3)
      time.sleep(600)
      """))
  code, out, seconds = launch("--num_workers", 2, "--gpu_per_worker", 1, "--log_dir",
                              tmp_path / "logs", script, timeout=120)
  assert code == 3, out
  assert seconds < 60, seconds
  assert (f"worker 1 (on {os.uname().nodename}) exited with code 3; stopped the 1 other "
          f"running worker(s). Its log: {tmp_path / 'logs' / 'worker_1.log'}") in out
  pids = [int((tmp_path / f"pid{i}").read_text()) for i in range(2)]
  assert wait_gone(pids) == []


def test_ctrl_c_stops_every_worker(tmp_path):
  script = tmp_path / "sleep.sh"
  script.write_text(f'echo $$ > {tmp_path}/pid$EPL_WORKER_INDEX; echo ready; sleep 600\n')
  proc = subprocess.Popen([sys.executable, "-m", "epljax.launch", "--num_workers", "2",
                           "--gpu_per_worker", "1", str(script)], cwd=REPO, env=clean_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
  try:
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"pid{i}").exists() for i in range(2)):
      assert time.monotonic() < deadline and proc.poll() is None
      time.sleep(0.1)
    pids = [int((tmp_path / f"pid{i}").read_text()) for i in range(2)]
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
  finally:
    kill_group(proc)
  assert proc.returncode == 130, out
  assert "received SIGINT: forwarded to the 2 running worker(s)" in out
  assert "every worker ended after SIGINT: worker 0 was killed by SIGINT, worker 1 was " \
         "killed by SIGINT" in out
  assert wait_gone(pids) == []


def worker_process(code, index, port, timeout):
  env = clean_env(**runtime.WorkerEnv(f"127.0.0.1:{port}", 2, index, timeout).to_environ(),
                  XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
  start = time.monotonic()
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=120, cwd=REPO)
  return done, time.monotonic() - start


def test_an_unreachable_coordinator_is_a_clear_error_within_the_timeout():
  from epljax.launch.jobs import free_port
  port = free_port()          # nobody listens there
  done, seconds = worker_process("import epljax as epl; epl.init()", 1, port, 2)
  assert done.returncode != 0
  assert (f"LaunchError: Worker 1 of 2 could not reach the coordinator at 127.0.0.1:{port} "
          f"within 2 s") in done.stderr
  assert "--init_timeout SECONDS (EPL_INIT_TIMEOUT)" in done.stderr
  assert seconds < 30


def test_touching_jax_before_epl_init_in_a_worker_says_to_call_init_first():
  from epljax.launch.jobs import free_port
  done, _ = worker_process("import jax; jax.devices(); import epljax as epl; epl.init()", 0,
                           free_port(), 5)
  assert done.returncode != 0
  assert "JAX's backend was started\nbefore epl.init() could connect the workers" in done.stderr


@pytest.mark.slow
def test_two_workers_of_two_cpu_devices_train_like_one_worker_of_four(tmp_path):
  """Same global batch, same model: 2 processes x 2 devices == 1 process x 4 devices."""
  results = {}
  for name, workers, devices in (("2x2", 2, 2), ("1x4", 1, 4)):
    out_file = tmp_path / f"{name}.json"
    code, out, _ = launch("--num_workers", workers, "--gpu_per_worker", devices, TRAIN,
                          out_file, timeout=240)
    assert code == 0, out
    results[name] = json.loads(out_file.read_text())
  two, one = results["2x2"], results["1x4"]
  assert two["cluster"] == [2, 0, 4, 2] and one["cluster"] == [1, 0, 4, 4]
  assert two["replicas"] == one["replicas"] == 4
  np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5, atol=1e-5)
  for a, b in zip(_leaves(two["params"]), _leaves(one["params"])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert two["losses"][-1] < two["losses"][0]


def _leaves(tree):
  if isinstance(tree, dict):
    return [leaf for k in sorted(tree) for leaf in _leaves(tree[k])]
  return [np.asarray(tree)]


def test_the_failure_message_says_what_became_of_every_other_worker():
  from types import SimpleNamespace

  from epljax.launch import supervisor

  def running(index, code, log=None):
    return SimpleNamespace(worker=SimpleNamespace(index=index, log_path=log), code=code,
                           tail=["Traceback", "ValueError: boom"])

  failed, stopped, ended = running(0, 1, "logs/worker_0.log"), running(1, None), running(2, -9)
  text = supervisor._failure(failed, "exited with code 1", [stopped], [failed, stopped, ended])
  host = os.uname().nodename
  assert text == (f"worker 0 (on {host}) exited with code 1; stopped the 1 other running "
                  "worker(s); already ended: worker 2 was killed by SIGKILL. Its log: "
                  "logs/worker_0.log")
  alone = running(0, 3)
  assert supervisor._failure(alone, "exited with code 3", [], [alone]) == (
      f"worker 0 (on {host}) exited with code 3; no other worker. Its last lines (prefixed "
      "[worker 0] above; --log_dir DIR keeps a log per worker):\n    Traceback\n    "
      "ValueError: boom")
