"""The cost model of ``auto.auto_parallel``'s plan search and of ``trainer.plan``: the
predicted step time of a compiled program.

Predicted step time = FLOPs / (peak x efficiency) + the communication compute does not hide
+ host transfers (offload) + the pipeline bubble. A collective costs its fixed latency and its
bytes on the wire / the bandwidth of the links its mesh axis runs over (within a host, or
across hosts); what of it is hidden is read from the compiled schedule (``epljax.overlap``:
async start/done pairs and the compute XLA placed between them). The FLOPs come from
``cost_analysis()`` with loop bodies counted per iteration (``epljax.flops``; a pipeline's from
its schedule, ``epljax.pipeline.cost``), the collectives from the compiled HLO (loop bodies
times their trip count, ``hlo``), never from wall time. The chips and links are
``epljax.chips``' table, each figure with its source.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from epljax import chips, hlo, overlap
from epljax.chips import Chip
from epljax.errors import PlanError
from epljax.flops import compiled_flops, instruction_matmul_flops
from epljax.mesh import hosts
from epljax.pipeline import cost as pipeline_cost


@dataclasses.dataclass(frozen=True)
class StepCost:
  """What one step costs per device: bytes, FLOPs, collective bytes per (kind, mesh axis),
  and the predicted seconds of each part."""
  bytes_per_device: int
  flops: float
  collective_bytes: dict[tuple[str, str], int]   # result bytes, as the HLO states them
  compute_s: float
  comm_s: dict[tuple[str, str], float]
  host_s: float = 0.0
  bubble_s: float = 0.0
  parts: dict[str, int] = dataclasses.field(default_factory=dict)  # estimate: what the bytes are
  hidden_s: float = 0.0   # of ``comm_s``, what runs while compute runs (``epljax.overlap``)
  activations: Activations | None = None   # estimate: what its "activations" part is made of

  @property
  def communication_s(self) -> float:
    """Every collective's time, hidden or not."""
    return sum(self.comm_s.values())

  @property
  def exposed_s(self) -> float:
    """The communication the step waits for: all of it less what compute hides."""
    return max(0.0, self.communication_s - self.hidden_s)

  @property
  def step_s(self) -> float:
    return self.compute_s + self.exposed_s + self.host_s + self.bubble_s


@dataclasses.dataclass(frozen=True)
class Activations:
  """An estimate's activation bytes, ``max(residuals + accumulator, floor)``: the residuals
  the backward pass keeps (estimated from the traced program), the gradient accumulator under
  micro batches, and the gradients' sum over data, which the peak holds instead once the
  residuals are freed. A compiled step rescales the residuals, or where its peak was the
  floor, the floor (``bytes``'s scales, ``search._calibrated``)."""
  residuals: float
  accumulator: int = 0
  floor: int = 0

  @property
  def at_floor(self) -> bool:
    """Whether the estimated peak is the gradients' sum, not the backward pass."""
    return self.floor > self.residuals + self.accumulator

  def bytes(self, scale: float = 1.0, floor_scale: float = 1.0) -> int:
    return int(max(self.residuals * scale + self.accumulator, self.floor * floor_scale))


def wire_bytes(kind: str, result_bytes: float, group: int) -> float:
  """Bytes one device sends for a collective over ``group`` devices (ring algorithms)."""
  if group <= 1:
    return 0.0
  share = (group - 1) / group
  return {"all-reduce": 2 * share * result_bytes, "all-gather": share * result_bytes,
          "reduce-scatter": (group - 1) * result_bytes, "all-to-all": share * result_bytes,
          }.get(kind, result_bytes)


def link_seconds(kind: str, result_bytes: float, group: int, across_hosts: bool,
                 chip: Chip) -> float:
  if group <= 1:
    return 0.0
  bandwidth = chip.inter_host_bandwidth if across_hosts else chip.intra_host_bandwidth
  return chip.latency_s + wire_bytes(kind, result_bytes, group) / bandwidth


def compiled_cost(compiled, mesh, chip: Chip, host_bytes: int = 0,
                  executed=hlo.executed_collectives) -> StepCost:
  """The ``StepCost`` of a compiled step: ``memory_analysis()`` bytes (arguments + outputs -
  aliased + temp), ``cost_analysis()`` FLOPs, and the HLO's executed collectives per axis
  (``executed`` reads them from the text; a pipeline's: ``Pipeline.executed_collectives``)."""
  mem = compiled.memory_analysis()
  nbytes = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes)
  hlo_text = compiled.as_text()
  flops = compiled_flops(compiled, hlo_text)
  coll: dict[tuple[str, str], int] = {}
  secs: dict[tuple[str, str], float] = {}
  # Newer XLA writes some groups as ``mesh[...], device_ids=(...) {axes}``: keep the device
  # ids with the groups, which ``hlo`` reads up to the next attribute.
  text = _MESH_IDS.sub(lambda m: f"replica_groups={m[1]}@{m[2]} {m[3]}", hlo_text)
  for c in executed(text):
    axis, group, across = collective_axis(c, mesh)
    key = (c.kind, axis)
    coll[key] = coll.get(key, 0) + c.bytes
    secs[key] = secs.get(key, 0.0) + link_seconds(c.kind, c.bytes, group, across, chip)
  return StepCost(nbytes, flops, coll, flops / (chip.peak_flops * chip.efficiency), secs,
                  host_s=host_bytes / chip.host_bandwidth,
                  hidden_s=hidden_seconds(text, mesh, chip))


