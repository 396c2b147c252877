"""The cost model of ``auto.auto_parallel``'s plan search and of ``trainer.plan``: the
predicted step time of a compiled program.

Predicted step time = FLOPs / (peak x efficiency) + each collective's fixed latency and its
bytes on the wire / the bandwidth of the links its mesh axis runs over (within a host, or
across hosts) + host
transfers (offload) + the pipeline bubble. The FLOPs come from ``cost_analysis()``, the
collectives from the compiled HLO (loop bodies times their trip count, ``hlo``), never from
wall time. The chips and links are ``epljax.chips``' table, each figure with its source.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from epljax import hlo
from epljax.chips import Chip
from epljax.mesh import hosts


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

  @property
  def communication_s(self) -> float:
    return sum(self.comm_s.values())

  @property
  def step_s(self) -> float:
    return self.compute_s + self.communication_s + self.host_s + self.bubble_s


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


def compiled_cost(compiled, mesh, chip: Chip, host_bytes: int = 0) -> StepCost:
  """The ``StepCost`` of a compiled step: ``memory_analysis()`` bytes (arguments + outputs -
  aliased + temp), ``cost_analysis()`` FLOPs, and the HLO's executed collectives per axis."""
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
  for c in hlo.executed_collectives(text):
    axis, group, across = collective_axis(c, mesh)
    key = (c.kind, axis)
    coll[key] = coll.get(key, 0) + c.bytes
    secs[key] = secs.get(key, 0.0) + link_seconds(c.kind, c.bytes, group, across, chip)
  return StepCost(nbytes, flops, coll, flops / (chip.peak_flops * chip.efficiency), secs,
                  host_s=host_bytes / chip.host_bandwidth)


def compiled_flops(compiled, hlo_text: str | None = None) -> float:
  """``cost_analysis()`` FLOPs, with the matmuls of loop bodies counted once per iteration.

  XLA's cost analysis counts a ``while`` body once (gradient accumulation over 2 micro batches
  showed half the FLOPs of 1); the matmuls and convolutions of each body are added again for
  the iterations it left out (``known_trip_count``, ``hlo.executed_collectives``' reading).
  ``hlo_text``: ``compiled.as_text()``, where the caller has it already."""
  if hlo_text is None:
    hlo_text = compiled.as_text()
  return analysed_flops(compiled) + loop_matmul_flops(hlo_text)


def analysed_flops(compiled) -> float:
  """``cost_analysis()`` FLOPs as XLA counts them: a loop body once, a switch as its costliest
  branch."""
  cost = compiled.cost_analysis()
  if isinstance(cost, Sequence):   # older jax: one dict per program
    cost = cost[0] if cost else {}
  return float((cost or {}).get("flops", 0.0))


_DOT = re.compile(r"lhs_contracting_dims=\{(?P<dims>[\d,]*)\}")


def loop_matmul_flops(hlo_text: str) -> float:
  """FLOPs of the matmuls (``dot``) in loop bodies, times the iterations beyond the first."""
  bodies, entry, callers = hlo._computations(hlo_text)

  def runs(name: str, trips: bool, seen: dict) -> int:
    if name == entry:
      return 1
    if name not in seen:
      seen[name] = 0
      seen[name] = sum(runs(c, trips, seen) * (t if trips else 1)
                       for c, t, _ in callers.get(name, ()))
    return seen[name]

  with_trips, once, extra = {}, {}, 0.0
  for name, lines in bodies.items():
    text = "\n".join(lines)
    types = {m["name"]: m["type"] for m in hlo._INSTRUCTION.finditer(text)}
    flops = 0.0
    for m in hlo._INSTRUCTION.finditer(text):
      if m["op"] != "dot":
        continue
      out = hlo._ARRAY.search(m["type"])
      lhs = hlo._ARRAY.search(types.get(m["operands"].split(",")[0].strip().lstrip("%"), ""))
      line_end = text.find("\n", m.end())
      dims = _DOT.search(text, m.end(), line_end if line_end >= 0 else len(text))
      if not (out and lhs and dims):
        continue
      shape = [int(d) for d in lhs["dims"].split(",") if d]
      contracted = math.prod(shape[int(d)] for d in dims["dims"].split(",") if d)
      flops += 2.0 * math.prod(int(d) for d in out["dims"].split(",") if d) * contracted
    if flops:
      extra += flops * (runs(name, True, with_trips) - runs(name, False, once))
  return extra


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
