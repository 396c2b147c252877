"""``auto.auto_parallel`` without ``pipeline.num_stages``: search the plan.

>>> epl.init({"auto.auto_parallel": True, "auto.memory_limit": 16 << 30})  # doctest: +SKIP
>>> state = trainer.init(rng, batch)
>>> print(trainer.plan)             # the chosen plan, and the candidates it was weighed against
>>> trainer.plan.search[0].chosen
True

Candidates are config overrides on a mesh: every factorization of the devices into data x
model, with under ``epl.split(k)`` either the whole model or only the module holding most of
the parameter bytes (``_dominant_module``: EPL's large classifier split by its classes, the rest
data-parallel), each kept only where the split rules split some parameter;
``pipeline.num_micro_batch`` (1, 2, 4 where the batch divides), ``zero.level``,
``gradient_checkpoint.type`` ("" or "auto") and, off CPU, ``offload.level``. A key the user set
and a user's scope, default strategy or ``epl.annotate`` rule are fixed, not searched.

1. One trace per mesh (no compile) gives every parameter's spec; parameter, gradient and
   optimizer bytes per device follow from them and the features, exactly; activations, FLOPs
   and collectives are estimated from the traced program (``_estimate``).
2. Candidates estimated over ``auto.memory_limit`` are dropped; the others are compiled in the
   order of their estimated step time, at most ``MAX_COMPILES``, until one compiled step's
   ``memory_analysis()`` is within the limit: that one is chosen, its cost read from the
   compiled program (``cost.compiled_cost``). A compiled step over the limit rescales the
   activation estimate of the rows still to weigh by its measured activations
   (``_calibrated``). A row that was only estimated says so.

Pipeline stages are not searched: each stage plan compiles its pipeline before it can be
measured, which is too slow for this search. Cut stages with ``pipeline.num_stages``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from epljax import cost as cost_lib
from epljax import strategy as strategy_lib
from epljax.errors import PlanError, size
from epljax.mesh import DATA, MODEL
from epljax.pipeline.auto import node_flops
from epljax.sharding import annotations

MAX_COMPILES = 5
MICRO_BATCHES = (1, 2, 4)
ZERO_LEVELS = ("", "v1", "v2", "v3")
CHECKPOINTING = ("", "auto")
OFFLOAD = ("", "v0", "v1")
# Activations kept under gradient_checkpoint.type="auto": a rough share, for ranking only (the
# compiled bytes decide).
_CHECKPOINTED_SHARE = 1 / 3
_KEPT = {"dot_general", "conv_general_dilated", "exp", "log", "tanh", "logistic", "erf", "div",
         "integer_pow", "rsqrt", "sqrt", "max", "pow"}
SEARCHED_KEYS = {"num_micro_batch": "pipeline.num_micro_batch", "zero_level": "zero.level",
                 "gradient_checkpoint": "gradient_checkpoint.type", "offload": "offload.level"}
STAGES_NOT_SEARCHED = ("stage candidates not searched: a pipeline plan compiles its pipeline "
                       "before it can be measured (set pipeline.num_stages to cut stages)")


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One plan weighed by the search (a row of ``trainer.plan.search``)."""
  mesh_shape: dict[str, int]
  features: dict[str, Any]
  bytes_per_device: int         # compiled: arguments + outputs - aliased + temp; else estimated
  predicted_step_s: float
  compute_s: float
  communication_s: float
  bubble_s: float
  compiled: bool                # False: every number is the estimate of ``_estimate``
  split: str = ""               # what is under epl.split(model): "all", a module path, or ""
  chosen: bool = False
  reason: str = ""              # why it lost; "" for the chosen
  refused: str = ""             # the PlanError its build raised, if any
  estimate: Any = dataclasses.field(default=None, repr=False, compare=False)  # cost.StepCost
  cost: Any = dataclasses.field(default=None, repr=False, compare=False)  # compiled, or None

  @property
  def overrides(self) -> dict[str, Any]:
    return {SEARCHED_KEYS[k]: v for k, v in self.features.items()}


