"""``auto.auto_parallel`` with ``pipeline.num_stages``: cut a model without stage annotations
into stages of about equal compute (EPL's experimental automatic pipeline partitioning).

The traced program's equations, in trace order, are cut at ``num_stages - 1`` places. A place
between two equations is a *legal* cut when

- no loop, branch or custom-derivative call (``scan``, ``while``, ``cond``, ``remat``,
  ``custom_jvp_call``...) has equations on both sides (``jit`` calls are inlined, so cutting
  through them is fine), and
- no parameter is used on both sides (a layer's weights stay together), except a parameter
  whose uses lie more than one stage's share of FLOPs apart: a weight *tied* across the model
  (input and output embeddings). Blocking its span would leave one stage with everything; it
  is held by every stage that uses it instead (``partition.py``), its gradients summed.

A top-level ``scan`` holding more than a stage's share of the model (``nn.scan`` layers) is
first split into one scan per stage (``scan_split``, ``chunks.py``); a stacked weight read
through those chunks counts as one parameter per chunk, so the cut may fall between chunks.

Among the legal places, each cut goes where the running sums of estimated FLOPs (matmuls
``2 x output x contracted``, everything else one per output element, times the iterations of
the scans around them) and of parameter bytes
(each parameter counted at its first use) are together closest to equal shares. Trace order
is a topological order, so activations only ever flow to later stages.

A model whose layers repeat (``roll.layer_run``: a Python loop of equal blocks) is cut
between two layers when every cut can move there leaving the stage's FLOPs and its parameter
bytes each at most ``LAYER_SLACK`` of a stage's share further from equal than the balanced
place (parameters count too: every stage's buffers are padded to the largest), else at the
balanced places: as a practitioner cuts, stages of equal
layers are then one program (compiled once, ``runtime.make_loop``), each rolled stage loops
over whole layers, and only the layer's output crosses the cut. A 48-layer loop GPT on 4
stages (``bench/pipeline.py compile --baseline 48``) compiles 3 distinct stage functions
instead of 4, at 1.01x the mean FLOPs on its heaviest stage.

``stage_balance`` measures any stage plan (cut here or by scopes) the same way, and
``check_balance`` warns when a stage has no work or more than 1.5x the mean FLOPs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from itertools import accumulate

from epljax.errors import PlanError
from epljax.pipeline import chunks, roll
from epljax.sharding.capture import Capture
from epljax.sharding.program import CALLS as _TRANSPARENT  # cutting through a call is fine
from epljax.sharding.program import Node, nbytes


def auto_stage_cuts(capture: Capture, num_stages: int, not_split: str | None = None,
                    unit: str = "stages") -> tuple[int, ...]:
  """Node indices where stages 1..S-1 start (see the module doc). ``not_split``: why the
  largest scan was not split per stage (for the warning, which names them ``unit``)."""
  nodes = capture.program.nodes
  if num_stages > len(nodes):
    raise PlanError(f"pipeline.num_stages={num_stages} with auto.auto_parallel, but the traced "
                    f"loss has only {len(nodes)} equations to divide.")
  starts = _chunk_starts(capture, num_stages)
  if starts is not None:   # a scan split per stage: stage s starts with chunk s
    return starts
  node_costs = [node_flops(n) for n in nodes]
  first_bytes = _first_use_bytes(capture, num_stages)
  _warn_opaque_giants(capture, num_stages, not_split, unit)
  flops, params = (list(accumulate(v, initial=0.0)) for v in (node_costs, first_bytes))
  legal = _legal_cuts(capture, flops, flops[-1] / num_stages, num_stages)

  def distance(c: int, k: int) -> float:
    share = k / num_stages
    out = abs(flops[c] / max(flops[-1], 1.0) - share)
    return out + (abs(params[c] / params[-1] - share) if params[-1] else 0.0)

  between_layers = _between_layers(nodes)

  def place(snap: bool) -> tuple[int, ...] | None:
    """The cuts, each at its balanced place or (``snap``) between two layers; ``None`` when
    a cut inside the layers cannot move between two of them within ``LAYER_SLACK``."""
    cuts, start = [], 0
    for k in range(1, num_stages):
      left = num_stages - 1 - k   # cuts still to place after this one
      options = [c for c in legal if c > start]
      options = options[:len(options) - left] if left else options
      if not options:
        raise PlanError(_TOO_FEW.format(stages=num_stages, legal=len(legal)))
      start = min(options, key=lambda c, k=k: distance(c, k))
      if snap and not between_layers(start):
        aligned = [c for c in options if between_layers(c)]
        if not aligned:
          return None
        snapped = min(aligned, key=lambda c, k=k: distance(c, k))
        if not all(abs(run[snapped] - k * run[-1] / num_stages) <= max(
            abs(run[start] - k * run[-1] / num_stages), LAYER_SLACK * run[-1] / num_stages)
            for run in (flops, params)):
          return None
        start = snapped
      cuts.append(start)
    return tuple(cuts)

  # All cuts between layers or none: one cut left inside a layer would give a stage a layer's
  # tail and another's head, a program of its own.
  return place(snap=True) or place(snap=False)


# How far (in a stage's share of the FLOPs, and of the parameter bytes) a cut may move from its
# balanced place to fall between two of the model's repeated layers.
LAYER_SLACK = 0.05


def _between_layers(nodes: Sequence[Node]):
  """``c -> bool``: whether a cut before node ``c`` falls between two of the model's
  repeated layers (``roll.layer_run``), or outside them."""
  run = roll.layer_run([n.eqn for n in nodes])
  if run is None:
    return lambda c: True
  a, p, end = run.start, run.length, run.start + run.length * run.repeats
  return lambda c: not a < c < end or (c - a) % p == 0


def scan_split(capture: Capture, num_stages: int, num_params: int, num_vars: int,
               unit: str = "stages"):
  """``(rewrite, None)``: ``chunks.split_scan`` giving each of ``num_stages`` stages (chunks,
  interleaved: ``unit`` names them in messages) its share of the top-level scan that holds the
  most of the model, when a scan holds more than one stage's share (no cut around it balances
  the stages); ``(None, why not)`` when none of those can be split; ``(None, None)`` when no
  scan needs it."""
  heavy = sorted(((share, eqn_id) for eqn_id, (_, _, share) in _opaque_groups(capture).items()
                  if share * num_stages > 1.0), reverse=True)
  eqns = capture.program.closed_jaxpr.jaxpr.eqns
  why = None
  for _, eqn_id in heavy:
    top = [i for i, e in enumerate(eqns) if id(e) == eqn_id]
    if not top:
      why = why or "it is inside a call (a jit, a checkpoint), not at the top of the loss"
      continue
    found = chunks.scan_splitter(capture.program.closed_jaxpr, top[0], num_stages, num_params,
                                 num_vars, unit)
    if not isinstance(found, str):
      return found, None
    why = why or found
  return None, why


def _chunk_starts(capture: Capture, num_stages: int) -> tuple[int, ...] | None:
  """Where chunks 1..S-1 of a split scan begin (their first slice, and the slices of its
  other stacked inputs just before it), when the program has one; else None."""
  first: dict[int, int] = {}
  for leaf in range(len(capture.input_paths)):
    groups = param_parts(capture, leaf, num_stages)
    if len(groups) < 2 or not all(chunks.feeds_scan(capture.program, capture.program.nodes[i])
                                  for (i,), _ in groups):
      continue   # not the layers of a split scan (a matrix sliced for another reason)
    aval = capture.program.closed_jaxpr.jaxpr.invars[leaf].aval
    for (i,), _ in groups:
      c = chunks.chunk_of(capture.program.nodes[i], tuple(aval.shape), num_stages)
      first[c] = min(first.get(c, i), i)
  if sorted(first) != list(range(num_stages)):
    return None
  nodes = capture.program.nodes
  out = []
  for c in range(1, num_stages):
    at = first[c]
    while at > 0 and nodes[at - 1].primitive == "slice" and not nodes[at - 1].enclosing:
      at -= 1
    out.append(at)
  return tuple(out)


def _opaque_groups(capture: Capture) -> dict[int, tuple[str, str, float]]:
  """Outermost loop, branch or custom-derivative call -> (primitive, path, share): the larger
  of its shares of the model's estimated FLOPs and parameter bytes."""
  flops = [node_flops(n) for n in capture.program.nodes]
  first_bytes = _first_use_bytes(capture, 1)
  total_flops, total_bytes = sum(flops), sum(first_bytes)
  groups: dict[int, list] = {}
  for n in capture.program.nodes:
    ids = _opaque(n)
    if not ids:
      continue
    name = next(p for p in n.enclosing if p not in _TRANSPARENT)
    g = groups.setdefault(ids[0], [name, "/".join(n.module_frames[:2]), 0.0, 0.0])
    g[2] += flops[n.index]
    g[3] += first_bytes[n.index]
  return {i: (name, path, max(f / total_flops if total_flops else 0.0,
                              b / total_bytes if total_bytes else 0.0))
          for i, (name, path, f, b) in groups.items()}


