"""The worker's side of a multi-process job: ``epl.init`` calls ``initialize`` here.

A worker learns its place in the job from its environment, in this order:

1. ``jax.distributed`` is already initialized (the user called ``jax.distributed.initialize``
   before ``epl.init``, or ``epl.init`` runs a second time): nothing more is done.
2. The launcher's variables (``EPL_COORDINATOR_ADDRESS``, ``EPL_NUM_WORKERS``,
   ``EPL_WORKER_INDEX``; see ``WorkerEnv``): ``jax.distributed.initialize`` with exactly these.
3. A scheduler ``jax.distributed`` detects by itself, with more than one process: Slurm (inside
   ``srun``) or Open MPI (``mpirun``): ``jax.distributed.initialize()`` without arguments.
4. Otherwise a single process: nothing is initialized.

``EPL_INIT_TIMEOUT`` (seconds, default 300) bounds the wait for the coordinator in cases 2 and 3.
A worker other than 0 first checks that the coordinator's port answers, so an unreachable
coordinator is a ``LaunchError`` naming the address and the timeout rather than a crash in the
runtime's C++ code.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
import time
from collections.abc import Mapping

import jax

from epljax.errors import EPLError
from epljax.launch import worker as worker_side

COORDINATOR = "EPL_COORDINATOR_ADDRESS"
BIND = "EPL_COORDINATOR_BIND_ADDRESS"
NUM_WORKERS = "EPL_NUM_WORKERS"
WORKER_INDEX = "EPL_WORKER_INDEX"
INIT_TIMEOUT = "EPL_INIT_TIMEOUT"
DEFAULT_INIT_TIMEOUT = 300

_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_OMPI = "OMPI_MCA_orte_hnp_uri"


class LaunchError(EPLError, RuntimeError):
  """A multi-process job that cannot start or keep running."""


@dataclasses.dataclass(frozen=True)
class WorkerEnv:
  """What the launcher tells one worker (its environment variables, parsed)."""
  coordinator: str               # host:port of worker 0's coordinator service
  num_workers: int
  worker_index: int
  init_timeout: float = DEFAULT_INIT_TIMEOUT
  bind_address: str | None = None  # where worker 0's coordinator listens (127.0.0.1 on one host)

  def to_environ(self) -> dict[str, str]:
    env = {COORDINATOR: self.coordinator, NUM_WORKERS: str(self.num_workers),
           WORKER_INDEX: str(self.worker_index), INIT_TIMEOUT: _seconds(self.init_timeout)}
    if self.bind_address:
      env[BIND] = self.bind_address
    return env

  @classmethod
  def from_environ(cls, environ: Mapping[str, str]) -> WorkerEnv | None:
    if COORDINATOR not in environ:
      return None
    missing = [v for v in (NUM_WORKERS, WORKER_INDEX) if v not in environ]
    if missing:
      raise LaunchError(f"{COORDINATOR} is set but {missing} are not: the launcher sets all of "
                        f"them. Start the job with python -m epljax.launch, or set "
                        f"{NUM_WORKERS} and {WORKER_INDEX} too.")
    num, index = _int(environ, NUM_WORKERS), _int(environ, WORKER_INDEX)
    if num < 1 or not 0 <= index < num:
      raise LaunchError(f"{WORKER_INDEX}={index} must be in 0..{NUM_WORKERS}-1 = {num - 1}.")
    return cls(environ[COORDINATOR], num, index, init_timeout(environ), environ.get(BIND))


def init_timeout(environ: Mapping[str, str]) -> float:
  text = environ.get(INIT_TIMEOUT, str(DEFAULT_INIT_TIMEOUT))
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if not value > 0:
    raise LaunchError(f"{INIT_TIMEOUT}={text!r} must be a positive number of seconds.")
  return value


def scheduler_processes(environ: Mapping[str, str]) -> int:
  """Processes of a Slurm step or Open MPI job ``jax.distributed`` auto-detects (else 1)."""
  if all(v in environ for v in _SLURM):
    return int(environ["SLURM_NTASKS"])
  if _OMPI in environ and "OMPI_COMM_WORLD_SIZE" in environ:
    return int(environ["OMPI_COMM_WORLD_SIZE"])
  return 1


def initialize(environ: Mapping[str, str] | None = None) -> None:
  """Initializes ``jax.distributed`` once if this process is one of several (module doc)."""
  environ = os.environ if environ is None else environ
  worker_side.open_heartbeat(environ)
  if jax.distributed.is_initialized():
    return
  worker = WorkerEnv.from_environ(environ)
  if worker is not None:
    if worker.num_workers > 1:
      _initialize_launched(worker)
    else:
      worker_side.watch_stop_signals()
    return
  if scheduler_processes(environ) > 1:
    _call_initialize(dict(initialization_timeout=math.ceil(init_timeout(environ))),
                     "the scheduler's environment (Slurm or Open MPI)")
    worker_side.fail_fast()


def _initialize_launched(worker: WorkerEnv) -> None:
  deadline = time.monotonic() + worker.init_timeout
  if worker.worker_index > 0:
    _wait_for_port(worker, deadline)
  remaining = max(1, math.ceil(deadline - time.monotonic()))
  print(f"epljax: worker {worker.worker_index} of {worker.num_workers} joining the coordinator "
        f"at {worker.coordinator} (waiting up to {remaining} s for all workers)",
        file=sys.stderr, flush=True)
  kwargs = dict(coordinator_address=worker.coordinator, num_processes=worker.num_workers,
                process_id=worker.worker_index, initialization_timeout=remaining)
  if worker.bind_address:
    kwargs["coordinator_bind_address"] = worker.bind_address
  _call_initialize(kwargs, f"the launcher's environment ({COORDINATOR}={worker.coordinator})")
  worker_side.fail_fast()


def _call_initialize(kwargs: dict, source: str) -> None:
  try:
    jax.distributed.initialize(**kwargs)
  except RuntimeError as e:
    if "must be called before" in str(e):
      raise LaunchError(_TOO_LATE.format(source=source)) from e
    raise


_TOO_LATE = """\
This process is one worker of a multi-process job ({source}), but JAX's backend was started
before epl.init() could connect the workers (something called jax.devices(), created an array
or ran a computation first). Call epl.init() first:

    import epljax as epl
    epl.init()                 # connects the workers: before anything touches JAX's devices
    x = jnp.ones(8)            # then the rest of the program"""


