"""Task graphs -> ``PartitionSpec`` of every variable leaf, and of the batch.

In order of precedence, a variable leaf gets:
1. the spec the user gave (``epl.annotate`` parameter rule or Flax metadata; see
   ``annotations.py``);
2. in a ``split`` task graph, the split rule its uses decide (``split_rules.py``), over the
   ``model`` axis;
3. otherwise replication: a ``replicate`` task graph keeps a full copy per device and GSPMD
   reduces its gradient over the batch axes.

In a colocated layout only parameters used inside a split scope (or an annotated module, or
under a split default strategy) are split: code outside every scope that joined the split task
graph by data flow keeps its parameters replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec as P

from epljax.errors import PlanError
from epljax.mesh import MODEL, Layout, data_axes
from epljax.sharding.annotations import UserSpec
from epljax.sharding.capture import Capture
from epljax.sharding.split_rules import split_decisions
from epljax.strategy import REPLICATE, SPLIT


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """A variable leaf's spec and why it has it (shown in the plan)."""
  spec: P
  rule: str = ""
  parts: int = 1          # > 1: a fusion of equal parts on the split dim, held part by part
  dim: int | None = None  # the split dim (``fused.py``)


def variable_specs(capture: Capture, layout: Layout, shapes: Sequence[tuple[int, ...]],
                   user: Mapping[int, UserSpec] | None = None) -> list[LeafSpec]:
  """One spec per variable leaf of the capture, in its order."""
  user = user or {}
  candidates = {
      i for i, tg in enumerate(capture.input_taskgraph)
      if tg is not None and capture.taskgraphs[tg].strategy == SPLIT and i not in user
      and (capture.input_explicit[i] or not layout.colocated)}
  fixed = {i: d for i, u in user.items() if (d := dim_over(u.spec, MODEL)) is not None}
  decisions, kept = split_decisions(capture.program, candidates, shapes, capture.input_paths,
                                    layout.devices_per_stage, fixed)
  out = []
  for i, shape in enumerate(shapes):
    if i in user:
      out.append(LeafSpec(user[i].spec, f"user: {user[i].source}"))
    elif i in decisions:
      d = decisions[i]
      rule = d.rule if d.parts == 1 else f"{d.rule}, {d.parts} fused parts"
      out.append(LeafSpec(spec_for(len(shape), d.dim, MODEL), rule, d.parts, d.dim))
    else:
      out.append(LeafSpec(P(), kept.get(i, "")))
  return out


def batch_axes(capture: Capture, layout: Layout) -> tuple[str, ...]:
  """Mesh axes the batch dimension is split over.

  Replicas always take their own rows (``data``; ``replica`` and ``data`` under hybrid
  sharding). Inside a replica, ``replicate(k)`` splits the replica's micro batch over its k
  devices (EPL), so the batch is split over ``model`` too when a replicate task graph spans
  the replica's devices. A split-only model keeps each replica's
  batch whole on its devices (Megatron-style tensor parallelism).
  """
  if layout.devices_per_stage > 1 and layout.colocated and any(
      tg.strategy == REPLICATE for tg in capture.taskgraphs):
    return (*data_axes(layout.mesh), MODEL)
  return data_axes(layout.mesh)


def batch_spec(axes: Sequence[str], ndim: int) -> P:
  if ndim == 0:
    raise PlanError("A batch leaf is a scalar; every batch leaf needs a leading batch dimension.")
  return P(tuple(axes))


def spec_for(ndim: int, dim: int | None, axis: str) -> P:
  """The PartitionSpec splitting ``dim`` over ``axis`` (replicated when ``dim`` is None)."""
  if dim is None:
    return P()
  return P(*[axis if i == dim else None for i in range(ndim)])


def dim_over(spec: P, axis: str) -> int | None:
  """The one dimension ``spec`` splits over ``axis`` alone, or None."""
  dims = [d for d, e in enumerate(spec) if (e if isinstance(e, tuple) else (e,)) == (axis,)]
  return dims[0] if len(dims) == 1 else None