def _warn_opaque_giants(capture: Capture, num_stages: int, not_split: str | None, unit: str,
                        limit: float = 1.5) -> None:
  """Warns (``StageBalanceWarning``) when one loop, branch or custom-derivative call the cut
  cannot enter holds more than ``limit`` stages' shares of the FLOPs or parameter bytes (a
  scan ``scan_split`` could not split)."""
  for name, path, share in _opaque_groups(capture).values():
    if share * num_stages > limit:
      warnings.warn(
          f"auto.auto_parallel cannot balance {num_stages} {unit}: one `{name}` (at "
          f"{path or 'the top level'}) holds {share:.0%} of the model's estimated FLOPs or "
          "parameter bytes, and the automatic cut does not enter loops, branches or "
          "custom-derivative calls. A top-level scan over stacked layers (`nn.scan`) is split "
          "into one scan per stage (per chunk with pipeline.num_virtual_stages) when its "
          "length divides by their number"
          + (f"; the largest was not split: {not_split}" if not_split else "")
          + ". Otherwise write the layers as a Python loop, or cut the stages with "
          "`epl.replicate(..., name=...)` scopes.",
          StageBalanceWarning, stacklevel=4)


def _first_use_bytes(capture: Capture, num_stages: int) -> list[float]:
  """Per node: the bytes of the parameters (or stage chunks of stacked ones) first used there."""
  out = [0.0] * len(capture.program.nodes)
  for leaf in range(len(capture.input_paths)):
    for uses, held in param_parts(capture, leaf, num_stages):
      out[min(uses)] += held
  return out