def search(fns, config, cluster, rng, batch, build: Callable) -> Any:
  """The ``Built`` of the chosen plan, its ``plan.search`` the rows weighed (module doc)."""
  chip = cost_lib.chip_of(cluster.devices[0], config.auto)
  limit = config.auto.memory_limit or chip.memory_bytes
  fixed = {name: config.to_dict()[key] for name, key in SEARCHED_KEYS.items()
           if key in config.changed()}
  notes = [STAGES_NOT_SEARCHED]
  if cluster.platform == "cpu" and "offload" not in fixed:
    fixed["offload"] = ""
    notes.append("offload candidates not searched: on CPU host memory is the device's memory")
  make = functools.partial(_build_with, build, fns, config.replace({"auto.auto_parallel": False}),
                           cluster, rng, batch)
  bases = _base_builds(make, len(cluster.devices), fixed, notes)
  batch_bytes = jax.process_count() * sum(
      np.size(x) * np.asarray(x).dtype.itemsize for x in jax.tree.leaves(batch))
  residuals = residual_bytes(next(iter(bases.values())).capture.program.closed_jaxpr) if bases \
      else 0
  rows = sorted((_estimate(built, features, chip, batch_bytes, split, residuals)
                 for (_, split), built in bases.items()
                 for features in _feature_grid(fixed, built)),
                key=_order)
  if not rows:
    raise PlanError("auto.auto_parallel found no candidate plan: " + "; ".join(notes[1:]))
  rows, chosen, compiles = _compile_in_order(rows, bases, make, chip, limit)
  if chosen is None:
    raise PlanError(_none_fits(rows, limit, config.auto.memory_limit, compiles))
  index, built = chosen
  rows = [_lost(r, rows[index], limit) if j != index else dataclasses.replace(r, chosen=True)
          for j, r in enumerate(rows)]
  rows.sort(key=lambda r: (not r.chosen, bool(r.refused), r.bytes_per_device > limit,
                           r.predicted_step_s))
  built.plan.search = rows
  built.plan.search_notes = [f"chip      {chip.name}: peak {chip.peak_flops:.3g} FLOP/s x "
                             f"{chip.efficiency:g}, links {chip.intra_host_bandwidth:.3g} B/s "
                             f"in a host, {chip.inter_host_bandwidth:.3g} B/s across"
                             + (" (nominal)" if chip.name == "cpu" else ""),
                             f"limit     {size(limit)} per device (auto.memory_limit)",
                             f"compiled  {compiles} of {len(rows)} candidates", *notes]
  return built


def _build_with(build, fns, config, cluster, rng, batch, k: int | None, split: str,
                overrides: dict[str, Any]):
  """``build`` (traced and placed, not compiled) with ``overrides`` and ``split`` (the whole
  model, or one module) as an ``epl.split(k)`` task graph when ``k > 1``."""
  with _model_split(k, split):
    return build(fns, config.replace(overrides), cluster, rng, batch)


def _base_builds(make: Callable, num_devices: int, fixed: dict[str, Any],
                 notes: list[str]) -> dict[tuple[int | None, str], Any]:
  """(model-axis size (None: fixed by the user), what is split) -> the candidate's build
  without features, whose specs the estimates read; ``notes`` gets why one is not searched."""
  user_mesh = _user_scoped()
  if user_mesh:
    notes.append(f"mesh fixed by the user: {user_mesh}")
  plain = {SEARCHED_KEYS[n]: fixed.get(n, d) for n, d in
           (("num_micro_batch", 1), ("zero_level", ""), ("gradient_checkpoint", ""),
            ("offload", ""))}
  bases: dict[tuple[int | None, str], Any] = {}
  if user_mesh:
    return {(None, ""): make(None, "", plain)}
  module = None
  for k, split in [(1, "")] + [(k, s) for k in _divisors(num_devices)[1:]
                               for s in ("all", "module")]:
    if split == "module":   # the dominant module, found in the data-parallel trace
      if module is None:
        continue
      split = module
    try:
      built = make(k, split, plain)
    except PlanError as e:
      notes.append(f"model={k} ({split}) not searched: {str(e).splitlines()[0]}")
      continue
    if k == 1:
      if _scoped(built):   # the model's own scopes fix its mesh
        notes.append("mesh fixed by the user: the model's scopes " + ", ".join(
            f"{t.name}={t.strategy}({t.device_count})" for t in built.capture.taskgraphs))
        return {(None, ""): built}
      module = _dominant_module(built)
    elif not any(MODEL in _axes(leaf.spec) for leaf in built.plan.leaves):
      notes.append(f"model={k} ({split}) not searched: the split rules split no parameter")
      continue
    elif split != "all" and (k, "all") in bases and [l.spec for l in built.plan.leaves] == [
        l.spec for l in bases[(k, "all")].plan.leaves]:
      continue   # the module is all the split rules split: the same plan as splitting all
    bases[(k, split)] = built
  return bases


