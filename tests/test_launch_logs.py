"""What the launcher keeps and shows of the workers' output (``epljax/launch/logs.py``), and its
warning for a launched script that never calls ``epl.init()`` (``run_script.py``). Shell
scripts and one JAX process: no job of connected workers here (the launch through the CLI:
``test_launch_jobs.py``'s shell script, a crashed run's log kept, gloo's lines left out)."""

import io
import subprocess
import sys
import textwrap

import pytest

from epljax.launch import jobs, logs, supervisor
from test_launch_jobs import GLOO, clean_env

# What a 2-worker job on CPU devices printed (examples/quickstart.py, jax 0.10 and 0.12): gloo's
# threads interleave, and a progress bar redrawn without a newline may come first.
PRINTED = [
    GLOO,
    "[Gloo] Rank [Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer "
    "ranks is : 3",
    "1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
    "  0%|          | 0/10 [00:00<?, ?step/s]" + GLOO,
    "W1208 00:34:11.139558   21680 preemption_notifier.cc:90] SIGTERM caught at "
    "2026-12-08T00:34:11.139555509+00:00",
    "Iteration 1 , Loss: 5.700820 .",
    "jax.errors.JaxRuntimeError: UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/"
    "tcp/pair.cc:538] Read error [127.0.0.1]:15254: Connection reset by peer",
]


def test_the_console_leaves_out_library_noise_and_keeps_everything_else():
  shown = [logs.quiet(line) for line in PRINTED]
  assert shown == [None, None, None, "  0%|          | 0/10 [00:00<?, ?step/s]", None,
                   PRINTED[5], PRINTED[6]]


def test_rotation_keeps_the_earlier_runs_up_to_keep(tmp_path):
  log = tmp_path / "worker_0.log"
  logs.rotate(str(log))                      # nothing to keep yet
  assert list(tmp_path.iterdir()) == []
  for run in range(4):
    logs.rotate(str(log), keep=2)
    log.write_text(f"run {run}\n")
  assert sorted(p.name for p in tmp_path.iterdir()) == [
      "worker_0.log", "worker_0.log.1", "worker_0.log.2"]
  assert [(tmp_path / n).read_text() for n in ("worker_0.log", "worker_0.log.1",
                                               "worker_0.log.2")] == ["run 3\n", "run 2\n",
                                                                      "run 1\n"]


def _workers(tmp_path):
  """Two shell workers: worker 0 prints a line; worker 1 gloo's lines around its own."""
  lines = "\n".join(f"echo '{line}'" for line in [GLOO, "mine", PRINTED[4]])
  return [jobs.Worker(i, ("bash", "-c", "echo zero" if i == 0 else lines), {},
                      str(tmp_path / "logs" / f"worker_{i}.log")) for i in range(2)]


# Workers started from this test's process, which runs JAX: subprocess forks (preexec_fn).
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_supervisor_relays_without_noise_unless_debug_and_logs_every_line(tmp_path, capfd):
  console = io.StringIO()
  assert supervisor.run(_workers(tmp_path), clean_env(), hang_timeout=0, console=console) == 0
  out = console.getvalue()
  assert "[worker 1] mine" in out and "[worker 0] zero" in out
  assert "Gloo" not in out and "SIGTERM caught" not in out
  first = (tmp_path / "logs" / "worker_1.log").read_text()
  assert first == f"{GLOO}\nmine\n{PRINTED[4]}\n"          # the log keeps every line

  console = io.StringIO()                   # --debug, the same log_dir: shown, and rotated
  assert supervisor.run(_workers(tmp_path), clean_env(), debug=True, hang_timeout=0,
                        console=console) == 0
  assert f"[worker 1] {GLOO}" in console.getvalue()
  assert f"[worker 1] {PRINTED[4]}" in console.getvalue()
  assert (tmp_path / "logs" / "worker_1.log.1").read_text() == first
  assert "zero" in capfd.readouterr().out   # --debug: worker 0 kept the terminal


def test_a_launched_script_that_starts_jax_without_epl_init_is_warned_while_it_runs(tmp_path):
  script = tmp_path / "alone.py"
  script.write_text(textwrap.dedent("""\
      import time
      import jax.numpy as jnp
      print("sum", float(jnp.ones(2).sum()), flush=True)
      time.sleep(1.0)                     # the warning comes while the script runs
      print("end", flush=True)
      """))
  env = clean_env(EPL_NUM_WORKERS="2", EPL_WORKER_INDEX="1", JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, jobs.RUN_SCRIPT, str(script)], env=env, timeout=120,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  out = done.stdout
  assert done.returncode == 0, out
  warning = f"epljax.launch: warning: {script} started JAX without epl.init()"
  assert out.count(warning) == 1 and out.index(warning) < out.index("end") and "sum 2.0" in out
  assert "worker 1" in out and "epl.init()     # connects the workers" in out
  # A script that calls epl.init() is not warned: tests/test_launch_examples.py's jobs.
