"""The pipeline in the plan: the stage table's rows and the lines under it (schedule, stash,
parameters, parts, model splits, state, balance, tied leaves), with the bytes a device keeps.

``Described`` holds them as methods, which ``builder.Pipeline`` inherits (so this module reads
the plan without importing it): ``epl.Plan`` reads ``stage_info()``, ``describe()``,
``blocks()`` and ``param_bytes_per_device``; all of it is read from the plan, nothing compiled
(the stash line and the kept bytes once ``with_features`` has traced the loop's branches).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from epljax.errors import listing, size
from epljax.pipeline import packing, slots
from epljax.pipeline.partition import Stage
from epljax.plan import leaf_bytes_per_device, render_text
from epljax.sharding.program import nbytes


@dataclasses.dataclass(frozen=True)
class StageInfo:
  """One row of the plan's stage table."""
  index: int
  name: str
  num_params: int
  param_bytes: int        # the stage's own parameters (before padding)
  incoming_bytes: int     # activations received per micro batch
  kept_bytes: int         # kept per micro batch for its backward (residuals, inputs)
  loop: str = "-"         # its repeated layers run as one scan: "6 x 33 ops" (``roll.py``)


class Described:
  """The plan's reading of a ``Pipeline`` (``builder.Pipeline`` inherits it): the stage table,
  the lines under it and the bytes a device keeps; read from the plan, nothing compiled."""

  # -- bytes per device -----------------------------------------------------------------------
  @property
  def param_bytes_per_device(self) -> int:
    """The parameters as stored: the user's leaves sharded over ``stage``, or with
    ``pipeline.param_layout='stage'`` the loop's slots (``Pipeline.params_shape``)."""
    if self.in_stages:
      return sum(leaf_bytes_per_device(a.shape, a.dtype, self.param_shardings[k])
                 for k, a in self.params_shape.items())
    return sum(leaf_bytes_per_device(a.shape, a.dtype, sh)
               for a, sh in zip(self.store.avals, self.store.shardings))

  def stage_param_bytes(self, stage: Stage) -> int:
    """A stage's own parameters per device of the stage (split over ``model`` where split)."""
    return sum(nbytes(self.all_avals[i]) // self._leaf_split(i) for i in stage.params)

  def _leaf_split(self, i: int) -> int:
    """Devices leaf (or part) ``i`` is split over (its spec, without ``stage``)."""
    return self.store.split_of(self.store.specs[self.parts.get(i, i)])

  # -- the plan -------------------------------------------------------------------------------
  def blocks(self) -> list[Any]:
    """The plan's "pipeline stages" section: the stage table, then the lines."""
    return [(["stage", "task graph", "params", "bytes/device", "activations in",
              "kept/micro batch", "loop"],
             [[i.index, i.name, i.num_params, size(i.param_bytes), size(i.incoming_bytes),
               size(i.kept_bytes), i.loop] for i in self.stage_info()]), *self.describe()]

  def text(self) -> str:
    """The section as ``print(trainer.plan)`` shows it (read from the plan, nothing compiled)."""
    return render_text([("pipeline stages", self.blocks())])

  def stage_info(self) -> list[StageInfo]:
    rows = []
    for stage in self.stages:
      kept = 0
      if self.loop is not None:
        branch = self.loop.branches[self.loop.branch_of[stage.index]]
        kept = branch.residuals.layout.nbytes
        kept += branch.incoming.nbytes if branch.needs_inputs else 0
      rows.append(StageInfo(stage.index, stage.name, len(stage.params),
                            self.stage_param_bytes(stage),
                            packing.Layout.of(stage.incoming).nbytes, kept,
                            f"{stage.rolled.repeats} x {stage.rolled.length} ops"
                            if stage.rolled else "-"))
    return rows

  def describe_split(self) -> list[str]:
    """Per tensor-parallel stage: its split and how much of it is split."""
    lines = []
    for stage, k in zip(self.stages, self.split):
      if k == 1:
        continue
      split = [i for i in stage.params if self._leaf_split(i) > 1]
      whole = sum(nbytes(self.all_avals[i]) for i in stage.params)
      lines.append(f"split     stage {stage.index} '{stage.name}': epl.split({k}) over model; "
                   f"{len(split)} of {len(stage.params)} parameters split, "
                   f"{size(self.stage_param_bytes(stage))} of {size(whole)} per device")
    return lines

  def describe(self) -> list[str]:
    """Lines for the plan: the schedule and what one device keeps."""
    lines = [f"schedule  {self.schedule.describe()}"]
    n_stages, virtual = self.schedule.num_stages, self.schedule.num_virtual_stages
    if virtual > 1:
      lines.append("chunks    " + "; ".join(
          f"stage {s}: " + ", ".join(f"'{self.stages[s + j * n_stages].name}'"
                                     for j in range(virtual)) for s in range(n_stages)))
    if self.loop is not None:
      buffers = self.loop.buffers
      per_slot = packing.nbytes(buffers.residuals) + (
          packing.nbytes(buffers.payload) if buffers.keep_inputs else 0)
      kept = "micro batches" if virtual == 1 else "micro batch chunks"
      lines.append(
          f"stash     residuals: {self.schedule.num_slots} {kept} x "
          f"{size(per_slot)} per device{' before the model split' if self.slotted else ''}; "
          f"{len(self.loop.branches)} distinct stage functions")
    if self.in_stages:
      lines.append(f"params    {size(self.param_bytes_per_device)} per device as stored, each "
                   "stage's leaves whole in the loop's slots (pipeline.param_layout='stage'; "
                   "the optimizer updates the slots), read in place inside the step")
    else:
      lines.append(f"params    {size(self.param_bytes_per_device)} per device as stored (the "
                   f"user's leaves, sharded over stage); {size(self.store.bytes_inside())} "
                   + self.store.inside)
    if self.parts:
      lines.append(
          f"parts     {len(self.parts)} stacked leaves (scanned layers) stored split over stage "
          f"on their layers axis; each stage reads its own {size(self.store.part_bytes())} "
          + ("where stored, never exchanged: " if self.schedule.num_virtual_stages == 1 else
             f"(chunks s, s + {self.schedule.num_stages}, ...), moved from where stored "
             "(contiguous layers per stage) once per step each way (at most "
             f"{self.schedule.num_virtual_stages} ppermutes per leaf): ")
          + listing([self.param_paths[i] for i in self.parts.values()]))
    lines += self.describe_split()
    lines += [f"loop      stage {s.index} '{s.name}': {s.unrolled}" for s in self.stages
              if s.unrolled]
    for stage in self.stages:
      if stage.state:
        held = sum(nbytes(slots.data_aval(self.state_avals[j])) for j in stage.state)
        means = (f"; its {len(stage.averaged)} batch means averaged over the replicas "
                 f"({', '.join(stage.row_axes)})" if stage.averaged else "")
        lines.append(f"state     stage {stage.index} '{stage.name}' keeps {len(stage.state)} model "
                     f"state leaves ({size(held)}), updated by each micro batch's forward in "
                     f"order{means}")
    lines += [f"balance   {row}" for row in self.balance]
    lines += self.constraints
    for i, holders in self.shared.items():
      names = ", ".join(f"'{self.stages[h].name}'" for h in holders)
      lines.append(f"tied      '{self.param_paths[i]}' held by stages {names}; their gradients "
                   "are summed")
    return lines
