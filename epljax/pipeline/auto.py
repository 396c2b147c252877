"""``auto.auto_parallel`` with ``pipeline.num_stages``: cut a model without stage annotations
into stages of about equal compute (EPL's experimental automatic pipeline partitioning).

The traced program's equations, in trace order, are cut at ``num_stages - 1`` places. A place
between two equations is a *legal* cut when

- no loop, branch or custom-derivative call (``scan``, ``while``, ``cond``, ``remat``,
  ``custom_jvp_call``...) has equations on both sides (``jit`` calls are inlined, so cutting
  through them is fine), and
- no parameter is used on both sides (a stage owns its parameters).

Among the legal places, each cut goes where the running sum of estimated FLOPs (matmuls
``2 x output x contracted``, everything else one per output element) is closest to an equal
share. Trace order is a topological order, so activations only ever flow to later stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from epljax.errors import PlanError
from epljax.sharding.capture import Capture
from epljax.sharding.program import Node

# Call-like primitives the stage cutter inlines: cutting through them is fine.
_TRANSPARENT = ("jit", "pjit", "closed_call", "core_call")


def auto_stage_cuts(capture: Capture, num_stages: int) -> tuple[int, ...]:
  """Node indices where stages 1..S-1 start (see the module doc)."""
  nodes = capture.program.nodes
  if num_stages > len(nodes):
    raise PlanError(f"pipeline.num_stages={num_stages} with auto.auto_parallel, but the traced "
                    f"loss has only {len(nodes)} equations to divide.")
  cost = [node_flops(n) for n in nodes]
  prefix = [0.0]
  for c in cost:
    prefix.append(prefix[-1] + c)
  legal = _legal_cuts(capture)
  total, cuts, start = prefix[-1], [], 0
  for k in range(1, num_stages):
    left = num_stages - 1 - k   # cuts still to place after this one
    options = [c for c in legal if c > start]
    options = options[:len(options) - left] if left else options
    if not options:
      raise PlanError(_TOO_FEW.format(stages=num_stages, legal=len(legal)))
    start = min(options, key=lambda c: abs(prefix[c] - total * k / num_stages))
    cuts.append(start)
  return tuple(cuts)


def node_flops(node: Node) -> float:
  """Estimated FLOPs of one equation."""
  eqn = node.eqn
  out = sum(math.prod(getattr(v.aval, "shape", ())) for v in eqn.outvars)
  if node.primitive == "dot_general":
    (lc, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2.0 * out * math.prod(lhs[d] for d in lc)
  if node.primitive == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    return 2.0 * out * math.prod(rhs) / max(rhs)
  return float(out)


def _legal_cuts(capture: Capture) -> list[int]:
  nodes = capture.program.nodes
  blocked = [False] * (len(nodes) + 1)
  blocked[0] = blocked[len(nodes)] = True
  # Inside a loop, branch or custom-derivative call.
  for i in range(1, len(nodes)):
    before, after = _opaque(nodes[i - 1]), _opaque(nodes[i])
    if set(before) & set(after):
      blocked[i] = True
  # Between two uses of one parameter.
  for leaf in range(len(capture.input_paths)):
    uses = sorted({n.index for n, _ in capture.program.uses_of_input(leaf)})
    for i in range(uses[0] + 1, uses[-1] + 1) if uses else ():
      blocked[i] = True
  return [i for i in range(len(nodes) + 1) if not blocked[i]]


def _opaque(node: Node) -> tuple[int, ...]:
  return tuple(i for name, i in zip(node.enclosing, node.enclosing_ids)
               if name not in _TRANSPARENT)


def check_auto(capture: Capture, num_stages: int | None) -> None:
  """``auto.auto_parallel`` cuts a model the user did not cut: refuse the other cases."""
  if num_stages is None:
    raise PlanError("auto.auto_parallel=True needs pipeline.num_stages: epljax's automatic "
                    "parallelism is EPL's automatic pipeline partitioning. Set, for example, "
                    "{'auto.auto_parallel': True, 'pipeline.num_stages': 4}.")
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


def stage_names(num_stages: int) -> Sequence[str]:
  return [f"stage_{i}" for i in range(num_stages)]
