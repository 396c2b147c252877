"""``epl.init`` and ``epl.Env``: the configuration and the facts of the cluster.

>>> env = epl.init(epl.Config({"pipeline.num_micro_batch": 2}))   # doctest: +SKIP
>>> env.cluster.worker_num, env.cluster.total_gpu_num            # doctest: +SKIP
(1, 8)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax

from epljax import strategy
from epljax.config import ClusterConfig, Config
from epljax.sharding import annotations
from epljax.errors import ConfigError, StateError
from epljax.launch import runtime as launch_runtime


@dataclasses.dataclass(frozen=True)
class Cluster:
  """Where the job runs. ``total_gpu_num`` counts accelerators, or CPU devices on a CPU host."""
  worker_num: int
  worker_index: int
  total_gpu_num: int
  local_device_count: int
  platform: str
  devices: tuple[jax.Device, ...] = dataclasses.field(repr=False)
  compile_only: bool = False   # devices XLA compiles for but nothing runs on (epl.topology)

  @property
  def local_devices(self) -> tuple[jax.Device, ...]:
    return tuple(d for d in self.devices if d.process_index == self.worker_index)


class Env:
  """The process-wide state ``epl.init`` creates: ``Env.get().config`` and ``.cluster``."""

  _current: Env | None = None

  def __init__(self, config: Config, cluster: Cluster):
    self.config = config
    self.cluster = cluster

  @classmethod
  def get(cls) -> Env:
    if cls._current is None:
      raise StateError("epl.init() has not been called. Start the program with\n"
                       "    import epljax as epl\n    epl.init()\n"
                       "before building scopes or a Trainer.")
    return cls._current

  def __repr__(self) -> str:
    return f"Env(config={self.config!r}, cluster={self.cluster!r})"


def init(config: Config | Mapping[str, Any] | None = None,
         devices: Sequence[jax.Device] | None = None) -> Env:
  """Starts epljax in this process and returns ``Env``.

  ``config`` is an ``epl.Config``, a dict of keys (``{"pipeline.num_micro_batch": 4}``) or
  ``None`` for the defaults and the ``EPL_*`` environment. Calling ``init`` again (a notebook,
  a test) replaces the configuration and forgets earlier scopes and the default strategy.

  ``devices``: plan for these instead of ``jax.devices()``: a subset of this job's devices,
  or compile-only devices of a cluster this machine is not (``epl.topology("h100", hosts=8,
  per_host=8)``), for which ``trainer.compile(batch)`` plans and compiles the step and nothing
  runs. A device's host is its ``process_index``.

  In one worker of a multi-process job (``python -m epljax.launch``, or Slurm / Open MPI) the
  first call connects the workers with ``jax.distributed.initialize``, before anything starts
  JAX's backend; ``Env.cluster`` then counts every process's devices (``epljax.launch.runtime``).
  """
  if config is None:
    config = Config()
  elif isinstance(config, Mapping):
    config = Config(config)
  elif not isinstance(config, Config):
    raise ConfigError(f"epl.init(config) expects an epl.Config, a dict or None; got "
                      f"{type(config).__name__}.")
  if devices is not None:
    devices = _given(devices)
  launch_runtime.initialize()   # before _cluster: jax.devices() would start the backend
  cluster = _cluster(config.cluster, devices if devices is not None else _PLANNED.devices)
  strategy.reset()
  annotations.reset()
  Env._current = Env(config, cluster)
  return Env._current


def kept_config(config: Config, what: str = "This Trainer") -> Env:
  """``what`` was made with ``config`` and keeps it: when the current ``epl.init`` has another
  configuration, warn that it does not apply and how to apply it. Returns the current ``Env``
  (callers check again only after the next ``init``)."""
  now = Env.get()
  if now.config != config:
    old, new = config.to_dict(), now.config.to_dict()
    diff = ", ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in new if new[k] != old[k])
    warnings.warn(_KEPT_CONFIG.format(what=what, diff=diff), stacklevel=_caller_outside_epljax())
  return now


_KEPT_CONFIG = """\
{what} was made before the last epl.init(...), which changed the configuration ({diff}).
It keeps the configuration it was made with; the new one does not apply to it. Make a new
Trainer after epl.init(new_config) (and its state with trainer.init, or restore a checkpoint):

    epl.init(new_config)
    trainer = epl.Trainer(init_fn, loss_fn, optimizer)
    state = trainer.init(rng, batch)"""


def _caller_outside_epljax() -> int:
  root = os.path.dirname(os.path.abspath(__file__))
  frame, level = sys._getframe(2), 2
  while frame is not None and frame.f_code.co_filename.startswith(root):
    frame, level = frame.f_back, level + 1
  return level


class _Planned:
  """The devices ``python -m epljax.plan`` plans an unchanged script for: ``init`` without
  ``devices`` takes them while it runs the script (``planning_for``)."""
  devices: tuple[jax.Device, ...] | None = None


_PLANNED = _Planned()


@contextlib.contextmanager
def planning_for(devices: Sequence[jax.Device]) -> Iterator[None]:
  """While inside, ``epl.init`` without ``devices`` plans for ``devices`` (the CLI's
  ``--topology``); restored after."""
  saved = _PLANNED.devices
  _PLANNED.devices = _given(devices)
  try:
    yield
  finally:
    _PLANNED.devices = saved


def _given(devices: Sequence[jax.Device]) -> tuple[jax.Device, ...]:
  devices = tuple(devices)
  if not devices or not all(isinstance(d, jax.Device) for d in devices):
    raise ConfigError("epl.init(devices=...) takes a non-empty list of jax devices "
                      "(jax.devices(), a subset of them, or epl.topology(...)); got "
                      f"{[type(d).__name__ for d in devices][:4]}.")
  if len({d.platform for d in devices}) > 1 or len({d.device_kind for d in devices}) > 1:
    kinds = sorted({f"{d.platform}:{d.device_kind}" for d in devices})
    raise ConfigError(f"epl.init(devices=...) got devices of several kinds ({kinds}); one "
                      "mesh takes devices of one kind.")
  if len({d.id for d in devices}) < len(devices):
    raise ConfigError("epl.init(devices=...) names a device twice.")
  return devices


def _cluster(cfg: ClusterConfig, given: tuple[jax.Device, ...] | None = None) -> Cluster:
  devices = tuple(jax.devices()) if given is None else given
  if cfg.run_visible_devices:
    devices = _visible(devices, cfg.run_visible_devices)
  me = jax.process_index()
  hosts = sorted({d.process_index for d in devices})
  if me not in hosts:   # compile-only devices stand for hosts this process is not: the first
    me = hosts[0]
  return Cluster(
      worker_num=len(hosts) if given is not None else jax.process_count(),
      worker_index=me,
      total_gpu_num=len(devices),
      local_device_count=sum(d.process_index == me for d in devices),
      platform=devices[0].platform,
      devices=devices,
      compile_only=given is not None and not _runs_here(devices),
  )


# jax.devices as imported: ``python -m epljax.plan`` answers jax.devices() with the topology's
# devices while a script runs, and this must still tell them from the backend's own.
_backend_devices = jax.devices


def _runs_here(devices: tuple[jax.Device, ...]) -> bool:
  """Whether ``devices`` are devices of this job's backends (else compile-only)."""
  try:
    known = set(_backend_devices(devices[0].platform))
  except RuntimeError:   # no backend for that platform in this process
    return False
  return all(d in known for d in devices)


def _visible(devices: tuple[jax.Device, ...], spec: str) -> tuple[jax.Device, ...]:
  """Keeps the devices whose local id is listed in ``cluster.run_visible_devices``."""
  try:
    wanted = [int(p) for p in spec.split(",") if p.strip()]
  except ValueError:
    raise ConfigError(f"cluster.run_visible_devices={spec!r} must be comma-separated device "
                      "ids, for example '0,1,2,3'.") from None
  by_local_id: dict[int, list[jax.Device]] = {}
  for d in devices:
    by_local_id.setdefault(d.local_hardware_id if d.local_hardware_id is not None else d.id,
                           []).append(d)
  missing = [i for i in wanted if i not in by_local_id]
  if missing:
    raise ConfigError(f"cluster.run_visible_devices={spec!r} names device ids {missing} but "
                      f"this host has {sorted(by_local_id)}.")
  keep = {id(d) for i in wanted for d in by_local_id[i]}
  return tuple(d for d in devices if id(d) in keep)