def _dominant_module(built) -> str | None:
  """The module (its name-stack path, as ``epl.annotate`` module rules match it) whose
  parameters hold at least half of the trainable bytes, and not all of them; else None.

  Splitting only it is EPL's layout for a large classifier: its kernel split by classes, whose
  logits stay split, instead of pairing it (row-split) with the layers before it."""
  program = built.capture.program
  owned: dict[str, int] = {}
  total = 0
  for i, leaf in enumerate(built.plan.leaves):
    if not leaf.trainable:
      continue
    total += leaf.bytes_per_device   # (the data-parallel trace: whole parameters)
    modules = {"/".join(f for f in node.module_frames if not f.startswith("epl."))
               for node, _ in program.uses_of_input(i)}
    if len(modules) == 1 and "" not in modules:   # (a shared parameter has no one module)
      (module,) = modules
      owned[module] = owned.get(module, 0) + leaf.bytes_per_device
  if not owned:
    return None
  module, nbytes = max(owned.items(), key=lambda kv: kv[1])
  return module if total / 2 <= nbytes < total else None


def _compile_in_order(rows: list[Candidate], bases: dict, make: Callable, chip, limit: int):
  """Compiles the rows within the limit in order, at most ``MAX_COMPILES``, until one compiled
  step fits: (rows, (its index, its Built) or None, compiles)."""
  compiles = 0
  for i in range(len(rows)):
    row = rows[i]   # (rows are recalibrated as compiles go)
    if row.bytes_per_device > limit or compiles == MAX_COMPILES:
      continue
    k, split = next(key for key, b in bases.items()
                    if dict(b.plan.mesh.shape) == row.mesh_shape and key[1] == row.split)
    try:
      built = make(k, split, row.overrides)
      with _model_split(k, split):   # (the step is traced when compiled)
        step = cost_lib.compiled_cost(built.plan.compiled, built.plan.mesh, chip,
                                      _host_bytes(built, row.features))
    except PlanError as e:   # a feature this model refuses: the row says why
      rows[i] = dataclasses.replace(row, refused=str(e).splitlines()[0])
      continue
    compiles += 1
    rows[i] = row = _measured(row, step)
    if row.bytes_per_device <= limit:
      return rows, (i, built), compiles
    rows = _calibrated(rows, row)
  return rows, None, compiles


def _order(row: Candidate) -> tuple:
  """Estimated time first; among equals the simpler plan (fewer devices on the model axis,
  fewer micro batches, no ZeRO, no checkpointing, no offload)."""
  f = row.features
  return (round(row.predicted_step_s, 12), row.mesh_shape.get(MODEL, 1), f["num_micro_batch"],
          ZERO_LEVELS.index(f["zero_level"]), CHECKPOINTING.index(f["gradient_checkpoint"]),
          OFFLOAD.index(f["offload"]))


