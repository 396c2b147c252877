"""Grouped apply (``optimizer.num_apply_group``): run the optimizer update group by group.

An optimizer that makes large temporaries per parameter (a preconditioner, a factored
second moment) needs them for every parameter at once if the compiler schedules the updates
side by side. Here the parameters are split into N groups of about equal bytes (largest first,
each to the lightest group), and the traced update is re-run so that group g+1 starts only once
group g's results exist (its inputs are tied to them, see ``recompute.after``): the peak holds
one group's temporaries. The equations are the optimizer's own, so the result is the same as
one group, including what couples all parameters (a global-norm clip, a step count): those
equations feed several groups and run first.
"""

from __future__ import annotations

import jax
from jax.extend import core as jcore

from epljax import step as step_lib
from epljax.config import OptimizerConfig
from epljax.features import BuildContext, Feature, UpdateFn
from epljax.memory.recompute import after
from epljax.sharding.program import (Steps, finish, live_across, nbytes, run_steps, start_env,
                                     trace_steps)

COMMON = -1


def balanced_groups(sizes: list[int], count: int) -> list[int]:
  """Group of each item: largest first, each to the group with the fewest bytes so far."""
  count = max(1, min(count, len(sizes)))
  totals = [0] * count
  group = [0] * len(sizes)
  for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
    g = min(range(count), key=lambda k: (totals[k], k))
    group[i] = g
    totals[g] += sizes[i]
  return group


class GroupedApply(Feature):
  """``optimizer.num_apply_group`` > 1 (see the module docstring)."""

  name = "grouped_apply"
  rewrites_update = True

  def __init__(self, config: OptimizerConfig):
    self.count = config.num_apply_group
    self._groups = 0

  def update(self, fn: UpdateFn, ctx: BuildContext) -> UpdateFn:
    platform = ctx.mesh.devices.flat[0].platform
    optimizer = ctx.optimizer

    def grouped(params, opt_state, grads, fstate):
      leaves, treedef = jax.tree.flatten(params)
      group = balanced_groups([nbytes(x) for x in leaves], self.count)
      self._groups = max(group) + 1
      owner = jax.tree.unflatten(treedef, group)
      opt_groups = step_lib.map_optimizer_state(optimizer, lambda _, g: g, opt_state, owner,
                                                non_params=lambda _: COMMON)
      out_groups = (group + jax.tree.leaves(opt_groups)
                    + [COMMON] * len(jax.tree.leaves(fstate)))
      program, flat = trace_steps(
          lambda p, o, g, f: fn(p, o, g, f), params, (opt_state, grads, fstate))
      return _run_grouped(program, flat, out_groups, self._groups, platform)

    return grouped

  def describe(self) -> str:
    return (f"optimizer update applied in {self.count} size-balanced groups, one after "
            "another (optimizer.num_apply_group)")


def _step_groups(program: Steps, out_groups: list[int]) -> list[set]:
  """For every step, the set of output groups it feeds (COMMON included)."""
  feeds_key: dict = {}
  for key, g in zip(program.outputs, out_groups):
    if not isinstance(key, jcore.Literal):
      feeds_key.setdefault(key, set()).add(g)
  found: list[set] = [set()] * len(program.steps)
  for step in reversed(program.steps):
    feeds = set()
    for k in step.outputs:
      if k is not None:
        feeds |= feeds_key.get(k, set())
    found[step.index] = feeds
    for a in step.inputs:
      if not isinstance(a, jcore.Literal):
        feeds_key.setdefault(a, set()).update(feeds)
  return found


def _run_grouped(program, flat, out_groups, count, platform):
  feeds = _step_groups(program, out_groups)
  common = [s for s in program.steps if len(feeds[s.index]) > 1 or COMMON in feeds[s.index]]
  dead = [s for s in program.steps if not feeds[s.index]]
  by_group = [[s for s in program.steps if feeds[s.index] == {g}] for g in range(count)]
  env = start_env(program, flat)
  run_steps(common, env)
  previous: list = []
  outputs = {k for k in program.outputs if not isinstance(k, jcore.Literal)}
  for steps in by_group:
    if not steps:
      continue
    needed, _ = live_across(program, steps)
    defined = {k for s in steps for k in s.outputs if k is not None}
    if previous:
      tied = after([env[k] for k in needed], previous, platform=platform)
      local = {**env, **dict(zip(needed, tied))}
    else:
      local = dict(env)
    run_steps(steps, local)
    outs = [k for s in steps for k in s.outputs if k in outputs]   # in trace order
    env.update({k: local[k] for k in defined})
    previous = [local[k] for k in outs] or previous
  run_steps(dead, env)
  return finish(program, env)
