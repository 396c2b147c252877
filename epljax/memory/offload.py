"""Host offload (``offload.level``): keep state in host memory, move it in when used.

- ``"v0"`` (EPL's): parameters live in host memory (``memory_kind="pinned_host"``). Inside the
  step each one is copied to the device at its use (``uses.ParamUses``); a matmul keeps the
  host copy for its backward pass and copies it in again there, so a weight is not resident
  on the device between its forward and backward use. Gradients come back in host memory (in
  JAX a value's memory space is part of its type, so the gradient of a host value is a host
  value); the update runs on the device with the optimizer state there, and the new
  parameters go back to the host.
- ``"v1"`` (beyond EPL, ZeRO-Offload style): the optimizer state lives in host memory too, and
  the update runs on the host (``compute_on("device_host")``): neither the state nor the
  update's temporaries take device memory.

Where the backend has no host memory kind, the feature says so once (a warning naming the
backend) and the state stays on the device.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import jax
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding

from epljax.config import OffloadConfig
from epljax.features import BuildContext, Feature, StateShardings, UpdateFn
from epljax.memory.zero import is_sharding
from epljax.mesh import STAGE

HOST = "pinned_host"


def host_memory_kind(device: jax.Device) -> str | None:
  """``"pinned_host"`` when ``device`` can address it, else None."""
  kinds = {m.kind for m in device.addressable_memories()}
  return HOST if HOST in kinds else None


def footprint(level: str, parts: dict[str, int]) -> tuple[dict[str, int], int]:
  """Offload ``level``'s footprint: (the bytes per device of each part left on the device,
  the bytes a step moves between host and device). v0 keeps the parameters in host memory,
  each copied in at its use and the new ones written back (2x); v1 the optimizer state too,
  read and written by the update on the host. What ``Offload.shardings`` places, for the
  plan search and the cost of a compiled step alike."""
  moved = {"v0": ("parameters",), "v1": ("parameters", "optimizer state")}.get(level, ())
  return ({k: 0 if k in moved else v for k, v in parts.items()},
          sum(2 * parts.get(k, 0) for k in moved))


def run_on_host(fn, *args):
  """``fn(*args)`` computed by the host, its results in host memory.

  jax 0.10's ``compute_on`` is a context manager; jax 0.11's wraps a function and names the
  results' memory spaces.
  """
  if "out_memory_spaces" not in inspect.signature(compute_on).parameters:   # jax 0.10
    with compute_on("device_host"):
      return fn(*args)
  return compute_on(fn, compute_type="device_host",
                    out_memory_spaces=jax.memory.Space.Host)(*args)


def on_host(sharding: NamedSharding) -> NamedSharding:
  return NamedSharding(sharding.mesh, sharding.spec, memory_kind=HOST)


class Offload(Feature):
  """``offload.level`` v0 or v1 (see the module docstring)."""

  name = "offload"

  def __init__(self, config: OffloadConfig):
    self.level = config.level
    self.active = False
    self._backend = ""
    self._stages = 1

  def shardings(self, shardings: StateShardings, ctx: BuildContext) -> StateShardings:
    device = ctx.mesh.devices.flat[0]
    self._backend = device.platform
    self._stages = ctx.mesh.shape.get(STAGE, 1)
    if host_memory_kind(device) is None:
      warnings.warn(f"offload.level={self.level!r}: the {device.platform} backend has no "
                    f"'{HOST}' memory, so parameters and optimizer state stay in device "
                    "memory.", stacklevel=2)
      return shardings
    self.active = True
    params = jax.tree.map(on_host, shardings.params, is_leaf=is_sharding)
    opt_state = shardings.opt_state
    if self.level == "v1":
      opt_state = jax.tree.map(on_host, opt_state, is_leaf=is_sharding)
    grads = shardings.grads
    if grads is not None:    # the gradient of a host value is a host value
      grads = jax.tree.map(on_host, grads, is_leaf=is_sharding)
    return dataclasses.replace(shardings, params=params, opt_state=opt_state, grads=grads)

  def update(self, fn: UpdateFn, ctx: BuildContext) -> UpdateFn:
    def placed(params, opt_state, grads, fstate):
      if not self.active:
        return fn(params, opt_state, grads, fstate)
      if self.level == "v1":   # on the host, next to the state
        grads = jax.device_put(grads, jax.memory.Space.Host)
        return run_on_host(fn, params, opt_state, grads, fstate)
      to_device = lambda t: jax.device_put(t, jax.memory.Space.Device)  # noqa: E731
      new_params, opt_state, fstate = fn(to_device(params), opt_state, to_device(grads), fstate)
      return jax.device_put(new_params, jax.memory.Space.Host), opt_state, fstate

    return placed

  def describe(self) -> str:
    if not self.active:
      return (f"offload {self.level}: not applied, the {self._backend} backend has no "
              f"'{HOST}' memory")
    what = "parameters" if self.level == "v0" else "parameters and optimizer state " \
        "(updated on the host)"
    if self._stages > 1:   # the pipeline packs its stages' parameters before its loop
      return (f"offload {self.level}: {what} in host memory ({HOST}) between steps; the "
              f"{self._stages} pipeline stages read theirs from device buffers packed once "
              "per step, not copied in at each use")
    return f"offload {self.level}: {what} in host memory ({HOST}), copied in at each use"