def _feature_grid(fixed: dict[str, Any], built) -> Iterator[dict[str, Any]]:
  rows = built.plan.global_rows
  replicas = built.plan.num_replicas
  choices = {
      "num_micro_batch": [m for m in MICRO_BATCHES if rows % (replicas * m) == 0],
      "zero_level": ZERO_LEVELS if replicas > 1 else ("",),
      "gradient_checkpoint": CHECKPOINTING,
      "offload": OFFLOAD,
  }
  for name, value in fixed.items():
    choices[name] = (value,)
  for values in itertools.product(*choices.values()):
    yield dict(zip(choices, values))


@contextlib.contextmanager
def _model_split(k: int | None, split: str) -> Iterator[None]:
  """While a candidate is traced: the whole model (``split="all"``, the default strategy) or
  one module (an ``epl.annotate`` module rule for its path) as one ``epl.split(k)`` task
  graph; restored after."""
  saved = strategy_lib._GLOBAL.default, strategy_lib._GLOBAL.default_site
  rule = None
  try:
    if k and k > 1 and split == "all":
      strategy_lib._GLOBAL.default = strategy_lib.split(k)
      strategy_lib._GLOBAL.default_site = "epljax/search.py"
    elif k and k > 1 and split:
      rule = annotations.ModuleRule(re.escape(split), strategy_lib.split(k))
      annotations._MODULE_RULES.append(rule)
    yield
  finally:
    strategy_lib._GLOBAL.default, strategy_lib._GLOBAL.default_site = saved
    if rule is not None:
      annotations._MODULE_RULES.remove(rule)


def _user_scoped() -> str:
  """What the user fixed about the mesh (a default strategy, ``epl.annotate`` rules), or "".
  Scopes in the model are found by ``_scoped`` after tracing."""
  if strategy_lib.default_strategy() is not None:
    return f"epl.set_default_strategy({strategy_lib.default_strategy()!r})"
  if annotations.module_rules() or annotations._PARAM_RULES:
    return "epl.annotate rules"
  return ""


def _scoped(built) -> bool:
  """Whether the traced model has a ``with`` scope of its own."""
  return any(strategy_lib.parse_frame(f) is not None and not strategy_lib.parse_frame(f).default
             for n in built.capture.program.nodes for f in n.frames)


