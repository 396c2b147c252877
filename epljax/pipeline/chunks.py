"""Scanned layers across pipeline stages: one ``lax.scan`` over ``L`` stacked layers becomes
``k`` scans over ``L / k`` layers each, so the automatic cut can give each stage its share.

Large JAX models write their layers as one ``scan`` (``nn.scan``, ``nn.remat_scan``) over
weights stacked along a leading layers axis. The stage cut never enters a loop, so such a model
used to land in one stage. ``split_scan`` rewrites the traced program: the scan at top-level
position ``position`` runs as ``k`` consecutive scans (the carry passed along, the stacked
outputs concatenated), the ``j``-th over rows ``[j L/k, (j+1) L/k)`` of every stacked input,
taken by a static ``slice``. Same arithmetic, in the same order.

The pipeline then keeps such a weight where it is stored: a leaf read only through these
slices, chunk ``j`` by stage ``j`` (a *part*, ``partition.py``), is stored ``P("stage", ...)``
on its layers axis, so each stage device already holds its stage's layers and the step moves
none of them (``builder.py``). Its optimizer state and checkpoint stay one stacked leaf.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax
from jax.extend import core as jcore

from epljax.errors import PipelineWarning, listing, size
from epljax.sharding import dims
from epljax.sharding.program import (Node, Program, Step, bind, evaluate, in_context, nbytes,
                                     scan_counts, steps_of, top_level)


def scan_splitter(closed: jcore.ClosedJaxpr, position: int, parts: int, num_params: int,
                  num_vars: int | None = None, unit: str = "stages"
                  ) -> Callable[[jcore.ClosedJaxpr], jcore.ClosedJaxpr] | str:
  """The rewrite splitting top-level equation ``position`` into ``parts`` scans, or why not
  (a sentence for the warning; ``unit`` names the parts there). Program inputs
  ``[num_params, num_vars)`` are model state."""
  eqn = closed.jaxpr.eqns[position]
  if eqn.primitive.name != "scan":
    return f"it is a `{eqn.primitive.name}`, not a scan"
  length = eqn.params["length"]
  if eqn.params["reverse"]:
    return "it runs in reverse"
  if length % parts:
    return f"its {length} iterations do not divide into {parts} {unit}"
  invars = closed.jaxpr.invars
  operands = [v for v in eqn.invars if isinstance(v, jcore.Var)]
  state = set(invars[num_params:num_vars if num_vars is not None else num_params])
  if any(v in state for v in operands):
    return ("it reads model state (BatchNorm statistics), which one stage must keep whole "
            "between micro batches")
  params = set(invars[:num_params])
  stacked = [v for v in eqn.invars[sum(scan_counts(eqn)):] if isinstance(v, jcore.Var)]
  if not any(v in params for v in stacked):
    return "no parameter is stacked along its iterations"
  return functools.partial(split_scan, position=position, parts=parts, length=length,
                           operands=len(eqn.invars))


def split_scan(closed: jcore.ClosedJaxpr, *, position: int, parts: int,
               length: int | None = None, operands: int | None = None) -> jcore.ClosedJaxpr:
  """``closed`` with its top-level scan at ``position`` run as ``parts`` scans (module doc);
  ``length`` / ``operands``: what ``scan_splitter`` saw there, checked again (every trace of
  the loss must have the same scan at the same place)."""
  jaxpr = closed.jaxpr
  eqn = jaxpr.eqns[position] if position < len(jaxpr.eqns) else None
  if (eqn is None or eqn.primitive.name != "scan" or eqn.params["reverse"]
      or eqn.params["length"] % parts
      or (length is not None and eqn.params["length"] != length)
      or (operands is not None and len(eqn.invars) != operands)):   # internal invariant
    raise AssertionError(f"equation {position} is no longer the scan to split "
                         f"({eqn.primitive.name if eqn else 'no equation'})")

  program = steps_of(closed, enter=top_level)

  def rule(step: Step, values: list[Any]) -> list[Any]:
    return _in_parts(step, values, parts) if step.index == position else bind(step, values)

  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
  return jax.make_jaxpr(lambda *args: evaluate(program, args, rule))(*avals)


def _in_parts(step: Step, values: Sequence[Any], parts: int) -> list[Any]:
  eqn = step.eqn
  n_consts, n_carry = scan_counts(eqn)
  consts, carry = values[:n_consts], values[n_consts:n_consts + n_carry]
  xs = values[n_consts + n_carry:]
  length = eqn.params["length"] // parts
  stacked_outs = []
  for j in range(parts):
    chunk = in_context(step, lambda j=j: [lax.slice_in_dim(x, j * length, (j + 1) * length)
                                          for x in xs])
    outs = bind(step, [*consts, *carry, *chunk], length=length)
    carry, ys = outs[:n_carry], outs[n_carry:]
    stacked_outs.append(ys)
  return [*carry, *(lax.concatenate(list(ys), 0) for ys in zip(*stacked_outs))]


def chunk_of(node: Node, shape: tuple[int, ...], parts: int) -> int | None:
  """Which of ``parts`` equal row chunks a top-level ``slice`` of a leaf of ``shape`` takes,
  or None when it is not one (inside a loop or call, another dimension sliced, strides, a
  range off the chunk grid)."""
  if (node.enclosing or node.primitive != "slice" or not shape or shape[0] % parts
      or not dims.rows_only(node.eqn)):
    return None
  start, limit = node.eqn.params["start_indices"], node.eqn.params["limit_indices"]
  rows = shape[0] // parts
  if start[0] % rows or limit[0] - start[0] != rows:
    return None
  return start[0] // rows


def feeds_scan(program: Program, node: Node) -> bool:
  """Whether the value of top-level ``node`` (a chunk's slice) is read inside a scan: layers
  of a scan split per stage, not a matrix sliced for another reason."""
  return any("scan" in r.enclosing for r in program.node_consumers(node))


def warn_whole_stacks(found: Sequence[tuple[str, Any, bool, str]], num_chunks: int) -> None:
  """Warns about scanned layers' stacked parameters the pipeline cannot store one chunk per
  stage: (path, aval, whether it is also read whole, why) each; the first one's reason and
  advice are given."""
  total = sum(nbytes(a) for _, a, _, _ in found)
  path, aval, read_whole, why = found[0]
  which = (f"{len(found)} stacked parameters ({listing([p for p, _, _, _ in found])}) are"
           if len(found) > 1 else f"Stacked parameter '{path}' (shape {tuple(aval.shape)}) is")
  reason = (f"The first, '{path}' (shape {tuple(aval.shape)}): {why}." if len(found) > 1 else
            f"{why[0].upper()}{why[1:]}.")
  advice = _WHOLE_READ if read_whole else _MISPLACED
  one = len(found) == 1
  warnings.warn(_WHOLE_STACK.format(
      which=which, k=num_chunks, it="it" if one else "them", it_is="it is" if one else "they are",
      whole=size(total), chunk=size(total / num_chunks), reason=reason, advice=advice),
      PipelineWarning, stacklevel=5)


_WHOLE_STACK = """\
{which} read in {k} row chunks by the pipeline's stages, one
chunk each, like the layers of an nn.scan, but not only that way, so {it_is} not stored split
over the stages: a stage that reads {it} holds {it} whole ({whole} in all, where one chunk is
{chunk}), and chunks sliced there for another stage travel with every micro batch. Training
is still exact. {reason}
{advice}"""

_WHOLE_READ = """\
To store one chunk per stage, read stacked weights only inside the scanned layers: nothing
outside the nn.scan (a regularizer over all parameters, one layer's weights) may read them."""

_MISPLACED = """\
The stage boundaries do not fall between the scan's chunks: let auto.auto_parallel place
them, or move them there."""
