"""``Trainer.plan``: what epljax will do, readable by a person and checkable by a test.

``print(trainer.plan)`` opens with the verdict (``verdict.py``: fits or not, mesh, features,
predicted step, MFU, tokens/s, what crosses hosts, and the changes that would fit), then the
task graphs, every parameter's ``PartitionSpec`` and bytes per device (a stack of layers a row,
``rows.py``), the per-device memory of the compiled step, its collectives per mesh axis (and
whether they cross hosts) and the step time the cost model predicts from them. The compiled
facts come from the same executable ``train_step`` runs, compiled once on first use (printing
compiles nothing else; naming the changes of a plan that does not fit traces, and with
``suggestions(compile=True)`` compiles, those changes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from epljax import hlo
from epljax.errors import EPLError, size
from epljax.plan import changes as changes_lib
from epljax.plan import verdict as verdict_lib
from epljax.plan.render import html_plan, render_text
from epljax.plan.rows import HEADERS, scanned, variable_rows
from epljax.strategy import TaskGraph


# The task graph column of a stacked leaf each pipeline stage holds its own layers of.
EVERY_STAGE = "every stage"


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One variable leaf: where it lives and what it costs per device."""
  path: str
  shape: tuple[int, ...]
  dtype: str
  spec: P
  bytes_per_device: int
  taskgraph: str
  trainable: bool
  rule: str = ""      # why it has its spec: a split rule, or the user's annotation


@dataclasses.dataclass(frozen=True)
class StepCollective(hlo.Collective):
  """A collective of the compiled step (``hlo.Collective``: kind, shapes, bytes, replica
  groups, a permute's pairs) with the mesh axes it runs over (``"data"``, ``"data+model"``;
  ``"?"`` when its groups are not lines of the mesh) and whether a group crosses hosts."""
  axes: str = "?"
  crosses_hosts: bool = False


def leaf_bytes_per_device(shape: Sequence[int], dtype: Any, sharding: NamedSharding) -> int:
  # dtype.itemsize also covers PRNG key dtypes (key<fry> is 8 bytes), unlike np.dtype(...).
  return math.prod(sharding.shard_shape(tuple(shape))) * dtype.itemsize


def tree_bytes_per_device(shapes: Any, shardings: Any) -> int:
  """Bytes one device holds of a tree of ``ShapeDtypeStruct`` with their shardings."""
  leaves = jax.tree.leaves(shapes)
  sh = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  return sum(leaf_bytes_per_device(x.shape, x.dtype, s) for x, s in zip(leaves, sh, strict=True))