def _axes(spec) -> set[str]:
  return {a for a in jax.tree.leaves(tuple(spec)) if a is not None}


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def _estimate(built, features: dict[str, Any], chip, batch_bytes: int, split: str,
              residuals: int) -> Candidate:
  """A candidate's bytes and time before compiling: parameters, gradients, optimizer and
  model state per device exactly from the specs; activations (the vjp's residuals,
  ``residual_bytes``, split like the batch and the model's split outputs), FLOPs (``node_flops``, x3 for the backward, x4 with checkpointing) and
  collectives (gradient reduction over data; over model, an all-reduce of the output of each
  matmul that contracts a split dimension, and of the input gradient of each that does not)
  estimated from the traced program."""
  plan, cap = built.plan, built.capture
  mesh = dict(plan.mesh.shape)
  d, m = mesh.get(DATA, 1), mesh.get(MODEL, 1)
  micro = features["num_micro_batch"]
  zero, offload = features["zero_level"], features["offload"]
  params = plan.param_bytes
  grads, opt = params, plan.optimizer_bytes
  full_params = params
  if zero:
    opt //= d
  if zero in ("v2", "v3"):
    grads //= d
  if zero == "v3":
    params //= d
  host = 0
  if offload:
    host += 2 * params
    params = 0
  if offload == "v1":
    host += 2 * opt
    opt = 0
  batch_bytes //= max(1, math.prod(mesh[a] for a in plan.batch_axes))
  split_nodes = _split_uses(built, m)
  per_node = [node_flops(n) / (d * (m if n.index in split_nodes else 1))
              for n in cap.program.nodes]
  # Kept for the backward pass: the residuals of the loss's vjp (``residual_bytes``), split
  # like the batch, one micro batch at a time; over model split as the outputs of matmuls and
  # nonlinear functions are (split where a matmul keeps the split dimension).
  split_out = _split_outputs(cap.program, split_nodes, gathered=split not in ("", "all"))
  kept = [(sum(v.aval.size * v.aval.dtype.itemsize for v in n.eqn.outvars
               if hasattr(v.aval, "size")) * n.trips, m if n.index in split_out else 1)
          for n in cap.program.nodes if n.primitive in _KEPT]
  share = (sum(b / k for b, k in kept) / sum(b for b, _ in kept)) if kept else 1.0
  acts = residuals / max(1, math.prod(mesh[a] for a in plan.batch_axes)) * share / micro
  checkpointed = features["gradient_checkpoint"] == "auto"
  if checkpointed:
    acts *= _CHECKPOINTED_SHARE
  if micro > 1:   # the gradient accumulator
    acts += grads
  # The peak is either in the backward pass (residuals beside the gradients) or at the
  # gradients' sum over data (a second buffer: all-reduced, or its shard under ZeRO), after
  # the residuals are freed.
  if d > 1:
    acts = max(acts, full_params // d if zero else grads)
  flops = sum(per_node) * (4 if checkpointed else 3)
  comm: dict[tuple[str, str], float] = {}
  nbytes: dict[tuple[str, str], int] = {}

  def add(kind, axis, result, group, times=1):
    nbytes[(kind, axis)] = nbytes.get((kind, axis), 0) + int(result)
    comm[(kind, axis)] = comm.get((kind, axis), 0.0) + times * cost_lib.link_seconds(
        kind, result / times, group, _across_hosts(plan.mesh, axis), chip)

  # Plain gradients are summed in one combined all-reduce; ZeRO reduce-scatters and gathers
  # each parameter on its own (v3: gathered again in the forward and the backward pass).
  leaves = sum(leaf.trainable for leaf in plan.leaves)
  if d > 1:
    if zero:
      add("reduce-scatter", DATA, full_params / d, d, times=leaves)
      add("all-gather", DATA, full_params, d, times=leaves)
    else:
      add("all-reduce", DATA, full_params, d)
    if zero == "v3":
      add("all-gather", DATA, 2 * full_params, d, times=2 * leaves)
  forwards = 2 if checkpointed else 1   # (checkpointing runs the forward pass again)
  for use in split_nodes.values():      # each micro batch
    if use.forward:
      add("all-reduce", MODEL, forwards * use.forward / d, m, times=forwards * micro)
    if use.backward:
      add("all-reduce", MODEL, use.backward / d, m, times=micro)
  if split_nodes:   # the step's finite check and gradient norm sum over split shards
    add("all-reduce", MODEL, 2 * 4, m, times=2)
  if split not in ("", "all"):   # the split module's outputs met by unsplit code
    for kind, (count, out_bytes) in _leaving_split(cap.program, split_nodes).items():
      add(kind, MODEL, forwards * out_bytes / d, m, times=forwards * count * micro)
  parts = {"parameters": params + grads, "optimizer state": opt,
           "activations": int(acts), "model state and batch": plan.model_state_bytes + batch_bytes}
  step = cost_lib.StepCost(sum(parts.values()), flops, nbytes,
                           flops / (chip.peak_flops * chip.efficiency), comm,
                           host_s=host / chip.host_bandwidth, parts=parts)
  return Candidate(mesh, dict(features), step.bytes_per_device, step.step_s, step.compute_s,
                   step.communication_s, step.bubble_s, compiled=False, split=split,
                   estimate=step)


@dataclasses.dataclass(frozen=True)
class _SplitUse:
  """How a node reading a model-split parameter runs: whether its output stays split, and the
  bytes (whole batch) it all-reduces over model in the forward and in the backward pass."""
  output_split: bool
  forward: int = 0
  backward: int = 0


_WHOLE = _SplitUse(False)


def _split_uses(built, m: int) -> dict[int, _SplitUse]:
  """Nodes reading a parameter split over ``model``. A matmul contracting the split dimension
  (row-parallel; a lookup in a vocabulary-split table likewise) all-reduces its output in the
  forward pass; one keeping it (column-parallel: a classifier split by classes) has a split output,
  and the gradient of its other operand, summed over the split dimension, is all-reduced in
  the backward pass unless that operand is a program input (the batch)."""
  if m == 1:
    return {}
  out: dict[int, _SplitUse] = {}
  program = built.capture.program
  for i, leaf in enumerate(built.plan.leaves):
    spec = tuple(leaf.spec)
    split = [dim for dim, a in enumerate(spec) if a is not None and MODEL in jax.tree.leaves(a)]
    if not split:
      continue
    for node, pos in program.uses_of_input(i):
      nbytes = _bytes(node.eqn.outvars) * node.trips
      if node.primitive == "gather":   # a lookup in a split table: partial rows, summed
        use = _SplitUse(False, forward=nbytes)
      elif node.primitive != "dot_general":   # elementwise (a split bias): stays split
        use = _SplitUse(True)
      else:
        (contracting, batch) = node.eqn.params["dimension_numbers"]
        side = min(pos, 1)
        if any(dim in contracting[side] for dim in split):
          use = _SplitUse(False, forward=nbytes)
        elif any(dim in batch[side] for dim in split):
          use = _SplitUse(True)
        else:
          other = node.inputs[1 - side] if len(node.inputs) > 1 else ()
          produced = any(b in program.producer for b in other)
          use = _SplitUse(True, backward=(_bytes([node.eqn.invars[1 - side]]) * node.trips
                                          if produced else 0))
      seen = out.get(node.index)
      out[node.index] = use if seen is None else _SplitUse(
          seen.output_split and use.output_split, max(seen.forward, use.forward),
          max(seen.backward, use.backward))
  return out


# Operations XLA does not fuse into a consumer's loop (it materializes their outputs); the
# others (elementwise, broadcasts, layout changes) it fuses, recomputing them where needed.
_MATERIALIZED = {"dot_general", "conv_general_dilated", "reduce_sum", "reduce_max",
                 "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin",
                 "gather", "scatter", "scatter-add", "scatter_add", "dynamic_slice",
                 "dynamic_update_slice", "scan", "while", "cond", "cumsum", "cumprod", "cummax",
                 "cumlogsumexp", "sort", "custom_vjp_call", "custom_jvp_call", "all_gather",
                 "psum", "reduce_precision", "random_bits", "threefry2x32"}


def residual_bytes(closed_jaxpr) -> int:
  """Bytes (whole batch) the backward pass keeps from the forward pass, read from the jaxpr of
  ``jax.vjp`` of the traced loss: its vjp function's leaves are the residuals. XLA keeps a
  residual made by a fusible operation (elementwise, a broadcast, a layout change) as the
  values it is computed from, recomputing it in the backward pass: those are followed back to
  values the forward pass materializes anyway (an argument, a matmul's or reduction's output,
  a value read twice), and each such value counts once; the arguments (parameters, batch) are
  not counted."""
  fun = jcore.jaxpr_as_fun(closed_jaxpr)
  args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed_jaxpr.jaxpr.invars]
  inexact = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact)]

  def pullback(*a):   # the vjp with respect to the floating inputs (not token ids, keys)
    def of(*x):
      full = list(a)
      for i, xi in zip(inexact, x):
        full[i] = xi
      return fun(*full)
    return jax.vjp(of, *(a[i] for i in inexact))[1]

  jaxpr = jax.make_jaxpr(pullback)(*args).jaxpr
  producer = {o: e for e in jaxpr.eqns for o in e.outvars}
  reads: dict[Any, int] = {}
  for e in jaxpr.eqns:
    for x in e.invars:
      if not isinstance(x, jcore.Literal):
        reads[x] = reads.get(x, 0) + 1
  arguments = set(jaxpr.invars) | set(jaxpr.constvars)
  kept: set[Any] = set()
  todo = [v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)]
  seen: set[Any] = set()
  while todo:
    v = todo.pop()
    if v in seen or v in arguments:
      continue
    seen.add(v)
    eqn = producer.get(v)
    if eqn is None or reads.get(v, 0) > 1 or not _fusible(eqn):
      kept.add(v)
    else:
      todo.extend(x for x in eqn.invars if not isinstance(x, jcore.Literal))
  return sum(v.aval.size * v.aval.dtype.itemsize for v in kept if hasattr(v.aval, "size"))


