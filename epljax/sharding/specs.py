"""Task graphs -> ``PartitionSpec`` of every variable leaf, and of the batch.

A leaf of a ``replicate`` task graph is replicated on every device of the mesh: data
parallelism keeps a full copy per device and GSPMD all-reduces its gradient over the batch axes.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import PartitionSpec as P

from epljax.errors import PlanError
from epljax.mesh import DATA, MODEL, Layout
from epljax.sharding.capture import Capture
from epljax.strategy import REPLICATE


def variable_specs(capture: Capture, layout: Layout) -> list[P]:
  """One spec per variable leaf of the capture, in its order."""
  specs = []
  for tg_index, path in zip(capture.input_taskgraph, capture.input_paths):
    if tg_index is None:
      specs.append(P())
      continue
    tg = capture.taskgraphs[tg_index]
    if tg.strategy == REPLICATE:
      specs.append(P())
    else:
      raise PlanError(f"Parameter '{path}' is in task graph '{tg.name}' ({tg.strategy}"
                      f"({tg.device_count})), and split task graphs are not supported yet.")
  return specs


def batch_axes(capture: Capture, layout: Layout) -> tuple[str, ...]:
  """Mesh axes the batch dimension is split over.

  Replicas always take their own rows (``data``). Inside a replica, ``replicate(k)`` splits the
  replica's micro batch over its k devices (EPL), so the batch is split over ``model`` too.
  """
  if layout.devices_per_stage > 1 and all(
      tg.strategy == REPLICATE for tg in capture.taskgraphs):
    return (DATA, MODEL)
  return (DATA,)


def batch_spec(axes: Sequence[str], ndim: int) -> P:
  if ndim == 0:
    raise PlanError("A batch leaf is a scalar; every batch leaf needs a leading batch dimension.")
  return P(tuple(axes))
