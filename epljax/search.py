"""``auto.auto_parallel`` without ``pipeline.num_stages``: search the plan.

>>> epl.init({"auto.auto_parallel": True, "auto.memory_limit": 16 << 30})  # doctest: +SKIP
>>> state = trainer.init(rng, batch)
>>> print(trainer.plan)             # the chosen plan, and the candidates it was weighed against
>>> trainer.plan.search[0].chosen
True

Candidates are config overrides on a mesh: every factorization of the devices into data x
model, with under ``epl.split(k)`` either the whole model or only the module holding most of
the parameter bytes (``_dominant_module``: EPL's large classifier split by its classes, the rest
data-parallel), each kept only where the split rules split some parameter; data x stage x model
where the model cuts into balanced stages (``_stage_rows``);
``pipeline.num_micro_batch`` (1, 2, 4 where the batch divides), ``zero.level`` (where the data
axis spans hosts, also ZeRO within each host, replicated across: HSDP, ``zero_shard="host"``),
``gradient_checkpoint.type`` ("" or "auto") and, off CPU, ``offload.level``; stage rows with
S, 2S, 4S and 8S micro batches, without ZeRO or with ZeRO v1. A key the user set
and a user's scope, default strategy or ``epl.annotate`` rule are fixed, not searched.

1. One trace per mesh (no compile) gives every parameter's spec; parameter, gradient and
   optimizer bytes per device follow from them and the features, exactly; activations, FLOPs
   and collectives are estimated from the traced program (``estimate.step_cost``; activations
   from the residuals of the loss's ``jax.vjp``). Stage candidates (data x stage x model, for
   S = 2, 4, ... while ``auto.auto_parallel``'s cut gives S balanced stages) are estimated from
   their pipeline plans, made without compiling (``build.pipeline_plan``,
   ``estimate.stage_cost``: the bubble from the schedule's tick table).
2. Candidates estimated over ``auto.memory_limit`` are dropped; the others are compiled, at
   most ``MAX_COMPILES``, each time the one of lowest pace-scaled estimate: its estimate times
   compiled / estimated time of the last compiled row of its kind (``_kind``: pipeline or not,
   its ZeRO level and model axis). A compiled step over the limit rescales the activation
   estimate of the rows still to weigh by its measured activations (``_calibrated``). Once one
   compiled step fits, a row is compiled only while it could beat it: its pace-scaled estimate
   is below that step's compiled time, or above by less than its uncertainty (``TIE`` once its
   kind was compiled; before, the largest error of any kind's estimate in this search): near-
   ties take the compiles left, so the choice is the lowest predicted step of all the search
   could afford to check. Of the compiled steps within the limit the fastest is chosen,
   by costs read from the compiled program (``cost.compiled_cost``; a pipeline's FLOPs and
   bubble from its branches' FLOPs times the schedule's busy slots, ``_pipeline_compute``).
   A row that was only estimated says so.

Predicted times count only the communication compute does not hide (``cost.StepCost``:
compiled, from the schedule, ``epljax.overlap``; estimated, ``estimate.hidden_estimate``).
An HSDP row is built with ``zero.shard_size="host"``; its ``mesh_shape`` is the mesh that
builds, 'replica' (the hosts) x 'data' (a host's replicas), as ``plan.mesh.shape`` reads.

Not searched: virtual stages, a module split inside stages, ZeRO beyond v1, checkpointing or
offload on stage rows, ``amp``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from epljax import batch as batch_lib
from epljax import chips
from epljax import cost as cost_lib
from epljax import estimate as estimate_lib
from epljax import strategy as strategy_lib
from epljax.errors import PlanError, size
from epljax.memory import offload
from epljax.mesh import DATA, MODEL, REPLICA, STAGE
from epljax.pipeline import schedules
from epljax.pipeline.auto import StageBalanceWarning
from epljax.sharding import annotations

MAX_COMPILES = 5
MICRO_BATCHES = (1, 2, 4)
ZERO_LEVELS = ("", "v1", "v2", "v3")
CHECKPOINTING = ("", "auto")
OFFLOAD = ("", "v0", "v1")
ZERO_SHARDS = ("", estimate_lib.HOST_SHARD)
SEARCHED_KEYS = {"num_micro_batch": "pipeline.num_micro_batch", "zero_level": "zero.level",
                 "gradient_checkpoint": "gradient_checkpoint.type", "offload": "offload.level",
                 "zero_shard": "zero.shard_size"}
# How far a pace-scaled estimate may be from its compiled step once a row of its kind was
# compiled (``_uncertainty``): rows estimated within it of the fastest fitting compiled step
# are near-ties, compiled while compiles remain.
TIE = 0.05


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One plan weighed by the search (a row of ``trainer.plan.search``)."""
  mesh_shape: dict[str, int]
  features: dict[str, Any]
  bytes_per_device: int         # compiled: arguments + outputs - aliased + temp; else estimated
  predicted_step_s: float
  compute_s: float
  communication_s: float       # exposed: what compute does not hide (``cost.StepCost``)
  bubble_s: float
  compiled: bool                # False: every number is the estimate of ``_estimate``
  split: str = ""               # what is under epl.split(model): "all", a module path, or ""
  chosen: bool = False
  reason: str = ""              # why it lost; "" for the chosen
  refused: str = ""             # the PlanError its build raised, if any
  skipped: str = ""             # why it was not compiled though within the limit, if so
  estimate: Any = dataclasses.field(default=None, repr=False, compare=False)  # cost.StepCost
  cost: Any = dataclasses.field(default=None, repr=False, compare=False)  # compiled, or None

  @property
  def stages(self) -> int:
    return self.mesh_shape.get(STAGE, 1)

  @property
  def overrides(self) -> dict[str, Any]:
    stages = ({"auto.auto_parallel": True, "pipeline.num_stages": self.stages}
              if self.stages > 1 else {})   # (EPL's meaning: cut this many stages)
    return {**{SEARCHED_KEYS[k]: v for k, v in self.features.items()
               if k != "zero_shard" or v}, **stages}   # (zero.shard_size: only HSDP sets it)