def _fusible(eqn) -> bool:
  if eqn.primitive.name in _MATERIALIZED:
    return False
  inner = [p for p in eqn.params.values() if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))]
  return all(_fusible(e) for j in inner for e in getattr(j, "jaxpr", j).eqns)


_REDUCTIONS = {"reduce_max", "reduce_min", "reduce_sum", "argmax", "argmin", "gather"}


def _leaving_split(program, split_nodes: dict[int, _SplitUse]) -> dict[str, tuple[int, int]]:
  """Collectives where a split module's split outputs meet code outside it: a reduction over
  them (a softmax's row maxima and sums, a label's logit) all-reduces its output; a matmul
  that does not read a split parameter gathers them whole. Followed through elementwise ops.
  (kind -> (count, result bytes, whole batch)); only for a split module, whose split ends
  at its outputs (a whole split model pairs its matmuls instead)."""
  found: dict[str, tuple[int, int]] = {}
  seen: set[int] = set()
  todo = [program.nodes[i] for i, use in split_nodes.items() if use.output_split]
  while todo:
    node = todo.pop()
    for user in program.node_consumers(node):
      if user.index in seen or user.index in split_nodes:
        continue
      seen.add(user.index)
      if user.primitive in _REDUCTIONS or user.primitive == "dot_general":
        kind, nbytes = (("all-reduce", _bytes(user.eqn.outvars)) if user.primitive != "dot_general"
                        else ("all-gather", _bytes(node.eqn.outvars)))
        count, total = found.get(kind, (0, 0))
        found[kind] = (count + 1, total + nbytes * user.trips)
      else:
        todo.append(user)
  return found