def param_parts(capture: Capture, leaf: int, num_stages: int) -> list[tuple[list[int], float]]:
  """The uses of parameter ``leaf`` in groups that must share a stage, with their bytes: one
  group, or, for a leaf read only through stage chunks of its rows (``chunks.py``), one per
  chunk (a stage holds only its chunk)."""
  uses = sorted({n.index for n, _ in capture.program.uses_of_input(leaf)})
  if not uses:
    return []
  aval = capture.program.closed_jaxpr.jaxpr.invars[leaf].aval
  nodes = capture.program.nodes
  found = [chunks.chunk_of(nodes[i], tuple(aval.shape), num_stages) for i in uses]
  if num_stages > 1 and all(c is not None for c in found) and len(set(found)) == len(found):
    return [([i], nbytes(aval) / num_stages) for i in uses]
  return [(uses, float(nbytes(aval)))]


def node_flops(node: Node) -> float:
  """Estimated FLOPs of one equation, as often as it runs (inside scans: per iteration)."""
  eqn = node.eqn
  out = sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
  if node.primitive == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return node.trips * 2.0 * out * math.prod(lhs[d] for d in lc)
  if node.primitive == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    return node.trips * 2.0 * out * math.prod(rhs) / max(rhs)
  return float(node.trips * out)


