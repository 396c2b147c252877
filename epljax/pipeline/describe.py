"""The pipeline in the plan: the stage table's rows and the lines under it (schedule, stash,
parameters, parts, model splits, state, balance, tied leaves), with the bytes a device keeps.

``epl.Plan`` reads them through the ``Pipeline``'s ``stage_info()``, ``describe()`` and
``param_bytes_per_device`` (``builder.py``); all of it is read from the plan, nothing compiled
(the stash line and the kept bytes once ``with_features`` has traced the loop's branches).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from epljax.errors import listing, size
from epljax.pipeline import packing, slots
from epljax.pipeline.partition import Stage
from epljax.plan import leaf_bytes_per_device, render_text
from epljax.sharding.program import nbytes

if TYPE_CHECKING:
  from epljax.pipeline.builder import Pipeline


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


# -- bytes per device -----------------------------------------------------------------------
def param_bytes_per_device(pipe: Pipeline) -> int:
  """The parameters as stored: the user's leaves sharded over ``stage``, or with
  ``pipeline.param_layout='stage'`` the loop's slots (``Pipeline.params_shape``)."""
  if pipe.in_stages:
    return sum(leaf_bytes_per_device(a.shape, a.dtype, pipe.param_shardings[k])
               for k, a in pipe.params_shape.items())
  return sum(leaf_bytes_per_device(a.shape, a.dtype, sh)
             for a, sh in zip(pipe.store.avals, pipe.store.shardings))


def stage_param_bytes(pipe: Pipeline, stage: Stage) -> int:
  """A stage's own parameters per device of the stage (split over ``model`` where split)."""
  return sum(nbytes(pipe.all_avals[i]) // _leaf_split(pipe, i) for i in stage.params)


def _leaf_split(pipe: Pipeline, i: int) -> int:
  """Devices leaf (or part) ``i`` is split over (its spec, without ``stage``)."""
  return pipe.store.split_of(pipe.store.specs[pipe.parts.get(i, i)])


# -- the plan -------------------------------------------------------------------------------
def blocks(pipe: Pipeline) -> list[Any]:
  """The plan's "pipeline stages" section: the stage table, then the lines."""
  return [(["stage", "task graph", "params", "bytes/device", "activations in",
            "kept/micro batch", "loop"],
           [[i.index, i.name, i.num_params, size(i.param_bytes), size(i.incoming_bytes),
             size(i.kept_bytes), i.loop] for i in stage_info(pipe)]), *describe(pipe)]


def text(pipe: Pipeline) -> str:
  """The section as ``print(trainer.plan)`` shows it (read from the plan, nothing compiled)."""
  return render_text([("pipeline stages", blocks(pipe))])


def stage_info(pipe: Pipeline) -> list[StageInfo]:
  rows = []
  for stage in pipe.stages:
    kept = 0
    if pipe.loop is not None:
      branch = pipe.loop.branches[pipe.loop.branch_of[stage.index]]
      kept = branch.residuals.layout.nbytes
      kept += branch.incoming.nbytes if branch.needs_inputs else 0
    rows.append(StageInfo(stage.index, stage.name, len(stage.params),
                          stage_param_bytes(pipe, stage),
                          packing.Layout.of(stage.incoming).nbytes, kept,
                          f"{stage.rolled.repeats} x {stage.rolled.length} ops"
                          if stage.rolled else "-"))
  return rows


def describe_split(pipe: Pipeline) -> list[str]:
  """Per tensor-parallel stage: its split and how much of it is split."""
  lines = []
  for stage, k in zip(pipe.stages, pipe.split):
    if k == 1:
      continue
    split = [i for i in stage.params if _leaf_split(pipe, i) > 1]
    whole = sum(nbytes(pipe.all_avals[i]) for i in stage.params)
    lines.append(f"split     stage {stage.index} '{stage.name}': epl.split({k}) over model; "
                 f"{len(split)} of {len(stage.params)} parameters split, "
                 f"{size(stage_param_bytes(pipe, stage))} of {size(whole)} per device")
  return lines


def describe(pipe: Pipeline) -> list[str]:
  """Lines for the plan: the schedule and what one device keeps."""
  lines = [f"schedule  {pipe.schedule.describe()}"]
  n_stages, virtual = pipe.schedule.num_stages, pipe.schedule.num_virtual_stages
  if virtual > 1:
    lines.append("chunks    " + "; ".join(
        f"stage {s}: " + ", ".join(f"'{pipe.stages[s + j * n_stages].name}'"
                                   for j in range(virtual)) for s in range(n_stages)))
  if pipe.loop is not None:
    buffers = pipe.loop.buffers
    per_slot = packing.nbytes(buffers.residuals) + (
        packing.nbytes(buffers.payload) if buffers.keep_inputs else 0)
    kept = "micro batches" if virtual == 1 else "micro batch chunks"
    lines.append(
        f"stash     residuals: {pipe.schedule.num_slots} {kept} x "
        f"{size(per_slot)} per device{' before the model split' if pipe.slotted else ''}; "
        f"{len(pipe.loop.branches)} distinct stage functions")
  if pipe.in_stages:
    lines.append(f"params    {size(param_bytes_per_device(pipe))} per device as stored, each "
                 "stage's leaves whole in the loop's slots (pipeline.param_layout='stage'; "
                 "the optimizer updates the slots), read in place inside the step")
  else:
    lines.append(f"params    {size(param_bytes_per_device(pipe))} per device as stored (the "
                 f"user's leaves, sharded over stage); {size(pipe.store.bytes_inside())} "
                 + pipe.store.inside)
  if pipe.parts:
    lines.append(
        f"parts     {len(pipe.parts)} stacked leaves (scanned layers) stored split over stage "
        f"on their layers axis; each stage reads its own {size(pipe.store.part_bytes())} "
        + ("where stored, never exchanged: " if pipe.schedule.num_virtual_stages == 1 else
           f"(chunks s, s + {pipe.schedule.num_stages}, ...), moved from where stored "
           "(contiguous layers per stage) once per step each way (at most "
           f"{pipe.schedule.num_virtual_stages} ppermutes per leaf): ")
        + listing([pipe.param_paths[i] for i in pipe.parts.values()]))
  lines += describe_split(pipe)
  lines += [f"loop      stage {s.index} '{s.name}': {s.unrolled}" for s in pipe.stages
            if s.unrolled]
  for stage in pipe.stages:
    if stage.state:
      held = sum(nbytes(slots.data_aval(pipe.state_avals[j])) for j in stage.state)
      means = (f"; its {len(stage.averaged)} batch means averaged over the replicas "
               f"({', '.join(stage.row_axes)})" if stage.averaged else "")
      lines.append(f"state     stage {stage.index} '{stage.name}' keeps {len(stage.state)} model "
                   f"state leaves ({size(held)}), updated by each micro batch's forward in "
                   f"order{means}")
  lines += [f"balance   {row}" for row in pipe.balance]
  lines += pipe.constraints
  for i, holders in pipe.shared.items():
    names = ", ".join(f"'{pipe.stages[h].name}'" for h in holders)
    lines.append(f"tied      '{pipe.param_paths[i]}' held by stages {names}; their gradients "
                 "are summed")
  return lines
