"""What would make a plan fit: the config changes the plan search weighs (``epljax.candidates``:
``pipeline.num_micro_batch``, ``zero.level``, ``zero.shard_size``,
``gradient_checkpoint.type``, ``offload.level``) on the plan's own mesh, each estimated as the
search estimates a candidate (``candidates.estimate_row``), compiled on request.

``Plan.suggestions()`` answers with the cheapest that fit (lowest predicted step first, as the
search orders its rows); ``print(plan)`` names them when the plan does not fit, and
``python -m epljax.plan --suggest`` compiles them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from epljax.errors import EPLError, size
from epljax.memory import offload

_KEYS = ("pipeline.num_micro_batch", "zero.level", "zero.shard_size",
         "gradient_checkpoint.type", "offload.level")


@dataclasses.dataclass(frozen=True)
class Rebuild:
  """What the plan's Trainer was built from, so that it can build itself with other config
  values (set by ``Trainer``; a plan without it names no changes)."""
  built: Any                               # the plan's own build (``epljax.build.Built``)
  config: Any                              # its ``epl.Config``
  batch: Any                               # what trainer.init / compile got
  build: Callable[[dict[str, Any]], Any]   # config overrides -> a Built, compiled on use
  counts: Callable[[Any], dict[str, int]]  # batch -> {"examples", "tokens"} (Trainer._counts)


def in_this_context(build: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
  """``build``, run later inside the Flax logical axis rules in effect now: a script's
  ``with nn.logical_axis_rules(...)`` around ``trainer.init`` has ended when its plan is
  printed and its changes built."""
  from flax.core import spmd   # (where epljax.sharding.annotations reads them)

  rules = tuple(spmd.get_logical_axis_rules() or ())

  def build_here(overrides: dict[str, Any]) -> Any:
    with spmd.logical_axis_rules(rules):
      return build(overrides)

  return build_here


@dataclasses.dataclass(frozen=True)
class Change:
  """A config change and what it gives per device: estimated, and compiled when asked."""
  overrides: dict[str, Any]   # config keys -> values, as epl.init takes them
  estimated_bytes: int
  predicted_step_s: float     # the estimate's
  compiled_bytes: int | None = None
  refused: str = ""           # compiled: the EPLError its build raised, if any

  @property
  def text(self) -> str:
    return ", ".join(f"{k}={v if v != '' else chr(34) * 2}" for k, v in self.overrides.items())

  def line(self, limit: int | None) -> str:
    """``zero.level=v3: 41.2 GiB per device (estimated), step 350 ms predicted``."""
    if self.refused:
      got = f"{size(self.estimated_bytes)} per device (estimated); refused: {self.refused}"
    elif self.compiled_bytes is None:
      got = f"{size(self.estimated_bytes)} per device (estimated)"
    else:
      verdict = "" if limit is None or self.compiled_bytes <= limit else ", DOES NOT FIT"
      got = (f"{size(self.compiled_bytes)} per device compiled (estimated "
             f"{size(self.estimated_bytes)}{verdict})")
    step = self.predicted_step_s
    step_text = f"{step:.3g} s" if step >= 1 else f"{step * 1e3:.3g} ms"
    return f"{self.text}: {got}, step {step_text} predicted"


@dataclasses.dataclass(frozen=True)
class Found:
  changes: list[Change]   # the cheapest that fit by the estimates, cheapest first
  note: str = ""          # why there are none


def fitting(plan, rebuild: Rebuild, count: int = 3, compile: bool = False) -> Found:
  """The ``count`` cheapest changes that fit ``plan.memory_limit`` by the search's estimates
  (module doc); with ``compile``, each built and compiled, its bytes read from the program."""
  from epljax import candidates, estimate   # (they read plans: imported when first asked)

  if plan.pipeline is not None:
    return Found([], "changes are not estimated for pipeline stages; auto.auto_parallel=True "
                     "weighs stage layouts")
  if plan.chip is None or plan.memory_limit is None:
    return Found([], plan.chip_note or "no memory limit known")
  config = rebuild.config
  values = config.to_dict()
  defaults = type(config)(environ={}).to_dict()
  plain = {k: defaults[k] for k in _KEYS if values[k] != defaults[k]}
  try:
    base = rebuild.build(plain) if plain else rebuild.built
  except EPLError as e:
    return Found([], f"no changes estimated: {str(e).splitlines()[0]}")
  first = next(iter(plan.mesh.devices.flat))
  fixed = {}
  if first.platform == "cpu" or offload.host_memory_kind(first) is None:
    fixed["offload"] = ""   # (as the search: no host memory to offload to)
  facts = estimate.program_facts(base, "", bool(config.amp.level))
  residuals = estimate.residual_bytes(base.capture.program.closed_jaxpr)
  update = estimate.update_flops(base.user_state.optimizer, base.user_state.params_shape)
  batch_bytes = jax.process_count() * sum(
      math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(rebuild.batch))
  rows = sorted((candidates.estimate_row(base, facts, f, plan.chip, batch_bytes, "", residuals,
                                         update)
                 for f in candidates.feature_grid(fixed, base)), key=candidates.order)
  changes = []
  for row in rows:
    wanted = {**{k: defaults[k] for k in _KEYS}, **row.overrides}
    diff = {k: v for k, v in wanted.items() if v != values[k]}
    if diff:
      changes.append(Change(diff, row.bytes_per_device, row.predicted_step_s))
  fits: list[Change] = []
  for c in changes:   # (cheapest first: one that only adds keys to a listed one gains nothing)
    if c.estimated_bytes <= plan.memory_limit and not any(
        f.overrides.items() <= c.overrides.items() for f in fits):
      fits.append(c)
  if not fits:
    least = min(changes, key=lambda c: c.estimated_bytes, default=None)
    return Found([], "no change of " + ", ".join(_KEYS) + " on this mesh fits by the "
                 "estimates" + (f" (the least: {least.text}, {size(least.estimated_bytes)})"
                                if least else "")
                 + "; auto.auto_parallel=True also weighs model and stage axes")
  fits = fits[:count]
  if compile:
    fits = [_compiled(c, rebuild) for c in fits]
  return Found(fits)


def _compiled(change: Change, rebuild: Rebuild) -> Change:
  try:
    built = rebuild.build(change.overrides)
  except EPLError as e:   # (the estimate could not know: its build says why)
    return dataclasses.replace(change, refused=str(e).splitlines()[0])
  return dataclasses.replace(change, compiled_bytes=built.plan.bytes_per_device)

