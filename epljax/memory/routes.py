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

Only parameters used once (views aside: casts, a transpose), at the top level of the forward
pass, are routed; ``SHARDED`` only where the weight is read through casts alone.
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
  # Program key -> (parameter, read through casts alone), for parameters and their views.
  origin = {k: (r, True) for k, r in refs.items() if not r.sliced}
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
      _, ref, casts = read[0]   # a view: a kernel stored (out, in) and transposed, a cast
      origin[step.outputs[0]] = (ref, casts and step.primitive == "convert_element_type")
      continue
    for j, ref, casts in read:
      uses.setdefault(ref.index, []).append((step, j, ref, casts))
  groups = dict(mesh.shape).get(REPLICA, 1)
  size = mesh.shape[DATA]
  routes = {}
  for index, found in uses.items():
    if len(found) != 1:
      continue
    step, j, ref, casts = found[0]
    dim = split_dim(ref)
    if dim is None:
      continue
    # A weight left sharded is used in its stored dimensions: read through casts alone.
    if step.primitive == "dot_general" and len(step.inputs) == 2:
      route = _matmul_route(step, j, dim if casts else None, groups, low, last=step is last)
    elif step.primitive == "gather" and j == 0 and casts:
      route = _lookup_route(step, dim, size, groups)
    else:
      route = GATHER
    if route != GATHER:
      routes[index] = route
  return routes


def _nbytes(aval, dtype=None) -> int:
  return math.prod(aval.shape) * (dtype or aval.dtype).itemsize


def _matmul_route(step, j, dim, groups, low, last: bool) -> str:
  """Only the last matmul of the forward pass is routed: its output, split along the
  weight's dimension, goes to the loss alone (an earlier one's would be resharded for the
  next layer, and its gathered weight held across the rest of the forward pass)."""
  if not last:
    return GATHER
  _, _, free = D.dot_dims(step.eqn)
  if dim is not None and dim in free[j] and (_nbytes(step.in_aval(1 - j), low) / groups
                         < _nbytes(step.in_aval(j), low)):
    return SHARDED
  return KEEP


def _lookup_route(step, dim, size, groups) -> str:
  """A ``gather`` looking up whole rows of the table along ``dim`` (an embedding)."""
  table = step.in_aval(0)
  nums, slices = step.eqn.params["dimension_numbers"], step.eqn.params["slice_sizes"]
  rows_only = tuple(nums.start_index_map) == (dim,) and all(
      s == (1 if d == dim else table.shape[d]) for d, s in enumerate(slices))
  if not rows_only:
    return GATHER
  out = _nbytes(step.eqn.outvars[0].aval) / groups
  ids = _nbytes(step.in_aval(1)) / groups
  return SHARDED if out * (1 + 1 / size) + ids < _nbytes(table) else GATHER