def _wait_for_port(worker: WorkerEnv, deadline: float) -> None:
  """Returns once the coordinator's port accepts a connection; raises after the deadline."""
  host, _, port = worker.coordinator.rpartition(":")
  host = host.strip("[]")
  try:
    port_number = int(port)
  except ValueError:
    raise LaunchError(f"{COORDINATOR}={worker.coordinator!r} must be host:port.") from None
  last = None
  while True:
    try:
      with socket.create_connection((host, port_number), timeout=1.0):
        return
    except OSError as e:
      last = e
    if time.monotonic() >= deadline:
      break
    time.sleep(0.25)
  raise LaunchError(
      f"Worker {worker.worker_index} of {worker.num_workers} could not reach the coordinator at "
      f"{worker.coordinator} within {_seconds(worker.init_timeout)} s ({last}). Check that "
      f"worker 0 runs (on a cluster: on the host of the first --machine_list entry) and that "
      f"this host can open that port; wait longer with --init_timeout SECONDS "
      f"({INIT_TIMEOUT}).")


def _int(environ: Mapping[str, str], var: str) -> int:
  try:
    return int(environ[var])
  except ValueError:
    raise LaunchError(f"{var}={environ[var]!r} must be an integer.") from None


def _seconds(value: float) -> str:
  return str(int(value)) if float(value).is_integer() else str(value)