def _split_outputs(program, split_nodes: dict[int, _SplitUse], gathered: bool) -> set[int]:
  """The nodes whose outputs are split over model: those of matmuls keeping a split dimension,
  and what is computed from them up to a reduction, a row-split matmul, or (``gathered``: a
  split module, whose outputs unsplit code reads whole) a matmul outside it."""
  found = {i for i, use in split_nodes.items() if use.output_split}
  todo = [program.nodes[i] for i in found]
  while todo:
    for user in program.node_consumers(todo.pop()):
      if (user.index in found or user.index in split_nodes or user.primitive in _REDUCTIONS
          or (gathered and user.primitive == "dot_general")):
        continue
      found.add(user.index)
      todo.append(user)
  return found


def _bytes(variables) -> int:
  return sum(v.aval.size * v.aval.dtype.itemsize for v in variables if hasattr(v.aval, "size"))


def _across_hosts(mesh, axis: str) -> bool:
  if axis not in mesh.shape or mesh.shape[axis] == 1:
    return False
  index = mesh.axis_names.index(axis)
  line = mesh.devices.take(range(mesh.shape[axis]), axis=index).reshape(
      mesh.shape[axis], -1)[:, 0]
  return len({d.process_index for d in line}) > 1


def _host_bytes(built, features: dict[str, Any]) -> int:
  """Bytes an offloaded step moves between host and device (weights in and out, with v1 the
  optimizer state too): not in the device's HLO collectives."""
  if not features["offload"]:
    return 0
  plan = built.plan
  return 2 * plan.param_bytes + (2 * plan.optimizer_bytes if features["offload"] == "v1" else 0)