@dataclasses.dataclass(frozen=True)
class Scope:
  """A candidate's ``epl.split(k)`` task graph, handed to ``build`` in place of the user's
  defaults: the whole model (as the default strategy) or one module (an ``epl.annotate``
  module rule). Nothing global is written while searching."""
  defaults: strategy_lib.Defaults | None = None
  module_rules: tuple[annotations.ModuleRule, ...] = ()

  @classmethod
  def of(cls, k: int | None, split: str) -> Scope | None:
    if not k or k == 1 or not split:
      return None
    if split == "all":
      return cls(defaults=strategy_lib.Defaults(strategy_lib.split(k), "epljax/search.py"))
    return cls(module_rules=(annotations.ModuleRule(re.escape(split), strategy_lib.split(k)),))


@dataclasses.dataclass(frozen=True)
class Builders:
  """What the search builds candidates with (``epljax.build``'s ``build`` and
  ``pipeline_plan``): passed in, so this module does not import ``build``."""
  build: Callable
  pipeline_plan: Callable


def search(fns, config, cluster, rng, batch, builders: Builders) -> Any:
  """The ``Built`` of the chosen plan, its ``plan.search`` the rows weighed (module doc)."""
  chip = chips.agreed(chips.chip_of(cluster.devices, config.auto))
  limit = config.auto.memory_limit or chip.memory_bytes
  fixed = {name: config.to_dict()[key] for name, key in SEARCHED_KEYS.items()
           if key in config.changed()}
  if fixed.get("zero_shard") == "all":   # (the default: ZeRO over all the replicas)
    fixed["zero_shard"] = ""
  notes = []
  if "offload" not in fixed and (cluster.platform == "cpu"
                                 or offload.host_memory_kind(cluster.devices[0]) is None):
    fixed["offload"] = ""
    notes.append("offload candidates not searched: " + (
        "on CPU host memory is the device's memory" if cluster.platform == "cpu" else
        f"the {cluster.platform} devices address no {offload.HOST!r} memory"))
  make = functools.partial(_build_with, builders.build, fns,
                           config.replace({"auto.auto_parallel": False}),
                           cluster, rng, batch)
  bases = _base_builds(make, len(cluster.devices), _per_host(cluster), fixed, notes)
  batch_bytes = jax.process_count() * sum(
      math.prod(np.shape(x)) * np.dtype(batch_lib._dtype(x)).itemsize
      for x in jax.tree.leaves(batch))
  residuals = estimate_lib.residual_bytes(
      next(iter(bases.values())).capture.program.closed_jaxpr) if bases else 0
  update = (estimate_lib.update_flops(fns.optimizer,
                                      next(iter(bases.values())).user_state.params_shape)
            if bases else 0.0)
  facts = {key: estimate_lib.program_facts(built, key[1], bool(config.amp.level))
           for key, built in bases.items()}
  rows = [_estimate(built, facts[key], features, chip, batch_bytes, key[1], residuals, update)
          for key, built in bases.items() for features in _feature_grid(fixed, built)]
  if (1, "") in bases:   # (a mesh the user fixed has no stage axis to search)
    rows += _stage_rows(functools.partial(_pipeline_plan, builders.pipeline_plan, fns, config,
                                          cluster, rng, batch),
                        bases, facts, fixed, chip, batch_bytes, residuals, update, notes)
  rows.sort(key=_order)
  if not rows:
    raise PlanError("auto.auto_parallel found no candidate plan: " + "; ".join(notes[1:]))
  rows, chosen, compiles = _compile_in_order(
      rows, functools.partial(_compile_row, bases, make, chip), limit)
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
  model, or one module) as an ``epl.split(k)`` task graph when ``k > 1`` (``Scope``)."""
  return build(fns, config.replace(overrides), cluster, rng, batch, Scope.of(k, split))


def _base_builds(make: Callable, num_devices: int, per_host: int, fixed: dict[str, Any],
                 notes: list[str]) -> dict[tuple[int | None, str], Any]:
  """(model-axis size (None: fixed by the user), what is split) -> the candidate's build
  without features, whose specs the estimates read; ``notes`` gets why one is not searched.
  The model axis stays inside a host (at most ``per_host`` devices): tensor parallelism
  all-reduces activations every layer, which the links across hosts cannot carry."""
  user_mesh = _user_scoped()
  if user_mesh:
    notes.append(f"mesh fixed by the user: {user_mesh}")
  plain = {SEARCHED_KEYS[n]: fixed.get(n, d) for n, d in
           (("num_micro_batch", 1), ("zero_level", ""), ("gradient_checkpoint", ""),
            ("offload", ""))}
  if user_mesh:
    return {(None, ""): make(None, "", plain)}
  bases: dict[tuple[int | None, str], Any] = {}
  module = None
  sizes = [k for k in _divisors(num_devices)[1:] if per_host % k == 0]
  if len(sizes) < len(_divisors(num_devices)) - 1:
    notes.append(f"model axis at most {per_host}: the devices of one host")
  for k, split in [(1, "")] + [(k, s) for k in sizes for s in ("all", "module")]:
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
    elif split != "all" and (k, "all") in bases and _specs(built) == _specs(bases[(k, "all")]):
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


def _compile_in_order(rows: list[Candidate], compile_row: Callable, limit: int):
  """Compiles rows within the limit (``compile_row``: a row -> its Built and compiled
  ``StepCost``, as ``_compile_row``), at most ``MAX_COMPILES``: each time the one of lowest
  pace-scaled estimate (``_scaled``; ties by ``_order``) among those that could still beat the
  fastest compiled step that fits (``_worth_compiling``; module doc): (rows, (the fastest
  fitting row's index, its Built) or None, compiles)."""
  compiles, best = 0, None
  pace: dict[tuple[bool, str, int], float] = {}
  while compiles < MAX_COMPILES:
    bar = rows[best[0]].predicted_step_s if best is not None else math.inf
    open_ = [i for i, r in enumerate(rows) if not (r.compiled or r.refused)
             and r.bytes_per_device <= limit and _worth_compiling(r, pace, bar)]
    if not open_:
      break
    i = min(open_, key=lambda i: (_scaled(rows[i], pace), _order(rows[i])))
    row = rows[i]
    try:
      built, step = compile_row(row)
    except PlanError as e:   # a feature this model refuses: the row says why
      rows[i] = dataclasses.replace(row, refused=str(e).splitlines()[0])
      continue
    compiles += 1
    pace[_kind(row)] = step.step_s / row.predicted_step_s
    rows[i] = row = _measured(row, step, dict(built.plan.mesh.shape))
    if row.bytes_per_device > limit:
      rows = _calibrated(rows, row)
    elif best is None or row.predicted_step_s < rows[best[0]].predicted_step_s:
      best = (i, built)
  bar = rows[best[0]].predicted_step_s if best is not None else math.inf
  rows = [r if r.compiled or r.refused or r.bytes_per_device > limit
          else dataclasses.replace(r, skipped=_why_not_compiled(r, pace, bar))
          for r in rows]
  return rows, best, compiles


def _kind(row: Candidate) -> tuple[bool, str, int]:
  """The rows whose estimates err alike: (pipeline or not, ZeRO level, model axis).

  Unpipelined, per ZeRO level: the estimate hides the same share of every level's
  collectives, where the compiled step hides v3's gathers inside the layers and not v1's and
  v2's gathers after the update, so one level's pace says little of another's; and per model
  axis, whose all-reduces the estimate hides none of (70B on 64 H100s, ZeRO v3: data=16 x
  model=4 ran at 1.22x its estimate, data=8 x model=8 at 0.97x). Pipelines: one kind (their
  estimate hides nothing)."""
  if row.stages > 1:
    return (True, "", 0)
  return (False, row.features["zero_level"], row.mesh_shape.get(MODEL, 1))


def _scaled(row: Candidate, pace: dict) -> float:
  """``row``'s estimate times its kind's pace: compiled / estimated time of the last compiled
  row of its kind (1 before one is compiled)."""
  return row.predicted_step_s * pace.get(_kind(row), 1.0)


def _uncertainty(row: Candidate, pace: dict) -> float:
  """How far ``row``'s pace-scaled estimate may be from its compiled time, as a share: ``TIE``
  once a row of its kind was compiled; before, as far as any kind's estimate was from its
  compiled step in this search (at least ``TIE``)."""
  if _kind(row) in pace:
    return TIE
  return max([TIE] + [abs(p - 1) for p in pace.values()])


def _worth_compiling(row: Candidate, pace: dict, bar: float) -> bool:
  """Whether ``row`` could beat ``bar`` (the fastest fitting compiled step; inf before one):
  its pace-scaled estimate is under it, or over it by less than its uncertainty (a near-tie,
  which only a compile tells apart)."""
  return _scaled(row, pace) < bar * (1 + _uncertainty(row, pace))


def _why_not_compiled(row: Candidate, pace: dict, bar: float) -> str:
  """The ``skipped`` text of a row within the limit that was not compiled."""
  if _worth_compiling(row, pace, bar):
    return (f"not compiled: the {MAX_COMPILES} compiles (MAX_COMPILES) were spent on rows "
            "of lower pace-scaled estimates")
  kind = _kind(row)
  scale = pace.get(kind, 1.0)
  by = ("its estimate" if kind not in pace else
        f"its estimate x {scale:.3g} (compiled / estimated time of the last compiled "
        + ("pipeline row)" if kind[0] else "unpipelined row with "
           + (f"ZeRO {kind[1]}" if kind[1] else "no ZeRO") + f", model={kind[2]})"))
  return (f"not compiled: {by}, {_ms(row.predicted_step_s * scale)}, is over the fitting "
          f"compiled {_ms(bar)} by more than its uncertainty "
          f"({_uncertainty(row, pace):.0%})")


def _compile_row(bases: dict, make: Callable, chip, row: Candidate):
  """``row`` built (its overrides on its base's model axis and split) and its compiled
  ``StepCost``."""
  k, split = (row.mesh_shape[MODEL], row.split) if row.stages > 1 else next(
      key for key, b in bases.items()
      if _base_shape(dict(b.plan.mesh.shape)) == _base_shape(row.mesh_shape)
      and key[1] == row.split)
  built = make(k, split, row.overrides)
  return built, _compiled_cost(built, row.features, chip)


def _compiled_cost(built, features: dict[str, Any], chip) -> cost_lib.StepCost:
  """The compiled step's cost on ``chip`` (``build.Target.step_cost``: the offload level of
  ``features``)."""
  return cost_lib.Target(chip, "", None, features["offload"]).step_cost(built.plan)


def _order(row: Candidate) -> tuple:
  """Estimated time first; among equals the simpler plan (fewer devices on the model axis,
  fewer micro batches, no ZeRO, no checkpointing, no offload, ZeRO over the whole data axis)."""
  f = row.features
  return (round(row.predicted_step_s, 12), row.stages, row.mesh_shape.get(MODEL, 1),
          f["num_micro_batch"],
          ZERO_LEVELS.index(f["zero_level"]), CHECKPOINTING.index(f["gradient_checkpoint"]),
          OFFLOAD.index(f["offload"]), bool(f.get("zero_shard")))


def _pipeline_plan(pipeline_plan, fns, config, cluster, rng, batch, stages: int, micro: int,
                   k: int):
  return pipeline_plan(fns, config.replace(
      {"auto.auto_parallel": True, "pipeline.num_stages": stages,
       "pipeline.num_micro_batch": micro}), cluster, rng, batch, Scope.of(k, "all"))


def _stage_rows(make_pipe: Callable, bases: dict, facts: dict, fixed: dict[str, Any], chip,
                batch_bytes: int, residuals: int, update: float,
                notes: list[str]) -> list[Candidate]:
  """data x stage x model candidates for S = 2, 4, ... stages while the model cuts into S
  balanced stages (``auto.auto_parallel``'s cut), each stage the whole of it under
  ``epl.split(k)`` for the k of the whole-model splits searched (and k = 1), with S, 2S and 4S
  micro batches (8S too: 1F1B's bubble is (S - 1) / (M + S - 1) of its ticks) or the user's,
  and without ZeRO or with ZeRO v1 (a distributed optimizer: each stage's optimizer state
  sharded over its data replicas) where there are replicas; estimated from one plan per S and
  k made without compiling (``estimate.stage_cost``; the other micro batch counts from its
  schedule and its bytes per micro batch scaled), a split stage's traffic over model from its
  data x model base (``bases`` and their ``facts``, keyed as ``_base_builds``)."""
  features = {name: fixed.get(name, "") for name in ("gradient_checkpoint", "offload",
                                                     "zero_shard")}
  zero = fixed.get("zero_level")
  if any(features.values()) or zero not in (None, "", "v1"):
    notes.append("stage candidates not searched: with " + ", ".join(
        f"{SEARCHED_KEYS[k]}={v!r}" for k, v in {**features, "zero_level": zero}.items() if v))
    return []
  dp = bases[(1, "")]
  devices, rows = dp.plan.mesh.size, dp.plan.global_rows
  out = []
  for key in [(1, "")] + [key for key in bases if key[0] and key[0] > 1 and key[1] == "all"]:
    k, base = key[0], bases[key]
    for stages in _divisors(devices // k)[1:]:
      replicas = devices // (stages * k)
      micros = ([fixed["num_micro_batch"]] if "num_micro_batch" in fixed else
                [m for m in (stages, 2 * stages, 4 * stages, 8 * stages)
                 if rows % (replicas * m) == 0])
      if not micros:
        continue
      try:
        with warnings.catch_warnings():
          warnings.simplefilter("error", StageBalanceWarning)
          pipe = make_pipe(stages, micros[0], k)
      except (PlanError, StageBalanceWarning) as e:
        notes.append(f"stage={stages}" + (f" x model={k}" if k > 1 else "") + " not searched: "
                     + re.split(r"; |\. ", str(e).splitlines()[0])[0])
        break   # (a model that does not cut into S balanced stages does not cut into 2S)
      zeros = [zero] if zero is not None else ["", "v1"] if replicas > 1 else [""]
      for micro, level in itertools.product(micros, zeros):
        feats = {**features, "num_micro_batch": micro, "zero_level": level}
        over_model = (estimate_lib.step_cost(base, facts[key], feats, chip, batch_bytes,
                                             residuals) if k > 1 else None)
        schedule = schedules.make_schedule(pipe.schedule.strategy, stages, micro)
        step = estimate_lib.stage_cost(base, facts[(1, "")], pipe, schedule, feats, chip,
                                       batch_bytes, over_model, update)
        out.append(Candidate(dict(pipe.mesh.shape), feats, step.bytes_per_device, step.step_s,
                             step.compute_s, step.exposed_s, step.bubble_s,
                             compiled=False, split="all" if k > 1 else "", estimate=step))
  return out


def _feature_grid(fixed: dict[str, Any], built) -> Iterator[dict[str, Any]]:
  """The feature combinations weighed on a base build; ``zero_shard="host"`` (HSDP) only with
  ZeRO and where the data axis spans hosts with several replicas in each (else it is plain
  ZeRO, or no sharding at all)."""
  rows = built.plan.global_rows
  replicas = built.plan.num_replicas
  mesh = built.plan.mesh
  # (a host's line of the data axis holds several replicas and not all: with one, ZeRO within
  # it would shard nothing)
  spans = 1 < estimate_lib.data_per_host(mesh) < dict(mesh.shape).get(DATA, 1)
  choices = {
      "num_micro_batch": [m for m in MICRO_BATCHES if rows % (replicas * m) == 0],
      "zero_level": ZERO_LEVELS if replicas > 1 else ("",),
      "gradient_checkpoint": CHECKPOINTING,
      "offload": OFFLOAD,
      "zero_shard": ZERO_SHARDS if spans else ("",),
  }
  for name, value in fixed.items():
    choices[name] = (value,)
  for values in itertools.product(*choices.values()):
    features = dict(zip(choices, values))
    if features["zero_shard"] and not features["zero_level"] and "zero_shard" not in fixed:
      continue   # (HSDP without ZeRO is plain data parallelism, weighed already)
    yield features


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


def _specs(built) -> list:
  return [leaf.spec for leaf in built.plan.leaves]


def _axes(spec) -> set[str]:
  return {a for a in jax.tree.leaves(tuple(spec)) if a is not None}


def _per_host(cluster) -> int:
  """Devices of the host with the fewest (a model axis within it stays within every host)."""
  counts: dict[int, int] = {}
  for d in cluster.devices:
    counts[d.process_index] = counts.get(d.process_index, 0) + 1
  return min(counts.values())


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def _estimate(built, facts, features: dict[str, Any], chip, batch_bytes: int, split: str,
              residuals: int, update: float) -> Candidate:
  """A candidate before compiling: every number is ``estimate.step_cost``'s."""
  step = estimate_lib.step_cost(built, facts, features, chip, batch_bytes, residuals, update)
  return Candidate(estimate_lib.hybrid_shape(built.plan.mesh, features), dict(features),
                   step.bytes_per_device, step.step_s, step.compute_s, step.exposed_s,
                   step.bubble_s, compiled=False, split=split, estimate=step)


def _base_shape(shape: dict[str, int]) -> dict[str, int]:
  """A row's mesh shape with an HSDP row's 'replica' x 'data' folded back into 'data': the
  shape of the base build its features go on."""
  out = {a: n for a, n in shape.items() if a != REPLICA}
  return {**out, DATA: out.get(DATA, 1) * shape.get(REPLICA, 1)}


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
    if not r.compiled and (r.stages > 1) == (measured.stages > 1):   # (like with like)
      acts = int(r.estimate.parts["activations"] * scale)
      est = dataclasses.replace(r.estimate, parts={**r.estimate.parts, "activations": acts},
                                bytes_per_device=r.estimate.bytes_per_device
                                - r.estimate.parts["activations"] + acts)
      r = dataclasses.replace(r, bytes_per_device=est.bytes_per_device, estimate=est)
    out.append(r)
  return out


def _measured(row: Candidate, step, mesh_shape: dict[str, int]) -> Candidate:
  return dataclasses.replace(row, mesh_shape=mesh_shape, bytes_per_device=step.bytes_per_device,
                             predicted_step_s=step.step_s, compute_s=step.compute_s,
                             communication_s=step.exposed_s, bubble_s=step.bubble_s,
                             compiled=True, cost=step)


def _lost(row: Candidate, best: Candidate, limit: int) -> Candidate:
  """Why ``row`` lost against ``best``: over the limit, or the part of the predicted step
  that grew most. Compiled rows are compared by their compiled costs, the others by both
  rows' estimates."""
  how = "compiled" if row.compiled else "estimated, not compiled"
  if row.refused:
    return dataclasses.replace(row, reason=f"refused: {row.refused}")
  against = (f"; {_ms(row.predicted_step_s)} against the chosen "
             f"{_ms(best.predicted_step_s)}")
  if row.bytes_per_device > limit:
    return dataclasses.replace(
        row, reason=f"over the limit by {size(row.bytes_per_device - limit)} ({how})"
        + against)
  if row.skipped and row.predicted_step_s <= best.predicted_step_s:
    return dataclasses.replace(row, reason=row.skipped + against)
  mine, theirs = (row.cost, best.cost) if row.compiled else (row.estimate, best.estimate)
  diffs = {"compute": mine.compute_s - theirs.compute_s,
           "host transfers": mine.host_s - theirs.host_s,
           "bubble": mine.bubble_s - theirs.bubble_s,
           "less communication hidden behind compute": theirs.hidden_s - mine.hidden_s}
  for key in sorted(set(mine.comm_s) | set(theirs.comm_s)):
    kind, axis = key
    diffs[f"{kind} over {axis}"] = mine.comm_s.get(key, 0.0) - theirs.comm_s.get(key, 0.0)
  # The part that grew most; of equal ones the first in this order (compute, host transfers,
  # bubble, then collectives by kind and axis), so the text is the same every run.
  what, delta = max(diffs.items(), key=lambda kv: kv[1])
  if mine.step_s - theirs.step_s > 1e-12 and delta > 0:
    return dataclasses.replace(row, reason=f"+{_ms(delta)} {what} ({how})" + against)
  # Its estimate is not above the chosen row's: the chosen row's compile bettered its own.
  if row.skipped:
    return dataclasses.replace(row, reason=row.skipped + against)
  if row.predicted_step_s > best.predicted_step_s:
    return dataclasses.replace(row, reason=f"slower than the chosen row's compiled step ({how})"
                               + against)
  return dataclasses.replace(row, reason=f"as fast, but a simpler plan fitted first ({how})"
                             + against)


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
