"""Which bytes a ZeRO v3 parameter's use moves, chosen per use from the shapes (``choose``).

By default (``GATHER``) a use all-gathers the weight (in the compute dtype), and a matmul
gathers it again for its backward pass and reduce-scatters its gradient (``uses.py``). Two uses
of a language model's vocabulary-sized weights can do with fewer bytes:

- The last matmul of the forward pass (an LM head: the loss follows, then its backward). Its
  gathered weight is kept for its backward (``KEEP``: nothing else is gathered between the
  two, so the copy costs no more memory than the backward's own gather would), or, when the
  weight is split along a dimension the matmul does not contract (the vocabulary) and the
  other operand is smaller than the weight, the weight stays sharded (``SHARDED``): the output
  is split along that dimension for the loss, the other operand's rows are all-gathered, its
  gradient reduce-scattered, and the weight's gradient comes out split with no reduction.
- A lookup of whole rows along the split dimension (an embedding): left to GSPMD with the
  table sharded (``SHARDED``; the ids are all-gathered, each device looks up its rows, the
  output is reduce-scattered and its cotangent all-gathered) when that moves fewer bytes.

Bytes per use per device, with ``W`` and ``X`` the weight's and the other operand's bytes in
the compute dtype (``X``: of the batch rows in one ``data`` group), ``N`` the devices of
``data``, ``O`` and ``I`` the lookup's output and ids:

- last matmul: ``KEEP`` ``W + W / N``; ``SHARDED`` ``X + X / N``, chosen when ``X < W``;
- lookup: ``GATHER`` ``W``; ``SHARDED`` ``O + O / N + I``, chosen when smaller;
- any other use of a weight: ``GATHER``, ``2 W + W / N`` for a matmul (``W + W / N`` inside a
  rematerialized layer, whose recomputed gather serves the backward: ``uses.py``).

A weight used several times (a tied embedding: the table looked up, then read transposed by
the LM head) stays ``SHARDED`` when every use alone would leave it sharded and their bytes
together are fewer than one gather kept for every use and its gradient's reduce-scatter,
``W + W / N``; else each use gathers it.

Only parameters at the top level of the forward pass are routed; ``SHARDED`` only where the
weight is read through casts and transposes (``view_dim`` follows its split dimension), a
lookup's table through casts alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from jax.extend import core as jcore

from epljax.memory.amp import LOW, SHAPE_ONLY
from epljax.mesh import DATA, REPLICA
from epljax.sharding import dims as D
from epljax.sharding.program import REMAT

GATHER, SHARDED, KEEP = "gather", "sharded", "keep"


def choose(program, refs: Mapping, split_dim, mesh, low=None) -> dict[int, str]:
  """Route per parameter leaf index (``GATHER`` when absent) for the top-level ``program``
  whose inputs ``refs`` maps to parameters; ``split_dim(ref)``: the dimension ZeRO splits over
  ``data`` (None: not split); ``low``: the compute dtype of matmuls (None: as traced)."""
  # Program key -> (parameter, the shape-only steps from it: casts, a transpose ...).
  origin = {k: (r, ()) for k, r in refs.items() if not r.sliced}
  uses: dict[int, list] = {}
  last = None
  for step in program.steps:
    read = [(j, *origin[k]) for j, k in enumerate(step.inputs)
            if not isinstance(k, jcore.Literal) and k in origin]
    if not read:
      continue
    if step.primitive in LOW or step.primitive in ("gather", "scan") or step.primitive in REMAT:
      last = step    # (a bias or a norm scale read after it gathers next to nothing)
    if step.primitive in SHAPE_ONLY and len(read) == 1 and len(step.outputs) == 1:
      _, ref, steps = read[0]   # a view: a kernel stored (out, in) and transposed, a cast
      origin[step.outputs[0]] = (ref, (*steps, step))
      continue
    for j, ref, steps in read:
      uses.setdefault(ref.index, []).append((step, j, ref, steps))
  groups = dict(mesh.shape).get(REPLICA, 1)
  size = mesh.shape[DATA]
  routes = {}
  for index, found in uses.items():
    dim = split_dim(found[0][2])
    if dim is None:
      continue
    alone = [_use_route(step, j, view_dim(steps, dim), steps, size, groups, low, step is last)
             for step, j, _, steps in found]
    route = alone[0][0]
    if len(alone) > 1:   # one gather kept for every use against each use's own bytes
      weight = min(_weight_bytes(step, j, low) for step, j, _, _ in found)
      route = SHARDED if all(r == SHARDED for r, _ in alone) and sum(
          b for _, b in alone) < weight * (1 + 1 / size) else GATHER
    if route != GATHER:
      routes[index] = route
  return routes


def view_dim(steps, dim: int | None) -> int | None:
  """Where dimension ``dim`` of a parameter sits after shape-only ``steps`` (casts and
  transposes; None through any other step, or for ``dim`` None)."""
  for step in steps:
    if dim is None or step.primitive == "convert_element_type":
      continue
    dim = (tuple(step.eqn.params["permutation"]).index(dim) if step.primitive == "transpose"
           else None)
  return dim


def _nbytes(aval, dtype=None) -> int:
  return math.prod(aval.shape) * (dtype or aval.dtype).itemsize


def _weight_bytes(step, j, low) -> int:
  """The weight's bytes where ``step`` reads it: in the compute dtype of a matmul."""
  return _nbytes(step.in_aval(j), low if step.primitive == "dot_general" else None)


def _use_route(step, j, dim, steps, size, groups, low, last: bool) -> tuple[str, float]:
  """A use's route were it the weight's only use, and the bytes ``SHARDED`` moves there
  (``dim``: the weight's split dimension as the use reads it)."""
  if step.primitive == "dot_general" and len(step.inputs) == 2:
    return _matmul_route(step, j, dim, size, groups, low, last)
  casts = all(s.primitive == "convert_element_type" for s in steps)
  if step.primitive == "gather" and j == 0 and casts:
    return _lookup_route(step, dim, size, groups)
  return GATHER, math.inf


def _matmul_route(step, j, dim, size, groups, low, last: bool) -> tuple[str, float]:
  """Only the last matmul of the forward pass is routed: its output, split along the
  weight's dimension, goes to the loss alone (an earlier one's would be resharded for the
  next layer, and its gathered weight held across the rest of the forward pass)."""
  if not last:
    return GATHER, math.inf
  _, _, free = D.dot_dims(step.eqn)
  other = _nbytes(step.in_aval(1 - j), low) / groups
  if dim is not None and dim in free[j] and other < _nbytes(step.in_aval(j), low):
    return SHARDED, other * (1 + 1 / size)
  return KEEP, math.inf


def _lookup_route(step, dim, size, groups) -> tuple[str, float]:
  """A ``gather`` looking up whole rows of the table along ``dim`` (an embedding)."""
  table = step.in_aval(0)
  nums, slices = step.eqn.params["dimension_numbers"], step.eqn.params["slice_sizes"]
  rows_only = tuple(nums.start_index_map) == (dim,) and all(
      s == (1 if d == dim else table.shape[d]) for d, s in enumerate(slices))
  if not rows_only:
    return GATHER, math.inf
  out = _nbytes(step.eqn.outvars[0].aval) / groups
  moved = out * (1 + 1 / size) + _nbytes(step.in_aval(1)) / groups
  return (SHARDED, moved) if moved < _nbytes(table) else (GATHER, math.inf)
