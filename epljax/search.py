"""``auto.auto_parallel`` without ``pipeline.num_stages``: search the plan.

>>> epl.init({"auto.auto_parallel": True, "auto.memory_limit": 16 << 30})  # doctest: +SKIP
>>> state = trainer.init(rng, batch)
>>> print(trainer.plan)             # the chosen plan, and the candidates it was weighed against
>>> trainer.plan.search[0].chosen
True

1. The candidates (``epljax.candidates``: meshes, splits, stages and features) are estimated
   before compiling, from one trace per mesh and one pipeline plan per stage count.
2. Candidates estimated over ``auto.memory_limit`` are dropped; the others are compiled, at most
   ``auto.max_compiles`` (5), each time the one of lowest pace-scaled estimate: its estimate
   times compiled / estimated time of the last compiled row of its kind (``_kind``: pipeline or
   not, its ZeRO level and model axis). A compiled step over the limit rescales the estimates
   of the rows still to weigh in the part it measured: the residuals of its kind (pipeline or
   not, checkpointing or not), or the gradients' sum where that was its estimated peak
   (``_calibrated``), each row from its own first estimate. Once one
   compiled step fits, a row is compiled only while it could beat it: its pace-scaled estimate
   is below that step's compiled time, or above by less than its uncertainty (``TIE`` once its
   kind was compiled; before, the largest error of any kind's estimate in this search, at most
   ``TIE_LIMIT``): near-ties take the compiles left, so the choice is the lowest predicted step
   of all the search could afford to check. Of the compiled steps within the limit the fastest
   is chosen, by costs read from the compiled program (``cost.compiled_cost``; a pipeline's
   FLOPs and bubble from its branches' FLOPs times the schedule's busy slots,
   ``pipeline.cost.compute``).
   A row that was only estimated says so.
3. Every row that lost says why, against the chosen row's predicted step (``_lost``).

Predicted times count only the communication compute does not hide (``cost.StepCost``:
compiled, from the schedule, ``epljax.overlap``; estimated, ``estimate.hidden_estimate``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

from epljax import candidates
from epljax import chips
from epljax import cost as cost_lib
from epljax.candidates import Builders, Candidate, Scope  # noqa: F401 (build.py's names)
from epljax.errors import PlanError, size
from epljax.mesh import MODEL

# How far a pace-scaled estimate may be from its compiled step once a row of its kind was
# compiled (``_uncertainty``): rows estimated within it of the fastest fitting compiled step
# are near-ties, compiled while compiles remain.
TIE = 0.05
# At most this far before its kind was compiled, however far off other kinds' estimates were:
# the error the time model is held to against published steps (bench/calibrate.py, within 25%);
# a search whose estimates are further off (simulated CPU devices on a nominal chip) would
# otherwise spend every compile on rows no estimate ranks near the best.
TIE_LIMIT = 0.25


def search(fns, config, cluster, rng, batch, builders: Builders) -> Any:
  """The ``Built`` of the chosen plan, its ``plan.search`` the rows weighed (module doc)."""
  chip = chips.agreed(chips.chip_of(cluster.devices, config.auto))
  limit = config.auto.memory_limit or chip.memory_bytes
  found = candidates.space(fns, config, cluster, rng, batch, builders, chip)
  if not found.rows:
    raise PlanError("auto.auto_parallel found no candidate plan: "
                    + "; ".join(found.notes[1:]))
  budget = config.auto.max_compiles
  rows, chosen, compiles = _compile_in_order(
      list(found.rows), functools.partial(compile_row, found.bases, found.make, chip), limit,
      budget)
  if chosen is None:
    raise PlanError(_none_fits(rows, limit, config.auto.memory_limit, compiles, budget))
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
                             f"compiled  {compiles} of {len(rows)} candidates", *found.notes]
  return built


def _compile_in_order(rows: list[Candidate], compile_row: Callable, limit: int, budget: int):
  """Compiles rows within the limit (``compile_row``: a row -> its Built and compiled
  ``StepCost``, the module's ``compile_row`` with its builds), at most ``budget``: each time
  the one of lowest pace-scaled estimate (``_scaled``; ties by ``candidates.order``) among those that could
  still beat the fastest compiled step that fits (``_worth_compiling``; module doc): (rows,
  (the fastest fitting row's index, its Built) or None, compiles)."""
  compiles, best = 0, None
  pace: dict[tuple[bool, str, int], float] = {}
  held = _Held()   # (``_calibrated``)
  while compiles < budget:
    bar = rows[best[0]].predicted_step_s if best is not None else math.inf
    open_ = [i for i, r in enumerate(rows) if not (r.compiled or r.refused)
             and r.bytes_per_device <= limit and _worth_compiling(r, pace, bar)]
    if not open_:
      break
    i = min(open_, key=lambda i: (_scaled(rows[i], pace), candidates.order(rows[i])))
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
      rows = _calibrated(rows, row, held)
    elif best is None or row.predicted_step_s < rows[best[0]].predicted_step_s:
      best = (i, built)
  bar = rows[best[0]].predicted_step_s if best is not None else math.inf
  rows = [r if r.compiled or r.refused or r.bytes_per_device > limit
          else dataclasses.replace(r, skipped=_why_not_compiled(r, pace, bar, budget))
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
  compiled step in this search (at least ``TIE``, at most ``TIE_LIMIT``)."""
  if _kind(row) in pace:
    return TIE
  return min(TIE_LIMIT, max([TIE] + [abs(p - 1) for p in pace.values()]))


def _worth_compiling(row: Candidate, pace: dict, bar: float) -> bool:
  """Whether ``row`` could beat ``bar`` (the fastest fitting compiled step; inf before one):
  its pace-scaled estimate is under it, or over it by less than its uncertainty (a near-tie,
  which only a compile tells apart)."""
  return _scaled(row, pace) < bar * (1 + _uncertainty(row, pace))


def _why_not_compiled(row: Candidate, pace: dict, bar: float, budget: int) -> str:
  """The ``skipped`` text of a row within the limit that was not compiled."""
  if _worth_compiling(row, pace, bar):
    return (f"not compiled: the {budget} compiles (auto.max_compiles) were spent on rows "
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


def compile_row(bases: dict, make: Callable, chip, row: Candidate):
  """``row`` built (its overrides on its base's model axis and split) and its compiled
  ``StepCost``."""
  k, split = (row.mesh_shape[MODEL], row.split) if row.stages > 1 else next(
      key for key, b in bases.items()
      if candidates.base_shape(dict(b.plan.mesh.shape)) == candidates.base_shape(row.mesh_shape)
      and key[1] == row.split)
  built = make(k, split, row.overrides)
  return built, _compiled_cost(built, row.features, chip)


def _compiled_cost(built, features: dict[str, Any], chip) -> cost_lib.StepCost:
  """The compiled step's cost on ``chip`` (``build.Target.step_cost``: the offload level of
  ``features``)."""
  return cost_lib.Target(chip, "", None, features["offload"]).step_cost(built.plan)


def _residuals_kind(row: Candidate) -> tuple[bool, str]:
  """What the residual estimate of a row is like with (``_calibrated``): pipeline or not, and
  its checkpointing, which changes what XLA keeps for the backward pass."""
  return row.stages > 1, row.features.get("gradient_checkpoint", "")


@dataclasses.dataclass
class _Held:
  """What the compiled steps over the limit held against their estimates (``_calibrated``):
  the scale of the residuals per kind (``_residuals_kind``), the last one and the floor's per
  pipeline or not."""
  residuals: dict[tuple[bool, str], float] = dataclasses.field(default_factory=dict)
  last: dict[bool, float] = dataclasses.field(default_factory=dict)
  floor: dict[bool, float] = dataclasses.field(default_factory=dict)

  def activations(self, row: Candidate) -> int:
    """``row``'s activation bytes, its first estimate corrected."""
    pipeline = row.stages > 1
    return row.estimate.activations.bytes(
        self.residuals.get(_residuals_kind(row), self.last.get(pipeline, 1.0)),
        self.floor.get(pipeline, 1.0))


def _calibrated(rows: list[Candidate], measured: Candidate, held: _Held) -> list[Candidate]:
  """The estimates of the rows not compiled yet, corrected by what the compiled ``measured``
  row held against its own estimate, in the part its estimated peak was made of
  (``cost.Activations``; the other parts are exact): its residuals, for the rows of its kind
  (``_residuals_kind``; a kind none of whose rows was measured takes the last residual scale
  with or without stages as it is), or the gradients' sum where that was its estimated peak
  (and, until residuals are measured, the residuals by as much). Every row is rescaled from
  its own first estimate, so a scale measured on one kind does not multiply another's.
  ``held`` keeps the scales through the search (updated here)."""
  a = measured.estimate.activations
  exact = measured.estimate.bytes_per_device - measured.estimate.parts["activations"]
  acts = measured.bytes_per_device - exact
  pipeline = measured.stages > 1
  if a is None or acts <= 0:
    return rows
  if a.at_floor:
    held.floor[pipeline] = acts / a.floor
    held.last.setdefault(pipeline, acts / a.floor)
  elif a.residuals > 0 and acts > a.accumulator:
    held.residuals[_residuals_kind(measured)] = held.last[pipeline] = (
        (acts - a.accumulator) / a.residuals)
  else:
    return rows
  out = []
  for r in rows:
    if not r.compiled and (r.stages > 1) == pipeline and r.estimate.activations is not None:
      new = held.activations(r)
      est = dataclasses.replace(r.estimate, parts={**r.estimate.parts, "activations": new},
                                bytes_per_device=r.estimate.bytes_per_device
                                - r.estimate.parts["activations"] + new)
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


def _none_fits(rows: list[Candidate], limit: int, set_limit: int, compiles: int,
               budget: int) -> str:
  small = min([r for r in rows if not r.refused] or rows, key=lambda r: r.bytes_per_device)
  parts = small.estimate.parts
  top = max(parts, key=parts.get)
  shown = ", ".join(f"{k} {size(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
  features = ", ".join(f"{k}={v!r}" for k, v in small.features.items())
  where = f"auto.memory_limit={set_limit}" if set_limit else "the device's memory"
  untried = sum(not r.compiled and not r.refused and r.bytes_per_device <= limit for r in rows)
  if untried:   # the compile budget ran out before the estimates did
    where += (f"; the {compiles} compiled candidates were over it, {untried} more estimated "
              f"within it were not compiled (auto.max_compiles={budget})")
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