def hidden_seconds(hlo_text: str, mesh, chip: Chip) -> float:
  """Seconds of the step's collectives that its schedule runs beside compute
  (``overlap.replay``: each collective priced as ``compiled_cost`` prices it, compute at
  ``chip``'s rate)."""
  def seconds(c: hlo.Collective) -> float:
    _, group, across = collective_axis(c, mesh)
    return link_seconds(c.kind, c.bytes, group, across, chip)

  return overlap.replay(hlo_text, seconds, instruction_matmul_flops,
                        chip.peak_flops * chip.efficiency).hidden_s


@dataclasses.dataclass(frozen=True)
class Target:
  """What the plan is measured against: the devices' chip (``epljax.chips``; None with the
  reason when the table has no figures for them), the memory limit, what offload moves."""
  chip: Any
  chip_note: str
  memory_limit: int | None
  offload: str

  @classmethod
  def of(cls, config, cluster) -> Target:
    try:   # (every process reads the same chip: ``chips.agreed``)
      chip, note = chips.agreed(chips.chip_of(cluster.devices, config.auto)), ""
    except PlanError as e:
      chip, note = None, "no prediction: " + str(e).splitlines()[0]
    limit = config.auto.memory_limit or (chip.memory_bytes if chip else None)
    return cls(chip, note, limit, config.offload.level)

  def step_cost(self, plan) -> StepCost:
    """The predicted cost of ``plan``'s compiled step (``cost.step_cost``)."""
    from epljax.memory import offload   # (what offload moves, not in the HLO)

    host = offload.footprint(self.offload, {"parameters": plan.param_bytes,
                                            "optimizer state": plan.optimizer_bytes})[1]
    return step_cost(plan.compiled, plan.mesh, self.chip, plan.pipeline, host)


def step_cost(compiled, mesh, chip: Chip, pipe=None, host_bytes: int = 0) -> StepCost:
  """``compiled_cost`` of a train step; with pipeline stages (``pipe``, an
  ``epljax.pipeline.Pipeline``) its FLOPs and bubble from the schedule
  (``epljax.pipeline.cost.compute``)."""
  if pipe is None:
    return compiled_cost(compiled, mesh, chip, host_bytes)
  # A device of the busiest stage: its branch of each tick's switch, as the schedule says.
  step = compiled_cost(compiled, mesh, chip, host_bytes, pipe.executed_collectives)
  work = pipeline_cost.compute(pipe, compiled)
  rate = chip.peak_flops * chip.efficiency
  # (No overlap credited: the replay prices the tick loop's switch as its costliest branch on
  # every tick, not the schedule's busy slots; a pipeline's collectives count whole.)
  return dataclasses.replace(step, flops=work.work, compute_s=work.work / rate,
                             bubble_s=work.bubble / rate, hidden_s=0.0)


def collective_axis(c: hlo.Collective, mesh) -> tuple[str, int, bool]:
  """(the mesh axes a collective's groups span, e.g. ``"data"`` or ``"data+model"``; its group
  size; whether a group spans hosts): ``mesh.hosts.describe`` of its device groups. ``"?"``
  when the groups are in a form not read, or not lines of the mesh."""
  groups = _mesh_id_groups(c.replica_groups) or c.device_groups(mesh.size)
  if not groups:
    return "?", c.group_size or 1, False
  return hosts.describe(groups, mesh)


_MESH_IDS = re.compile(r"replica_groups=(mesh\[[^\]]*\]), "
                       r"device_ids=\((\[[\d,]*\](?:T\([\d,]*\))?)\)\s*(\{[^}]*\})")
_MESH_ID_FORM = re.compile(r"mesh\[(.*?)\]@\[([\d,]+)\](?:T\(([\d,]+)\))?\s*\{(.*?)\}")


def _mesh_id_groups(text: str) -> list[list[int]] | None:
  """``mesh['axis_0'=2,'axis_1'=4]@[4,2]T(1,0) {'axis_0'}``: devices ``iota`` reshaped and
  transposed, laid out on the named axes row-major; each group spans the axes in braces."""
  m = _MESH_ID_FORM.match(text.strip())
  if not m:
    return None
  named = re.findall(r"'(\w+)'=(\d+)", m[1])
  sizes = [int(n) for _, n in named]
  dims = [int(d) for d in m[2].split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  if m[3]:
    ids = ids.transpose([int(d) for d in m[3].split(",")])
  ids = ids.reshape(sizes)
  axes = [a for a, _ in named]
  inside = [axes.index(a) for a in re.findall(r"'(\w+)'", m[4]) if a in axes]
  outside = [d for d in range(len(sizes)) if d not in inside]
  return ids.transpose(outside + inside).reshape(
      -1, math.prod(sizes[d] for d in inside)).tolist()
