"""The cost model of ``auto.auto_parallel``'s plan search: one table of chips and links, and
the predicted step time of a compiled program.

Predicted step time = FLOPs / (peak x efficiency) + each collective's fixed latency and its
bytes on the wire / the bandwidth of the links its mesh axis runs over (within a host, or
across hosts) + host
transfers (offload) + the pipeline bubble. The FLOPs come from ``cost_analysis()``, the
collectives from the compiled HLO (loop bodies times their trip count, ``hlo``), never from
wall time. The numbers of the table are vendor peaks (dense bf16 / per-GPU NVLink and
network); the ``cpu`` row is nominal, for tests: it ranks plans, it predicts nothing.
``auto.peak_flops``, ``auto.efficiency``, ``auto.intra_host_bandwidth`` and
``auto.inter_host_bandwidth`` override a row.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Sequence

import jax
import numpy as np

from epljax import hlo
from epljax.errors import PlanError


@dataclasses.dataclass(frozen=True)
class Chip:
  """Peak dense FLOP/s, device memory, and bytes/s of one device's links: to devices of the
  same host (NVLink, ICI), to other hosts (network, DCN), and to its host's memory (PCIe)."""
  name: str
  peak_flops: float
  memory_bytes: int
  intra_host_bandwidth: float
  inter_host_bandwidth: float
  host_bandwidth: float
  latency_s: float          # the fixed time of one collective, whatever its size
  efficiency: float = 0.5   # the share of peak a well-fed step reaches (MFU)


# Dense bfloat16 FLOP/s per device, from the vendors' data sheets (no sparsity); the first name
# contained in a ``device_kind`` wins. The chips below and the progress bar's MFU read it.
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12),
    ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12),
    ("A10", 125e12), ("V100", 125e12),   # (V100: float16 tensor cores, no bfloat16)
    ("TPU v6", 918e12), ("TPU v5p", 459e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12),
    ("TPU v4", 275e12))


def peak_flops(device_kind: str) -> float | None:
  """``PEAK_FLOPS`` of a device kind ("NVIDIA H100 80GB HBM3"), or None when unknown."""
  kind = device_kind.lower()
  return next((peak for name, peak in PEAK_FLOPS if name.lower() in kind), None)


GB, GiB = 1e9, 1 << 30
CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("H100", peak_flops("H100"), 80 * GiB, 450 * GB, 50 * GB, 55 * GB, 10e-6),
    Chip("H200", peak_flops("H200"), 141 * GiB, 450 * GB, 50 * GB, 55 * GB, 10e-6),
    Chip("A100", peak_flops("A100"), 80 * GiB, 300 * GB, 25 * GB, 25 * GB, 10e-6),
    Chip("TPU v4", peak_flops("TPU v4"), 32 * GiB, 270 * GB, 25 * GB, 16 * GB, 5e-6),
    Chip("TPU v5e", peak_flops("TPU v5e"), 16 * GiB, 200 * GB, 25 * GB, 16 * GB, 5e-6),
    Chip("TPU v5p", peak_flops("TPU v5p"), 95 * GiB, 600 * GB, 25 * GB, 16 * GB, 5e-6),
    Chip("TPU v6e", peak_flops("TPU v6"), 32 * GiB, 448 * GB, 25 * GB, 16 * GB, 5e-6),
    # Nominal: simulated devices share one host's cores and memory; for tests only.
    Chip("cpu", 1e11, 16 * GiB, 10 * GB, 1 * GB, 10 * GB, 10e-6),
)}
_KINDS = (("h200", "H200"), ("h100", "H100"), ("a100", "A100"), ("v4", "TPU v4"),
          ("v5 lite", "TPU v5e"), ("v5e", "TPU v5e"), ("v5p", "TPU v5p"), ("v5", "TPU v5p"),
          ("v6", "TPU v6e"))


def chip_of(device, auto_config) -> Chip:
  """The table's row for ``device`` (by its ``device_kind``), with the ``auto.*`` overrides.
  An accelerator the table does not know is an error naming the keys that describe it."""
  kind = str(getattr(device, "device_kind", "")).lower()
  if device.platform == "cpu":
    chip = CHIPS["cpu"]
    # One simulated device's share of this host's memory.
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    chip = dataclasses.replace(chip, memory_bytes=min(chip.memory_bytes, total))
  else:
    name = next((n for k, n in _KINDS if k in kind), None)
    if name is None and not auto_config.peak_flops:
      raise PlanError(f"auto.auto_parallel has no cost figures for device kind {kind!r} (known: "
                      f"{', '.join(CHIPS)}). Set auto.peak_flops, auto.intra_host_bandwidth "
                      "and auto.inter_host_bandwidth (and auto.memory_limit) for it.")
    chip = CHIPS[name] if name else dataclasses.replace(CHIPS["H100"], name=kind)
    chip = dataclasses.replace(chip, peak_flops=peak_flops(kind) or chip.peak_flops)
    try:
      stats = device.memory_stats()
    except (AttributeError, jax.errors.JaxRuntimeError):   # a compile-only device has none
      stats = None
    if stats and stats.get("bytes_limit"):
      chip = dataclasses.replace(chip, memory_bytes=int(stats["bytes_limit"]))
  overrides = {k: float(getattr(auto_config, k)) for k in
               ("peak_flops", "efficiency", "intra_host_bandwidth", "inter_host_bandwidth")
               if getattr(auto_config, k)}
  bad = [f"auto.{k}={v!r}" for k, v in overrides.items() if not v > 0]
  if bad:
    raise PlanError(f"{', '.join(bad)}: the cost model needs positive figures (0 takes the "
                    "chip table's).")
  return dataclasses.replace(chip, **overrides)


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
  size; whether a group spans hosts). ``"?"`` when the groups are in a form not read."""
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  groups = _mesh_id_groups(c.replica_groups) or c.device_groups(mesh.size)
  if not groups:
    return "?", c.group_size or 1, False
  where = {int(d): np.argwhere(ids == d)[0] for d in ids.flat}
  first = [where[d] for d in groups[0] if d in where]
  if not first:
    return "?", len(groups[0]), False
  axes = [name for i, name in enumerate(mesh.axis_names)
          if len({int(p[i]) for p in first}) > 1]
  process = {d.id: d.process_index for d in mesh.devices.flat}
  across = len({process.get(d, 0) for d in groups[0]}) > 1
  return "+".join(axes) or "-", len(groups[0]), across


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