class Plan:
  """The plan of a Trainer, available after ``trainer.init``."""

  def __init__(self, *, mesh: Mesh, num_replicas: int, num_stages: int,
               taskgraphs: Sequence[TaskGraph], param_specs: Any, leaves: Sequence[Leaf],
               num_micro_batch: int, global_rows: int, batch_axes: Sequence[str],
               optimizer_bytes: int, schedule: str,
               features: Sequence[str | Callable[[], str]] = (),
               compile_step: Callable[[], Any], pipeline: Any = None,
               grads_bytes: int | None = None, placement: dict[str, str] | None = None,
               compile_grads: Callable[[], Any] | None = None, chip: Any = None,
               memory_limit: int | None = None, step_cost: Callable[[Plan], Any] | None = None,
               chip_note: str = ""):
    self.mesh = mesh
    self.num_replicas = num_replicas
    self.num_stages = num_stages
    self.taskgraphs = list(taskgraphs)
    self.param_specs = param_specs
    self.leaves = list(leaves)
    self.num_micro_batch = num_micro_batch
    self.global_rows = global_rows
    self.batch_axes = tuple(batch_axes)
    self.optimizer_bytes = optimizer_bytes
    self.schedule = schedule
    self._features = list(features)
    self.pipeline = pipeline   # epljax.pipeline.Pipeline when the model has stages
    self._compile_step = compile_step
    self._compiled = None
    self.grads_bytes = grads_bytes
    self.placement = dict(placement or {})   # part of the state -> "device" / "host (...)"
    self._compile_grads = compile_grads
    self._grads_compiled = None
    self._collectives: list[StepCollective] | None = None
    self.chip = chip                     # epljax.chips.Chip of the devices, or None
    self.chip_note = chip_note           # why there is no chip (no cost figures), or ""
    self.memory_limit = memory_limit     # auto.memory_limit, or the device's memory
    self._step_cost = step_cost          # plan -> cost.StepCost of its compiled step
    self._cost = None
    self.search: list[Any] = []          # auto.auto_parallel's rows (``epljax.search``)
    self.search_notes: list[str] = []    # what the search fixed, skipped and assumed
    self.rebuild: changes_lib.Rebuild | None = None   # set by the Trainer (``changes``)
    self._suggested: dict[tuple[bool, int], changes_lib.Found] = {}

  @property
  def features(self) -> list[str]:
    """One line per active feature (some learn what they do while the step is traced, so
    this compiles the step first)."""
    if self._features:
      _ = self.compiled
    lines = [f() if callable(f) else f for f in self._features]
    return [line for line in lines if line]

  # -- facts of the compiled step (compiled once, shared with train_step) ------------------
  @property
  def compiled(self):
    if self._compiled is None:
      self._compiled = self._compile_step()
    return self._compiled

  @property
  def memory(self):
    """``compiled.memory_analysis()`` of the step: bytes per device."""
    return self.compiled.memory_analysis()

  @property
  def collectives(self) -> list[StepCollective]:
    """Every collective one step executes on a device (those in loops once per iteration; a
    pipeline's, on a device of its busiest stage), each with the mesh axes it runs over and
    whether it crosses hosts (``epljax.mesh.hosts``)."""
    if self._collectives is None:
      from epljax import cost   # (cost reads plans)

      rows = []
      text = self.compiled.as_text()
      # A pipeline's tick loop holds every stage's branch: a device runs its own stage's.
      found = (self.pipeline.executed_collectives(text) if self.pipeline is not None
               else hlo.executed_collectives(text))
      for c in found:
        axes, _, across = cost.collective_axis(c, self.mesh)
        rows.append(StepCollective(**dataclasses.asdict(c), axes=axes, crosses_hosts=across))
      self._collectives = rows
    return self._collectives

  @property
  def bytes_per_device(self) -> int:
    """Bytes one device holds at the step's peak: arguments + outputs - aliased + temp of the
    compiled step (``memory_analysis()``)."""
    mem = self.memory
    return (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes)

  @property
  def fits(self) -> bool:
    """``bytes_per_device`` within ``memory_limit`` (``auto.memory_limit``, else the memory of
    the device: XLA's limit on a running GPU, the chip table's for compile-only devices)."""
    return self.memory_limit is None or self.bytes_per_device <= self.memory_limit

  @property
  def cost(self):
    """The cost model's reading of the compiled step (``epljax.cost.StepCost``: FLOPs,
    collective bytes and seconds per (kind, axis), compute, bubble), or None without a chip."""
    if self._cost is None and self._step_cost is not None and self.chip is not None:
      self._cost = self._step_cost(self)
    return self._cost

  @property
  def predicted_step_s(self) -> float | None:
    """Seconds the cost model predicts for one step on ``chip`` (``epljax.cost``), or None."""
    return None if self.cost is None else self.cost.step_s

  @property
  def mfu(self) -> float | None:
    """Model FLOPs utilization the prediction implies: the step's FLOPs per device over the
    predicted step time and the chip's peak."""
    cost = self.cost
    if cost is None or not cost.step_s:
      return None
    return cost.flops / (cost.step_s * self.chip.peak_flops)

  @property
  def activation_bytes(self) -> int | None:
    """Per device: temporaries of the compiled forward and backward pass (loss and gradients,
    no update): the activations kept for the backward pass and what is computed from them.
    Compiles that program (once) when first read; printing the plan does not read it."""
    if self._compile_grads is None:
      return None
    if self._grads_compiled is None:
      self._grads_compiled = self._compile_grads()
    return self._grads_compiled.memory_analysis().temp_size_in_bytes

  # -- derived -----------------------------------------------------------------------------
  @property
  def param_bytes(self) -> int:
    if self.pipeline is not None:   # the stored leaves, each also split over stage
      return self.pipeline.param_bytes_per_device
    return sum(leaf.bytes_per_device for leaf in self.leaves if leaf.trainable)

  @property
  def model_state_bytes(self) -> int:
    return sum(leaf.bytes_per_device for leaf in self.leaves if not leaf.trainable)

  @property
  def micro_batch_per_replica(self) -> int:
    return self.global_rows // (self.num_replicas * self.num_micro_batch)

  # -- throughput and what would fit -------------------------------------------------------
  @property
  def tokens_per_step(self) -> int | None:
    """Tokens of a global batch (``Trainer(tokens_key=...)``, else its first integer leaf of
    two or more dimensions), or None when the batch has none."""
    counts = self._counts()
    return counts.get("tokens")

  @property
  def tokens_per_s(self) -> float | None:
    """Tokens per second per device at the predicted step time, or None."""
    step, tokens = self.predicted_step_s, self.tokens_per_step
    return tokens / (step * self.mesh.size) if step and tokens else None

  def format(self, full: bool = False) -> str:
    """The plan as text: ``str(plan)``, with ``full`` one variables row per leaf instead of
    one per stack of layers."""
    return render_text(self.sections(full))

  def sections(self, full: bool = False) -> list[tuple[str, list[Any]]]:
    """The plan as ``(title, blocks)`` pairs, what ``str()`` and ``_repr_html_`` render: a
    block is a line of text or a table ``(headers, rows)``. The verdict comes first (fits or
    not, mesh and features, predicted step, throughput, what crosses hosts, and when it does
    not fit the changes that would), then the details."""
    _ = self.compiled   # compile first: some features describe what they found while tracing
    # A stacked leaf split by layer over the stages (``EVERY_STAGE``) counts in each of them.
    every = [leaf for leaf in self.leaves if leaf.taskgraph == EVERY_STAGE]
    per_tg = {tg.name: [leaf for leaf in self.leaves if leaf.taskgraph == tg.name] + every
              for tg in self.taskgraphs}
    out = [verdict_lib.verdict(self), ("task graphs", [(
        ["index", "name", "strategy", "devices", "params", "bytes/device"],
        [[tg.index, tg.name, tg.strategy, tg.device_count, len(per_tg[tg.name]),
          size(sum(x.bytes_per_device for x in per_tg[tg.name]))] for tg in self.taskgraphs])])]
    if self.pipeline is not None:
      out.append(("pipeline stages", self.pipeline.blocks()))
    stacks = {} if full or self.rebuild is None else scanned(
        self.rebuild.built.capture.program, self.leaves)
    table = variable_rows(self.leaves, stacks, full)
    out.append(("variables" + (" (a stack of layers a row; every leaf: --full, "
                               "plan.format(full=True))" if len(table) < len(self.leaves)
                               else ""), [(HEADERS, table)]))
    out.append(("memory per device", self._memory_blocks()))
    if self.search:
      out.append(("automatic plan (auto.auto_parallel)", self._search_blocks()))
    out.append(("collectives per step (compiled HLO)", self._collective_blocks()))
    predicted = self._predicted_blocks()
    if predicted:
      out.append(("predicted step (epljax.cost)", predicted))
    return out

  def suggestions(self, compile: bool = False, count: int = 3) -> changes_lib.Found:
    """When the plan does not fit: the ``count`` cheapest config changes that would, by the
    plan search's estimates on this mesh (``epljax.plan.changes``: ``.changes``, cheapest
    first, each with its overrides and bytes per device; ``.note`` says why there are none).
    With ``compile`` each is built and compiled, its ``compiled_bytes`` read from the program.
    Nothing when it fits."""
    if self.fits or self.rebuild is None:
      return changes_lib.Found([])
    compiled = [found for (was_compiled, _), found in self._suggested.items() if was_compiled]
    if not compile and compiled:   # (the last compiled answer: better than estimates)
      return compiled[-1]
    if (compile, count) not in self._suggested:
      self._suggested[(compile, count)] = changes_lib.fitting(self, self.rebuild, count, compile)
    return self._suggested[(compile, count)]

  def _counts(self) -> dict[str, int]:
    if self.rebuild is None:
      return {}
    try:
      counts = self.rebuild.counts(self.rebuild.batch)
    except EPLError:   # (a tokens_key the batch lacks: train_step says so)
      return {}
    examples = counts.get("examples") or self.global_rows
    # (a process's batch of a multi-host run: scaled to the global batch)
    return {k: v * self.global_rows // examples for k, v in counts.items()}

  def _collective_blocks(self) -> list[Any]:
    """One row per (kind, axes): count, bytes per device per step, whether it crosses hosts."""
    rows: dict[tuple[str, str], list] = {}
    for c in self.collectives:
      row = rows.setdefault((c.kind, c.axes), [0, 0, False])
      row[0] += 1
      row[1] += c.bytes
      row[2] = row[2] or c.crosses_hosts
    if not rows:
      return ["none"]
    return [(["kind", "axes", "count", "bytes", "crosses hosts"],
             [[k, a, n, size(b), "yes" if x else "no"]
              for (k, a), (n, b, x) in sorted(rows.items())])]

  def _predicted_blocks(self) -> list[Any]:
    if self.chip is None:
      return [self.chip_note] if self.chip_note else []
    cost, chip = self.cost, self.chip
    if cost is None:
      return []
    ms = lambda s: f"{s * 1e3:.3g} ms"  # noqa: E731
    comm = {}
    for (_, axis), secs in cost.comm_s.items():
      comm[axis] = comm.get(axis, 0.0) + secs
    lines = [f"chip      {chip.name}: {chip.peak_flops / 1e12:.4g} TFLOP/s peak x "
             f"{chip.efficiency:g} efficiency; links {chip.intra_host_bandwidth / 1e9:.4g} GB/s "
             f"in a host, {chip.inter_host_bandwidth / 1e9:.4g} GB/s across hosts"
             + (" (nominal figures: they rank plans, they predict nothing)"
                if chip.name == "cpu" else ""),
             f"compute   {ms(cost.compute_s)} ({cost.flops:.4g} FLOPs per device)",
             *[f"comm      {ms(t)} over {axis}" for axis, t in sorted(comm.items()) if t],
             *([f"bubble    {ms(cost.bubble_s)}"] if cost.bubble_s else []),
             *([f"host      {ms(cost.host_s)}"] if cost.host_s else []),
             *([f"hidden    {ms(cost.hidden_s)} of the communication runs beside compute "
                f"(async collectives in the compiled schedule)"] if cost.hidden_s else []),
             f"step      {ms(cost.step_s)} ("
             + ("compute + exposed communication" + (" + bubble" if cost.bubble_s else "")
                + (" + host" if cost.host_s else "") if cost.hidden_s else "nothing overlapped")
             + f"), MFU {self.mfu:.1%}"]
    return lines

  def __str__(self) -> str:
    return self.format()

  def _repr_html_(self) -> str:
    """The plan as HTML tables, for Jupyter (``trainer.plan`` as a cell's last line)."""
    return html_plan(self.sections())

  def _memory_blocks(self) -> list[Any]:
    mem = self.memory
    where = lambda part: self.placement.get(part, "device")  # noqa: E731
    grads = self.param_bytes if self.grads_bytes is None else self.grads_bytes
    rows = [["parameters", size(self.param_bytes), where("parameters")],
            ["gradients", size(grads), where("gradients")],
            ["optimizer state", size(self.optimizer_bytes), where("optimizer state")],
            ["model state", size(self.model_state_bytes), where("model state")]]
    rows.append(["activations and temporaries", size(mem.temp_size_in_bytes),
                 "device (temp of the compiled step)"])
    blocks: list[Any] = [(["part", "bytes", "lives in"], rows)]
    blocks.append(
        f"compiled step: arguments {size(mem.argument_size_in_bytes)}    outputs "
        f"{size(mem.output_size_in_bytes)}    temp {size(mem.temp_size_in_bytes)}    "
        f"aliased {size(mem.alias_size_in_bytes)}")
    if self.memory_limit is not None:
      blocks.append(f"per device {size(self.bytes_per_device)} of {size(self.memory_limit)} "
                    + ("(fits)" if self.fits else "(DOES NOT FIT)"))
    host = (mem.host_argument_size_in_bytes, mem.host_output_size_in_bytes,
            mem.host_temp_size_in_bytes)
    if any(host) or any(v != "device" for v in self.placement.values()):
      blocks.append(f"compiled step, host memory: arguments {size(host[0])}    outputs "
                    f"{size(host[1])}    temp {size(host[2])}"
                    + ("" if any(host) else "  (this backend counts host buffers as device)"))
    return blocks

  def _search_blocks(self, limit: int = 16) -> list[Any]:
    """The candidates weighed, best first (``epljax.search``)."""
    rows = search_rows(self.search[:limit])
    more = len(self.search) - limit
    return [*self.search_notes, (["", "mesh", "features", "estimated bytes",
                                  "compiled bytes", "compute ms",
                                  "comm ms", "bubble ms", "step ms", "why not"], rows),
            *([f"... {more} more candidates in trainer.plan.search"] if more > 0 else [])]

  def __repr__(self) -> str:
    return (f"Plan(mesh={dict(self.mesh.shape)}, num_replicas={self.num_replicas}, "
            f"num_stages={self.num_stages}, taskgraphs={self.taskgraphs})")


def search_rows(candidates) -> list[list[str]]:
  """The printed cells of ``plan.search`` rows: chosen ("*"), mesh (and what ``epl.split``
  holds: "all" or a module), features, bytes per device estimated before any compile and
  compiled ("-": not compiled), predicted
  compute, communication, bubble and step milliseconds, why it lost."""
  def mesh(shape):
    return " x ".join(f"{a}={n}" for a, n in shape.items() if n > 1 or a == "data")

  def features(f):
    out = [f"micro {f['num_micro_batch']}"]
    shard = f.get("zero_shard")
    out += [f"zero {f['zero_level']}" + (" in a host (HSDP)" if shard == "host" else
                                         f" in groups of {shard} (HSDP)" if shard else "")
            ] if f["zero_level"] else []
    out += ["gc auto"] if f["gradient_checkpoint"] else []
    out += [f"offload {f['offload']}"] if f["offload"] else []
    return ", ".join(out)

  ms = lambda s: f"{s * 1e3:.3g}"  # noqa: E731
  return [["*" if r.chosen else "",
           mesh(r.mesh_shape) + (f" ({r.split})" if r.split else ""), features(r.features),
           size(r.estimated_bytes),
           size(r.compiled_bytes) if r.compiled_bytes is not None else "-", ms(r.compute_s),
           ms(r.communication_s), ms(r.bubble_s), ms(r.predicted_step_s), r.reason]
          for r in candidates]
