"""From the launcher's flags to the workers to start here: command, environment, devices.

Pure functions of the flags and the host's facts, so every rule is testable without starting
a process. ``supervisor`` starts and watches what ``plan_workers`` returns.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

from epljax.launch.runtime import DEFAULT_INIT_TIMEOUT, LaunchError, WorkerEnv

CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"
DEFAULT_GRACE_PERIOD = 30.0   # seconds a signalled worker has to save and exit by itself
DEFAULT_HANG_TIMEOUT = 600.0  # seconds without a step or a line of output that end the job


@dataclasses.dataclass(frozen=True)
class Job:
  """The launcher's flags, checked."""
  script: str
  args: tuple[str, ...] = ()
  num_workers: int = 1
  gpu_per_worker: int = 1
  machine_rank: int | None = None
  machine_list: tuple[str, ...] = ()
  log_dir: str | None = None
  debug: bool = False
  platform: str = "auto"          # auto | gpu | cpu
  init_timeout: float = DEFAULT_INIT_TIMEOUT
  grace_period: float = DEFAULT_GRACE_PERIOD
  hang_timeout: float = DEFAULT_HANG_TIMEOUT

  def __post_init__(self):
    if self.num_workers < 1 or self.gpu_per_worker < 1:
      raise LaunchError(f"--num_workers ({self.num_workers}) and --gpu_per_worker "
                        f"({self.gpu_per_worker}) must be at least 1.")
    if self.machine_list and len(self.machine_list) != self.num_workers:
      raise LaunchError(
          f"--machine_list names {len(self.machine_list)} workers {list(self.machine_list)} but "
          f"--num_workers is {self.num_workers}: give one host:port per worker, worker 0 "
          f"(the coordinator) first.")
    for entry in self.machine_list:
      _host_port(entry)
    if self.machine_rank is not None:
      if not self.machine_list:
        raise LaunchError("--machine_rank needs --machine_list host:port,... (one entry per "
                          "worker; run the launcher on each host with its own --machine_rank).")
      if not 0 <= self.machine_rank < self.num_workers:
        raise LaunchError(f"--machine_rank {self.machine_rank} must be in "
                          f"0..{self.num_workers - 1}.")
    if self.platform not in ("auto", "gpu", "cpu"):
      raise LaunchError(f"--platform {self.platform!r} must be auto, gpu or cpu.")
    if not self.init_timeout > 0:
      raise LaunchError(f"--init_timeout {self.init_timeout} must be a positive number of seconds.")
    if not self.grace_period >= 0:
      raise LaunchError(f"--grace_period {self.grace_period} must be 0 or more seconds.")
    if not self.hang_timeout >= 0:
      raise LaunchError(f"--hang_timeout {self.hang_timeout} must be 0 (never) or more seconds.")

  @property
  def local_workers(self) -> tuple[int, ...]:
    """Worker indices started on this host: ``machine_rank`` alone, or all of them."""
    if self.machine_rank is not None:
      return (self.machine_rank,)
    return tuple(range(self.num_workers))


@dataclasses.dataclass(frozen=True)
class Worker:
  """One process to start: its index, argv and the variables added to the launcher's env."""
  index: int
  argv: tuple[str, ...]
  env: Mapping[str, str]
  log_path: str | None


RUN_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_script.py")


def command(script: str, args: Sequence[str]) -> tuple[str, ...]:
  """A ``.py`` runs with this interpreter (through ``run_script``), anything else with bash;
  arguments unchanged."""
  if script.endswith(".py"):
    return (sys.executable, RUN_SCRIPT, script, *args)
  return (shutil.which("bash") or "/bin/bash", script, *args)


def gpu_count() -> int:
  """GPUs on this host, from ``nvidia-smi -L`` (0 without the tool): no JAX import here."""
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return 0
  try:
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
  except (OSError, subprocess.SubprocessError):
    return 0
  return sum(line.startswith("GPU ") for line in out.splitlines())


def free_port() -> int:
  """A port free on 127.0.0.1 now (the coordinator binds it a moment later)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def plan_workers(job: Job, environ: Mapping[str, str], gpus: int,
                 port: int | None = None) -> list[Worker]:
  """The workers to start on this host, each with its coordinator, index and devices."""
  platform = job.platform if job.platform != "auto" else ("gpu" if gpus else "cpu")
  if job.machine_list:
    coordinator, bind = job.machine_list[0], None     # other hosts must reach it
  else:
    port = port or free_port()
    coordinator = bind = f"127.0.0.1:{port}"          # one host: never listen beyond it
  visible = _visible_gpus(environ, gpus) if platform == "gpu" else []
  if platform == "gpu" and len(job.local_workers) * job.gpu_per_worker > len(visible):
    raise LaunchError(
        f"{len(job.local_workers)} worker(s) x --gpu_per_worker {job.gpu_per_worker} need "
        f"{len(job.local_workers) * job.gpu_per_worker} GPUs on this host, but it has "
        f"{len(visible)} ({visible}). Lower --gpu_per_worker or --num_workers, or use "
        f"--machine_list/--machine_rank to spread the workers over hosts.")
  workers = []
  for slot, index in enumerate(job.local_workers):
    env = WorkerEnv(coordinator, job.num_workers, index, job.init_timeout, bind).to_environ()
    env["PYTHONUNBUFFERED"] = "1"                      # lines reach the console as they happen
    if platform == "gpu":
      mine = visible[slot * job.gpu_per_worker:(slot + 1) * job.gpu_per_worker]
      env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
    else:
      env.update(cpu_devices_env(environ, job.gpu_per_worker))
    log = os.path.join(job.log_dir, f"worker_{index}.log") if job.log_dir else None
    workers.append(Worker(index, command(job.script, job.args), env, log))
  return workers


def cpu_devices_env(environ: Mapping[str, str], count: int) -> dict[str, str]:
  """``count`` CPU devices and gloo collectives across processes (replaces an inherited count)."""
  flags = re.sub(rf"{CPU_DEVICES_FLAG}=\S+", "", environ.get("XLA_FLAGS", "")).split()
  return {"XLA_FLAGS": " ".join([*flags, f"{CPU_DEVICES_FLAG}={count}"]),
          "JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo"}


def _visible_gpus(environ: Mapping[str, str], gpus: int) -> list[str]:
  """This host's GPU ids, within the launcher's own ``CUDA_VISIBLE_DEVICES`` if it has one."""
  inherited = environ.get("CUDA_VISIBLE_DEVICES")
  if inherited is not None:
    return [g.strip() for g in inherited.split(",") if g.strip()]
  return [str(i) for i in range(gpus)]


def _host_port(entry: str) -> tuple[str, int]:
  host, sep, port = entry.rpartition(":")
  if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
    raise LaunchError(f"--machine_list entry {entry!r} must be host:port with a port from 1 "
                      "to 65535, for example 10.0.0.1:6000.")
  return host, int(port)
