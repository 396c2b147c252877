"""The plan search's candidate space (``epljax.search``): which plans are weighed, each
estimated before compiling.

Candidates are config overrides on a mesh: every factorization of the devices into data x
model, with under ``epl.split(k)`` either the whole model or only the module holding most of
the parameter bytes (``_dominant_module``: EPL's large classifier split by its classes, the rest
data-parallel), each kept only where the split rules split some parameter; data x stage x model
where the model cuts into balanced stages (``_stage_rows``);
``pipeline.num_micro_batch`` (1, 2, 4 where the batch divides), ``zero.level`` (v2 only with
accumulation: without it v2 compiles to v1's program; where the data axis spans hosts, also
ZeRO within each host, replicated across: HSDP, ``zero_shard="host"``),
``gradient_checkpoint.type`` ("" or "auto") and, off CPU, ``offload.level``; stage rows with
S, 2S, 4S and 8S micro batches, without ZeRO or with ZeRO v1. A key the user set
and a user's scope, default strategy or ``epl.annotate`` rule are fixed, not searched.

One trace per mesh (no compile) gives every parameter's spec; parameter, gradient and
optimizer bytes per device follow from them and the features, exactly; activations, FLOPs
and collectives are estimated from the traced program (``estimate.step_cost``; activations
from the residuals of the loss's ``jax.vjp``). Stage candidates (data x stage x model, for
S = 2, 4, ... while ``auto.auto_parallel``'s cut gives S balanced stages) are estimated from
their pipeline plans, made without compiling (``build.pipeline_plan``,
``estimate.stage_cost``: the bubble from the schedule's tick table).

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
from epljax import estimate as estimate_lib
from epljax import strategy as strategy_lib
from epljax.errors import PlanError
from epljax.memory import offload, remat
from epljax.mesh import DATA, MODEL, REPLICA, STAGE
from epljax.pipeline import schedules
from epljax.pipeline.auto import StageBalanceWarning
from epljax.sharding import annotations

MICRO_BATCHES = (1, 2, 4)
ZERO_LEVELS = ("", "v1", "v2", "v3")
CHECKPOINTING = ("", "auto")
OFFLOAD = ("", "v0", "v1")
ZERO_SHARDS = ("", estimate_lib.HOST_SHARD)
SEARCHED_KEYS = {"num_micro_batch": "pipeline.num_micro_batch", "zero_level": "zero.level",
                 "gradient_checkpoint": "gradient_checkpoint.type", "offload": "offload.level",
                 "zero_shard": "zero.shard_size"}


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
  compiled: bool                # False: every number is the estimate of ``estimate_row``
  split: str = ""               # what is under epl.split(model): "all", a module path, or ""
  chosen: bool = False
  reason: str = ""              # why it lost; "" for the chosen
  refused: str = ""             # the PlanError its build raised, if any
  skipped: str = ""             # why it was not compiled though within the limit, if so
  estimate: Any = dataclasses.field(default=None, repr=False, compare=False)  # cost.StepCost
  cost: Any = dataclasses.field(default=None, repr=False, compare=False)  # compiled, or None
  # The bytes estimated before any compile (a compiled step over the limit corrects the
  # ``estimate`` of the rows still to weigh, never this); default: ``bytes_per_device`` of
  # the row as made, before it was compiled.
  estimated_bytes: int | None = None

  def __post_init__(self):
    if self.estimated_bytes is None:
      object.__setattr__(self, "estimated_bytes", self.estimate.bytes_per_device
                         if self.estimate is not None else self.bytes_per_device)

  @property
  def compiled_bytes(self) -> int | None:
    """The compiled step's bytes per device (``memory_analysis()``: arguments + outputs -
    aliased + temp); None where the row was not compiled."""
    return self.bytes_per_device if self.compiled else None

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


@dataclasses.dataclass(frozen=True)
class Space:
  """The candidates of one search, estimated and in ``order``, and the builds they stand on."""
  rows: list[Candidate]
  bases: dict[tuple[int | None, str], Any]   # (model axis, what is split) -> ``_base_builds``'s
  make: Callable     # (k, split, overrides) -> a Built, traced and placed (``_build_with``)
  notes: list[str]   # what was not searched, and why


def space(fns, config, cluster, rng, batch, builders: Builders, chip) -> Space:
  """Every candidate of the module doc, estimated on ``chip`` (nothing compiled)."""
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
  closed = next(iter(bases.values())).capture.program.closed_jaxpr if bases else None
  plain = estimate_lib.residual_bytes(closed) if closed is not None else 0
  # (gradient_checkpoint.type="auto"'s footprint, from the segments it cuts: where searched)
  residuals = estimate_lib.Residuals(plain, remat.checkpointed_residuals(
      closed, estimate_lib.residual_bytes, cluster.platform)
      if closed is not None and fixed.get("gradient_checkpoint", "auto") == "auto" else plain)
  update = (estimate_lib.update_flops(fns.optimizer,
                                      next(iter(bases.values())).user_state.params_shape)
            if bases else 0.0)
  facts = {key: estimate_lib.program_facts(built, key[1], bool(config.amp.level))
           for key, built in bases.items()}
  rows = [estimate_row(built, facts[key], features, chip, batch_bytes, key[1], residuals,
                       update)
          for key, built in bases.items() for features in feature_grid(fixed, built)]
  if (1, "") in bases:   # (a mesh the user fixed has no stage axis to search)
    rows += _stage_rows(functools.partial(_pipeline_plan, builders.pipeline_plan, fns, config,
                                          cluster, rng, batch),
                        bases, facts, fixed, chip, batch_bytes, residuals, update, notes)
  return Space(sorted(rows, key=order), bases, make, notes)


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


def _pipeline_plan(pipeline_plan, fns, config, cluster, rng, batch, stages: int, micro: int,
                   k: int):
  return pipeline_plan(fns, config.replace(
      {"auto.auto_parallel": True, "pipeline.num_stages": stages,
       "pipeline.num_micro_batch": micro}), cluster, rng, batch, Scope.of(k, "all"))


def _stage_rows(make_pipe: Callable, bases: dict, facts: dict, fixed: dict[str, Any], chip,
                batch_bytes: int, residuals: estimate_lib.Residuals, update: float,
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


def feature_grid(fixed: dict[str, Any], built) -> Iterator[dict[str, Any]]:
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
    if (features["zero_level"] == "v2" and features["num_micro_batch"] == 1
        and "zero_level" not in fixed):
      continue   # (without accumulation v2 compiles to v1's program, weighed already)
    yield features


def estimate_row(built, facts, features: dict[str, Any], chip, batch_bytes: int, split: str,
              residuals: estimate_lib.Residuals, update: float) -> Candidate:
  """A candidate before compiling: every number is ``estimate.step_cost``'s."""
  step = estimate_lib.step_cost(built, facts, features, chip, batch_bytes, residuals, update)
  return Candidate(estimate_lib.hybrid_shape(built.plan.mesh, features), dict(features),
                   step.bytes_per_device, step.step_s, step.compute_s, step.exposed_s,
                   step.bubble_s, compiled=False, split=split, estimate=step)


def base_shape(shape: dict[str, int]) -> dict[str, int]:
  """A row's mesh shape with an HSDP row's 'replica' x 'data' folded back into 'data': the
  shape of the base build its features go on."""
  out = {a: n for a, n in shape.items() if a != REPLICA}
  return {**out, DATA: out.get(DATA, 1) * shape.get(REPLICA, 1)}


def order(row: Candidate) -> tuple:
  """Estimated time first; among equals the simpler plan (fewer devices on the model axis,
  fewer micro batches, no ZeRO, no checkpointing, no offload, ZeRO over the whole data axis)."""
  f = row.features
  return (round(row.predicted_step_s, 12), row.stages, row.mesh_shape.get(MODEL, 1),
          f["num_micro_batch"],
          ZERO_LEVELS.index(f["zero_level"]), CHECKPOINTING.index(f["gradient_checkpoint"]),
          OFFLOAD.index(f["offload"]), bool(f.get("zero_shard")))


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