def _legal_cuts(capture: Capture, flops: Sequence[float], share: float,
                num_stages: int) -> list[int]:
  nodes = capture.program.nodes
  blocked = [False] * (len(nodes) + 1)
  blocked[0] = blocked[len(nodes)] = True
  # Inside a loop, branch or custom-derivative call.
  for i in range(1, len(nodes)):
    before, after = _opaque(nodes[i - 1]), _opaque(nodes[i])
    if set(before) & set(after):
      blocked[i] = True
  # Between two uses of one parameter (or chunk), unless they are more than a stage's share
  # apart (tied); and right after a chunk's slice (it goes with the scan it feeds).
  for leaf in range(len(capture.input_paths)):
    groups = param_parts(capture, leaf, num_stages)
    for uses, _ in groups:
      if len(groups) > 1:
        blocked[uses[0] + 1] = True
      if flops[uses[-1]] - flops[uses[0] + 1] > share:
        continue
      for i in range(uses[0] + 1, uses[-1] + 1):
        blocked[i] = True
  return [i for i in range(len(nodes) + 1) if not blocked[i]]


def _opaque(node: Node) -> tuple[int, ...]:
  return tuple(i for name, i in zip(node.enclosing, node.enclosing_ids)
               if name not in _TRANSPARENT)


def check_auto(capture: Capture, num_stages: int | None) -> None:
  """``auto.auto_parallel`` with ``pipeline.num_stages`` cuts a model the user did not cut:
  refuse a model with task graphs. (Without ``pipeline.num_stages`` it searches the whole
  plan instead: ``epljax.search``.)"""
  if len(capture.taskgraphs) > 1:
    names = [t.name for t in capture.taskgraphs]
    raise PlanError(f"auto.auto_parallel cuts a model into stages by itself, but this model "
                    f"already has task graphs {names}. Remove the scopes (or the in-model "
                    "set_default_strategy calls), or turn auto.auto_parallel off.")


_TOO_FEW = """\
auto.auto_parallel could not cut the model into {stages} stages: there are only {legal} places
where no loop, branch or custom-derivative call and no parameter would straddle two stages.
Use fewer stages (pipeline.num_stages), or cut the model yourself with
`with epl.replicate(1, name="stage_0"):` scopes."""


def stage_balance(capture: Capture, stage_of: Sequence[int], num_stages: int
                  ) -> tuple[list[float], list[int]]:
  """Estimated FLOPs and parameter bytes per stage (a tied parameter counts in each stage
  using it, a stacked one read in stage chunks its chunk in each), from the capture's nodes
  and ``stage_of`` (task graph -> stage)."""
  flops = [0.0] * num_stages
  params = [0] * num_stages
  for n in capture.program.nodes:
    tg = capture.node_taskgraph[n.index]
    if tg >= 0:
      flops[stage_of[tg]] += node_flops(n)
  for leaf in range(len(capture.input_paths)):
    for uses, held in param_parts(capture, leaf, num_stages):
      holders = {stage_of[capture.node_taskgraph[i]] for i in uses
                 if capture.node_taskgraph[i] >= 0}
      for s in holders:
        params[s] += int(held)
  return flops, params


class StageBalanceWarning(UserWarning):
  """A stage plan with a stage that has no work, or far more than the others."""


def check_balance(capture: Capture, stage_of: Sequence[int], num_stages: int,
                  names: Sequence[str], limit: float = 1.5) -> list[str]:
  """Warns (``StageBalanceWarning``) when a stage has no work or more than ``limit`` x the mean
  FLOPs; returns the plan lines of the balance."""
  flops, params = stage_balance(capture, stage_of, num_stages)
  mean = sum(flops) / num_stages
  rows = [f"{names[s]} {flops[s]:.3g} FLOPs ({flops[s] / mean if mean else 0:.2f}x mean), "
          f"{params[s]} B of parameters" for s in range(num_stages)]
  idle = [names[s] for s in range(num_stages) if flops[s] == 0]
  heavy = [names[s] for s in range(num_stages) if mean and flops[s] > limit * mean]
  if idle or heavy:
    what = (f"stage(s) {idle} have no work" if idle else
            f"stage(s) {heavy} have more than {limit}x the mean FLOPs")
    warnings.warn(
        f"Unbalanced pipeline: {what}; the step runs at the pace of the slowest stage. "
        f"Estimated per micro batch: {'; '.join(rows)}. Move the stage boundaries (the "
        "`epl.replicate(..., name=...)` scopes or set_default_strategy calls), or let "
        "auto.auto_parallel cut the model.", StageBalanceWarning, stacklevel=4)
  return rows