def _calibrated(rows: list[Candidate], measured: Candidate) -> list[Candidate]:
  """The estimates of the rows not compiled yet, their activations scaled by what the compiled
  ``measured`` row's activations were against its own estimate (the other parts are exact)."""
  parts = measured.estimate.parts
  exact = measured.estimate.bytes_per_device - parts["activations"]
  if parts["activations"] <= 0 or measured.bytes_per_device <= exact:
    return rows
  scale = (measured.bytes_per_device - exact) / parts["activations"]
  out = []
  for r in rows:
    if not r.compiled:
      acts = int(r.estimate.parts["activations"] * scale)
      est = dataclasses.replace(r.estimate, parts={**r.estimate.parts, "activations": acts},
                                bytes_per_device=r.estimate.bytes_per_device
                                - r.estimate.parts["activations"] + acts)
      r = dataclasses.replace(r, bytes_per_device=est.bytes_per_device, estimate=est)
    out.append(r)
  return out


def _measured(row: Candidate, step) -> Candidate:
  return dataclasses.replace(row, bytes_per_device=step.bytes_per_device,
                             predicted_step_s=step.step_s, compute_s=step.compute_s,
                             communication_s=step.communication_s, bubble_s=step.bubble_s,
                             compiled=True, cost=step)


def _lost(row: Candidate, best: Candidate, limit: int) -> Candidate:
  """Why ``row`` lost against ``best``: over the limit, or the part of the predicted step
  that grew most. Compiled rows are compared by their compiled costs, the others by both
  rows' estimates."""
  how = "compiled" if row.compiled else "estimated, not compiled"
  if row.refused:
    return dataclasses.replace(row, reason=f"refused: {row.refused}")
  if row.bytes_per_device > limit:
    return dataclasses.replace(
        row, reason=f"over the limit by {size(row.bytes_per_device - limit)} ({how})")
  mine, theirs = (row.cost, best.cost) if row.compiled else (row.estimate, best.estimate)
  diffs = {"compute": mine.compute_s - theirs.compute_s,
           "host transfers": mine.host_s - theirs.host_s,
           "bubble": mine.bubble_s - theirs.bubble_s}
  for key in set(mine.comm_s) | set(theirs.comm_s):
    kind, axis = key
    diffs[f"{kind} over {axis}"] = mine.comm_s.get(key, 0.0) - theirs.comm_s.get(key, 0.0)
  what, delta = max(diffs.items(), key=lambda kv: kv[1])
  if mine.step_s - theirs.step_s > 1e-12 and delta > 0:
    return dataclasses.replace(row, reason=f"+{_ms(delta)} {what} ({how})")
  return dataclasses.replace(row, reason=f"as fast, but a simpler plan fitted first ({how})")


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.3g} ms"


def _none_fits(rows: list[Candidate], limit: int, set_limit: int, compiles: int) -> str:
  small = min([r for r in rows if not r.refused] or rows, key=lambda r: r.bytes_per_device)
  parts = small.estimate.parts
  top = max(parts, key=parts.get)
  shown = ", ".join(f"{k} {size(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
  features = ", ".join(f"{k}={v!r}" for k, v in small.features.items())
  where = f"auto.memory_limit={set_limit}" if set_limit else "the device's memory"
  untried = sum(not r.compiled and not r.refused and r.bytes_per_device <= limit for r in rows)
  if untried:   # the compile budget ran out before the estimates did
    where += (f"; the {compiles} compiled candidates were over it, {untried} more estimated "
              f"within it were not compiled (at most {MAX_COMPILES})")
  return (f"No plan fits {size(limit)} per device ({where}). The smallest of {len(rows)} "
          f"candidates, mesh {small.mesh_shape} with {features}, needs "
          f"{size(small.bytes_per_device)} ({'compiled' if small.compiled else 'estimated'}; "
          f"{shown}): {top} dominate. Try "
          + {"parameters": "more devices for the model axis, or offload.level='v0' on a "
             "GPU/TPU",
             "optimizer state": "more devices (ZeRO shards the optimizer state over the data "
             "axis), a smaller optimizer state (optax.adafactor), or offload.level='v1' on a "
             "GPU/TPU",
             "activations": "a smaller batch per step, or more pipeline.num_micro_batch",
             "model state and batch": "a smaller batch per step"}[top]
          + ", or a larger auto.memory_limit.")
