"""``python -m epljax.launch``: EPL's ``epl-launch`` flags over JAX's multi-controller runtime.

One host, two workers of four devices each (GPUs, or CPU devices on a host without GPUs)::

    python -m epljax.launch --num_workers 2 --gpu_per_worker 4 train.py --lr 0.1

Two hosts, one worker of eight GPUs on each: the same command on every host, with its rank::

    python -m epljax.launch --num_workers 2 --gpu_per_worker 8 \\
        --machine_list 10.0.0.1:6000,10.0.0.2:6000 --machine_rank 0 train.py   # on 10.0.0.1
    python -m epljax.launch --num_workers 2 --gpu_per_worker 8 \\
        --machine_list 10.0.0.1:6000,10.0.0.2:6000 --machine_rank 1 train.py   # on 10.0.0.2

SCRIPT is a ``.py`` file (run with this Python) or a shell script (run with bash); the
arguments after it reach it unchanged. The exit status is 0 when every worker succeeded, else
the first failing worker's status (128 + signal for a signal).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from epljax.launch import jobs, supervisor
from epljax.launch.runtime import DEFAULT_INIT_TIMEOUT, LaunchError


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m epljax.launch",
      description="Start the workers of an epljax job on this host (EPL's epl-launch).")
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
                 help="Write each worker's output to LOG_DIR/worker_<i>.log too.")
  p.add_argument("--debug", action="store_true",
                 help="The first worker started here keeps the terminal (for pdb); print the "
                 "workers' commands and environment.")
  p.add_argument("--platform", choices=("auto", "gpu", "cpu"), default="auto",
                 help="Devices to use: GPUs when nvidia-smi finds some (auto), or force one.")
  p.add_argument("--init_timeout", type=float, default=DEFAULT_INIT_TIMEOUT,
                 help="Seconds a worker waits for the coordinator and the other workers.")
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
                  platform=a.platform, init_timeout=a.init_timeout)


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
    return supervisor.run(workers, os.environ, debug=job.debug)
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
           "--platform", "--init_timeout"}
