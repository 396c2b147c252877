"""The pipeline in the plan: the stage table's rows and the lines under it (schedule, stash,
parameters, parts, model splits, state, balance, tied leaves), with the bytes a device keeps.

``epl.Plan`` reads them through the ``Pipeline``'s ``stage_info()``, ``describe()`` and
``param_bytes_per_device`` (``builder.py``); nothing here changes the pipeline.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from epljax.errors import listing, size
from epljax.pipeline import packing, runtime, slots, storage
from epljax.pipeline.partition import Stage
from epljax.plan import leaf_bytes_per_device

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
  """The user's leaves as stored (sharded over ``stage``)."""
  if pipe._stored is None:
    return packing.nbytes(pipe.sizes)
  return sum(leaf_bytes_per_device(a.shape, a.dtype, sh)
             for a, sh in zip(pipe.param_avals, pipe._stored))


def packed_bytes_per_device(pipe: Pipeline) -> int:
  """One stage's packed parameters inside the step (the largest stage); with slots, one
  row of every slot (split over ``model`` where the slot is)."""
  if pipe.slotted:
    return sum(t.nbytes // _split_of(pipe, t.spec) for _, t in pipe.slot_layouts[0].types)
  return packing.nbytes(pipe.sizes) + part_bytes_per_device(pipe)


def part_bytes_per_device(pipe: Pipeline) -> int:
  """The stage's chunks of stacked leaves (kept where they are stored; ``v`` chunks each with
  virtual stages)."""
  return pipe.schedule.num_virtual_stages * sum(
      math.prod(pipe.all_avals[v].shape) * pipe.all_avals[v].dtype.itemsize
      // _leaf_split(pipe, v) for v in pipe.parts)


def stage_param_bytes(pipe: Pipeline, stage: Stage) -> int:
  """A stage's own parameters per device of the stage (split over ``model`` where split)."""
  return sum(math.prod(pipe.all_avals[i].shape) * pipe.all_avals[i].dtype.itemsize
             // _leaf_split(pipe, i) for i in stage.params)


def _split_of(pipe: Pipeline, spec: Sequence[Any]) -> int:
  return math.prod(storage.axis_size(pipe.mesh, e) for e in spec if e is not None)


def _leaf_split(pipe: Pipeline, i: int) -> int:
  """Devices leaf (or part) ``i`` is split over (its spec, without ``stage``)."""
  return _split_of(pipe, pipe.param_specs[pipe.parts.get(i, i)])


# -- the plan -------------------------------------------------------------------------------
def stage_info(pipe: Pipeline) -> list[StageInfo]:
  rows = []
  for stage in pipe.stages:
    branch = pipe.branches[pipe.branch_of[stage.index]] if pipe.branches else None
    kept = 0
    if branch is not None:
      kept = packing.nbytes(branch.residuals.layout.sizes)
      kept += packing.nbytes(branch.incoming.sizes) if branch.needs_inputs else 0
    rows.append(StageInfo(stage.index, stage.name, len(stage.params),
                          stage_param_bytes(pipe, stage),
                          packing.nbytes(packing.Layout.of(stage.incoming).sizes), kept,
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
    whole = sum(math.prod(pipe.all_avals[i].shape) * pipe.all_avals[i].dtype.itemsize
                for i in stage.params)
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
        f"stage {s}: " + ", ".join(f"'{pipe.stages[c].name}'" for c in pipe.rows[
            s * virtual:(s + 1) * virtual]) for s in range(n_stages)))
  if pipe.buffers is not None:
    per_slot = runtime.buffer_nbytes(pipe.buffers.residuals) + (
        packing.nbytes(pipe.buffers.payload) if pipe.buffers.keep_inputs else 0)
    kept = "micro batches" if virtual == 1 else "micro batch chunks"
    lines.append(
        f"stash     {pipe.stash}: {pipe.schedule.num_slots} {kept} (+1 scratch slot) x "
        f"{size(per_slot)} per device{' before the model split' if pipe.slotted else ''}; "
        f"{len(pipe.branches)} distinct stage functions")
  inside = ("in slots (whole arrays, split over model) inside the step" if pipe.slotted else
            "packed for the largest stage inside the step")
  lines.append(f"params    {size(param_bytes_per_device(pipe))} per device as stored (the "
               f"user's leaves, sharded over stage); {size(packed_bytes_per_device(pipe))} "
               + inside)
  if pipe.parts:
    lines.append(
        f"parts     {len(pipe.parts)} stacked leaves (scanned layers) stored split over stage "
        f"on their layers axis; each stage reads its own {size(part_bytes_per_device(pipe))} "
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
      nbytes = sum(math.prod(slots.data_aval(pipe.state_avals[j]).shape)
                   * slots.data_aval(pipe.state_avals[j]).dtype.itemsize
                   for j in stage.state)
      means = (f"; its {len(stage.averaged)} batch means averaged over the replicas "
               f"({', '.join(stage.row_axes)})" if stage.averaged else "")
      lines.append(f"state     stage {stage.index} '{stage.name}' keeps {len(stage.state)} model "
                   f"state leaves ({size(nbytes)}), updated by each micro batch's forward in "
                   f"order{means}")
  lines += [f"balance   {row}" for row in pipe.balance]
  lines += pipe.constraints
  for i, holders in pipe.shared.items():
    names = ", ".join(f"'{pipe.stages[h].name}'" for h in holders)
    lines.append(f"tied      '{pipe.param_paths[i]}' held by stages {names}; their gradients "
                 "are summed")
  return lines
