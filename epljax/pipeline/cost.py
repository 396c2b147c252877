"""What a pipeline's step computes, from its schedule: each stage's branches compiled alone, times
the busy slots the tick tables give them, and the bubble (``epljax.cost.step_cost`` prices it).

XLA's cost analysis of the whole step counts the tick loop once and its switch as the costliest
branch, so it cannot say what a pipeline executes; the schedule can.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from epljax import flops
from epljax.pipeline import packing, runtime
from epljax.pipeline.schedules import Schedule


@dataclasses.dataclass(frozen=True)
class Compute:
  """The FLOPs of a device of the busiest stage in one step: ``work``, what it executes (its
  branches' forward and backward in its busy slots, and the rest of the step: the optimizer
  update), and ``bubble``, what it would have executed in the ticks it waits (each tick runs
  at the pace of its busiest stage)."""
  work: float
  bubble: float


def compute(pipe, compiled) -> Compute:
  """The ``Compute`` of ``pipe``'s (an ``epljax.pipeline.Pipeline``) compiled step.

  The loss and gradient FLOPs are each branch's forward and backward (``branch_flops``,
  compiled alone) times its busy slots, per device; the rest of the step is what XLA's analysis
  of ``compiled`` counts beyond one tick of the costliest branches. The bubble is the ticks'
  paces less the device's work."""
  costs = branch_flops(pipe.loop, pipe.aux_avals, pipe.batch_avals)
  per_tick = tick_flops(costs, pipe.loop.branch_of, pipe.schedule)
  rest = max(0.0, flops.analysed_flops(compiled) - max(f for f, _ in costs)
             - max(b for _, b in costs))
  work = per_tick.sum() / pipe.schedule.num_stages
  return Compute(work + rest, per_tick.max(axis=1).sum() - work)


def branch_flops(loop: runtime.Loop, aux_avals, batch_avals) -> list[tuple[float, float]]:
  """``(forward, backward)`` FLOPs of one tick of each branch, from ``cost_analysis`` of the
  branch compiled alone, with the matmuls of its loops (rolled layers) counted per iteration
  (``flops.compiled_flops``). (The compiled step counts a loop body once and a switch as its
  costliest branch, so the executed FLOPs are these times the busy slots of the schedule.)"""
  sizes = loop.buffers
  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
  bufs = lambda d, lead=(): jax.eval_shape(lambda: packing.zeros(d, lead))  # noqa: E731

  batch = [sds(a) for a in batch_avals]
  params, state = bufs(sizes.params), bufs(sizes.state)
  out = []
  for b in loop.branches:
    fwd = jax.jit(b.bound(runtime.forward_branch(b, sizes, aux_avals))).lower(
        params, bufs(sizes.payload), batch, state).compile()
    bwd = jax.jit(b.bound(runtime.backward_branch(b, sizes))).lower(
        params, params, bufs(sizes.payload if sizes.keep_inputs else {}, (2,)),
        bufs(sizes.residuals, (2,)), jax.ShapeDtypeStruct((), jnp.int32), batch,
        bufs(sizes.grad_payload), jax.ShapeDtypeStruct((), jnp.float32)).compile()
    out.append((flops.compiled_flops(fwd), flops.compiled_flops(bwd)))
  return out


def tick_flops(costs: Sequence[tuple[float, float]], branch_of: Sequence[int],
               schedule: Schedule) -> np.ndarray:
  """``(ticks, stages)``: the FLOPs each stage runs at each tick, every busy slot running its
  chunk's branch (``costs``: ``branch_flops``; the loop's switch branches, ``runtime.tick_tables``).
  Their sum is what one replica executes."""
  fwd, bwd = (np.array([*c, 0.0]) for c in zip(*costs))   # the idle branch runs nothing
  tables = runtime.tick_tables(schedule, branch_of, idle=len(costs))
  return fwd[tables[..., 0]] + bwd[tables[..., 4]]
