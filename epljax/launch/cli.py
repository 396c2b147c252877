"""``python -m epljax.launch``: EPL's ``epl-launch`` flags over JAX's multi-controller runtime.

One host, two workers of four devices each (GPUs, or CPU devices on a host without GPUs)::

    python -m epljax.launch --num_workers 2 --gpu_per_worker 4 train.py --lr 0.1

Two hosts, one worker of eight GPUs on each: the same command on every host, with its rank::

    python -m epljax.launch --num_workers 2 --gpu_per_worker 8 \\
        --machine_list 10.0.0.1:6000,10.0.0.2:6000 --machine_rank 0 train.py   # on 10.0.0.1
    python -m epljax.launch --num_workers 2 --gpu_per_worker 8 \\
        --machine_list 10.0.0.1:6000,10.0.0.2:6000 --machine_rank 1 train.py   # on 10.0.0.2

SCRIPT is a ``.py`` file (run with this Python) or a shell script (run with bash); the
arguments after it reach it unchanged. ``EPILOG`` (the end of ``--help``) says how the job
ends: failures, hangs, preemption, and what a worker sees.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from epljax.launch import jobs, supervisor
from epljax.launch.runtime import DEFAULT_INIT_TIMEOUT, LaunchError

EPILOG = """\
how the job ends:
  - 0 when every worker exits with 0.
  - The first worker to exit non-zero or die from a signal (before or after epl.init())
    ends the job: the others get SIGTERM, then SIGKILL 5 s later, and the launcher exits
    with that worker's status (128 + N for signal N), naming the worker, its host, how it
    ended and its log. Once epl.init() connected the workers, a worker that raises or calls
    sys.exit(non-zero) exits at once instead of waiting in JAX's shutdown barrier.
  - A worker without progress (no Trainer.train_step, no line of output) for --hang_timeout
    seconds is killed and named, the others stopped; exit status 124.
  - SIGTERM to the launcher (a preemption) or Ctrl-C: forwarded to every worker (to its
    process group), which then has --grace_period seconds to save a checkpoint and exit by
    itself, then SIGKILL; a second signal kills at once. Exit status 128 + the signal
    (143 for SIGTERM), whatever the workers returned: the job did not finish.

what a worker sees on SIGTERM:
  - before epl.init(): Python's default, the process ends at once.
  - after epl.init(): JAX's preemption notifier (several workers) or epljax (one worker)
    catches it and the program goes on; epljax.launch.stop_requested(step), called at every
    step, then returns True on every worker at the same step: save a checkpoint there and
    exit. A script that installs its own SIGTERM handler gets the signal itself.
"""


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m epljax.launch",
      description="Start the workers of an epljax job on this host (EPL's epl-launch).",
      epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--num_workers", type=int, required=True,
                 help="Workers (processes) in the whole job, over all hosts.")
  p.add_argument("--gpu_per_worker", type=int, required=True,
                 help="Devices per worker: GPUs (CUDA_VISIBLE_DEVICES), or CPU devices on a "
                 "host without GPUs.")
  p.add_argument("--machine_rank", type=int, default=None,
                 help="Start only this worker here (multi-host: one launcher per host).")
  p.add_argument("--machine_list", default=None,
                 help="host:port of every worker, comma-separated; the first is worker 0, "
                 "whose port the coordinator listens on.")
  p.add_argument("--log_dir", default=None,
                 help="Write each worker's output to LOG_DIR/worker_<i>.log too (every line, "
                 "library messages included); an earlier run's log there moves to "
                 "worker_<i>.log.1 (.1 to .2, ... up to .9).")
  p.add_argument("--debug", action="store_true",
                 help="The first worker started here keeps the terminal (for pdb); print the "
                 "workers' commands and environment, and the libraries' routine messages "
                 "(Gloo's connections, JAX's SIGTERM notices) the console otherwise leaves out.")
  p.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto",
                 help="Devices to use: GPUs when nvidia-smi finds some (auto), or force one.")
  p.add_argument("--init_timeout", type=float, default=DEFAULT_INIT_TIMEOUT,
                 help="Seconds a worker waits for the coordinator and the other workers.")
  p.add_argument("--grace_period", type=float, default=jobs.DEFAULT_GRACE_PERIOD,
                 help="Seconds the workers have to save and exit after the launcher forwarded "
                 "SIGTERM or SIGINT to them, before SIGKILL (default %(default)s).")
  p.add_argument("--hang_timeout", type=float, default=jobs.DEFAULT_HANG_TIMEOUT,
                 help="End the job when a worker shows no progress (no training step, no "
                 "output) for this many seconds; 0 never (default %(default)s). Allow for the "
                 "first step's compilation.")
  p.add_argument("script", help="The training script: a .py file or a shell script.")
  p.add_argument("args", nargs=argparse.REMAINDER, help="Arguments passed to SCRIPT unchanged.")
  return p


def job_from_args(argv: Sequence[str]) -> jobs.Job:
  a = parser().parse_args(_debug_flag(argv))
  if not os.path.isfile(a.script):
    raise LaunchError(f"SCRIPT {a.script!r} is not a file (working directory {os.getcwd()}).")
  machines = tuple(m.strip() for m in a.machine_list.split(",") if m.strip()) \
      if a.machine_list else ()
  return jobs.Job(script=a.script, args=tuple(a.args), num_workers=a.num_workers,
                  gpu_per_worker=a.gpu_per_worker, machine_rank=a.machine_rank,
                  machine_list=machines, log_dir=a.log_dir, debug=a.debug,
                  platform=a.platform, init_timeout=a.init_timeout,
                  grace_period=a.grace_period, hang_timeout=a.hang_timeout)


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  try:
    job = job_from_args(argv)
    gpus = jobs.gpu_count() if job.platform != "cpu" else 0
    if job.platform == "gpu" and not gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:
      raise LaunchError("--platform gpu, but nvidia-smi finds no GPU on this host.")
    workers = jobs.plan_workers(job, os.environ, gpus)
  except LaunchError as e:
    print(f"epljax.launch: {e}", file=sys.stderr)
    return 2
  if job.debug:
    for w in workers:
      extra = " ".join(f"{k}={v}" for k, v in sorted(w.env.items()))
      print(f"epljax.launch: worker {w.index}: {extra} {' '.join(w.argv)}", flush=True)
  try:
    return supervisor.run(workers, os.environ, debug=job.debug, grace_period=job.grace_period,
                          hang_timeout=job.hang_timeout)
  except OSError as e:       # the script cannot be executed (the others were stopped)
    print(f"epljax.launch: could not start {' '.join(workers[0].argv)}: {e}", file=sys.stderr)
    return 2


def _debug_flag(argv: Sequence[str]) -> list[str]:
  """EPL wrote ``--debug True``: fold a boolean word after ``--debug`` (before SCRIPT) into it."""
  out, rest = [], list(argv)
  while rest:
    arg = rest.pop(0)
    if arg == "--debug" and rest and rest[0].lower() in _BOOLEANS:
      if _BOOLEANS[rest.pop(0).lower()]:
        out.append(arg)
      continue
    out.append(arg)
    if not arg.startswith("-") and not (out[:-1] and out[-2] in _VALUED):
      out.extend(rest)          # SCRIPT reached: the rest is its own
      break
  return out


_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
_VALUED = {"--num_workers", "--gpu_per_worker", "--machine_rank", "--machine_list", "--log_dir",
           "--platform", "--init_timeout", "--grace_period", "--hang_timeout"}
