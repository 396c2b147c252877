"""Split rules: which dimension of each parameter a ``split`` task graph cuts, read from the
data flow of the traced program (never from names or dimension positions).

One pass over the program in trace order tracks, for every value, which of its dimensions is
split over the ``model`` axis (a *split activation dimension*), and decides each candidate
parameter at its first decisive use:

- ``dot_general`` with a parameter operand (a weight):
  - a weight dimension used as a batch dimension -> split on it (**experts**: the leading
    experts dimension of an MoE weight, einsum ``egcd,edf->egcf``);
  - the activation already split on a contracting dimension -> split the weight on the matching
    contracting dimension (**row**, Megatron's second matmul: partial sums, one all-reduce);
  - else a dimension that flows to the output (**column**). With several (fused einsum kernels:
    q ``(heads, d, head_dim)``, kv ``(2, kv_heads, d, head_dim)``, gated MLP ``(2, d, hidden)``)
    each is followed forward through the program as a split activation dimension; the one
    whose every path ends contracted against another weight (the row split that closes the
    pair), never sliced, reduced, merged as a minor factor or contracted between two
    activations on the way, is the split: the heads (through the attention scores and the
    grouped-query reshapes, to the output projection), the MLP's hidden dimension (through the
    gate, to the down projection), never the k/v or gate/up stacking dimension, never
    head_dim. None or several such dimensions is an error naming the parameter.
- ``gather`` reading a parameter (an embedding lookup) -> split on the looked-up dimension
  (**vocabulary**); a tied embedding's later logits matmul keeps that split (vocab-parallel
  logits).
- An elementwise use next to a split activation (a bias add, a norm's scale) -> split the
  parameter along with it (**follows** the weight that split the activation).

A decided weight used again against an activation split on a different dimension is an error
(the two uses disagree). A parameter with no decisive use stays replicated. A decided
dimension that does not divide by the device count is an error naming the parameter, its
shape and the count.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Mapping, Sequence

from epljax.errors import PlanError
from epljax.sharding import dims as D
from epljax.sharding.program import Node, Program

COLUMN, ROW, EXPERTS, VOCAB, FOLLOWS = "column", "row", "experts", "vocabulary", "follows"
_LOOKAHEAD = 4000   # equations followed per candidate dimension before giving up on it
_MIXED = "it is mixed into an unsplit activation"
_MASK_DEPTH = 8     # elementwise operations followed back to tell a mask from a residual stream


@dataclasses.dataclass
class _Fate:
  """What following one candidate split dimension found."""
  good: int = 0                  # paths that end contracted against a weight
  parts: int = 1                 # equal parts the split dimension is cut into (fused q/k/v: 3)
  bad: list[str] = dataclasses.field(default_factory=list)   # places that need communication
  whole: int = 0                 # activation products holding their other operand whole


@dataclasses.dataclass(frozen=True)
class Decision:
  """Parameter leaf ``leaf`` is split on ``dim`` because of ``rule``; with ``parts`` > 1 the
  dimension is a fusion of that many equal parts (fused q/k/v: 3), each split on its own, so
  device d holds the d-th shard of every part (``fused.py``)."""
  leaf: int
  dim: int
  rule: str
  parts: int = 1


def split_decisions(program: Program, candidates: Iterable[int], leaf_shapes: Sequence[tuple],
                    leaf_paths: Sequence[str], device_count: int,
                    fixed: Mapping[int, int] | None = None
                    ) -> tuple[dict[int, Decision], dict[int, str]]:
  """Decides the split dimension of each candidate variable leaf (program input index), and
  says why a candidate a rule keeps whole stays so (leaf -> reason, for the plan).

  ``fixed`` gives leaves whose split dimension the user already chose (their activations
  propagate like decided ones: a user-split first matmul makes the next one a row split).
  """
  state = _analysed(program, leaf_shapes, leaf_paths, device_count, candidates, fixed)
  state.decisions = {i: d for i, d in state.decisions.items() if i not in (fixed or {})}
  for d in state.decisions.values():
    size = leaf_shapes[d.leaf][d.dim]
    if size % device_count:
      raise PlanError(
          f"Parameter '{leaf_paths[d.leaf]}' (shape {tuple(leaf_shapes[d.leaf])}) is split "
          f"({d.rule}) on dimension {d.dim} of size {size}, which does not divide into "
          f"{device_count} devices. Use a device count that divides {size}, change the "
          "layer's size, or give the parameter an explicit PartitionSpec with epl.annotate.")
  return state.decisions, {i: why for i, why in state.kept.items() if i not in state.decisions}


def operand_splits(program: Program, split: Mapping[int, int], leaf_shapes: Sequence[tuple],
                   leaf_paths: Sequence[str], device_count: int) -> _State:
  """The rules' view of ``program`` when every split is given (``split``: leaf -> dim):
  ``view(node, pos)`` and ``split_dim(node, pos)`` of every operand (``reductions.py``)."""
  return _analysed(program, leaf_shapes, leaf_paths, device_count, fixed=split)


def row_dims(program: Program, rows_inputs: Iterable[int] | Mapping[int, int],
             leaf_shapes: Sequence[tuple], leaf_paths: Sequence[str]) -> _State:
  """Where each value's *rows* are: the inputs ``rows_inputs`` hold them on dim 0 (or on the
  dim a mapping gives), and they are followed through the program like a split dimension
  (``split_dim(node, pos)``), also from a gather's indices to its output (``reductions.py``,
  ``pipeline/stats.py``)."""
  rows = rows_inputs if isinstance(rows_inputs, Mapping) else dict.fromkeys(rows_inputs, 0)
  return _analysed(program, leaf_shapes, leaf_paths, 1, rows=rows)


def _analysed(program: Program, leaf_shapes: Sequence[tuple], leaf_paths: Sequence[str],
              device_count: int, candidates: Iterable[int] = (),
              fixed: Mapping[int, int] | None = None,
              rows: Mapping[int, int] | None = None) -> _State:
  """One pass of the rules over ``program`` in trace order: ``candidates`` decided at their
  first decisive use, ``fixed`` leaves split as given, and (``rows``: input -> dim) the batch's
  rows followed from the inputs, also from a gather's indices to its output."""
  fixed = dict(fixed or {})
  state = _State(program, set(candidates) - set(fixed), leaf_shapes, leaf_paths, device_count)
  state.decisions = {i: Decision(i, d, "user") for i, d in fixed.items()}
  state.follow_indices = rows is not None
  for i, dim in (rows or {}).items():
    state.split[program.invars[i]] = dim
  for node in program.nodes:
    state.visit(node)
  return state


def gather_index_dims(eqn) -> dict[int, int]:
  """A gather's indices dims -> the output dims they index (every output dim that is not a
  slice dim comes from one indices dim, in order; the index vector dim is the last)."""
  dnums = eqn.params["dimension_numbers"]
  out_rank, idx_rank = len(D.shape(eqn.outvars[0])), len(D.shape(eqn.invars[1]))
  outs = [d for d in range(out_rank) if d not in tuple(dnums.offset_dims)]
  return dict(zip(range(idx_rank - 1), outs))


def gather_offset_dim(eqn, dim: int) -> int | None:
  """The output dim of a gather's operand ``dim`` when it is taken whole (an offset dim that is
  not indexed), else None."""
  dnums = eqn.params["dimension_numbers"]
  skipped = set(dnums.collapsed_slice_dims) | set(getattr(dnums, "operand_batching_dims", ()))
  if dim in skipped or dim in dnums.start_index_map or (
      eqn.params["slice_sizes"][dim] != D.shape(eqn.invars[0])[dim]):
    return None
  kept = [d for d in range(len(D.shape(eqn.invars[0]))) if d not in skipped]
  return tuple(dnums.offset_dims)[kept.index(dim)]


class _State:

  def __init__(self, program: Program, candidates: set[int], leaf_shapes: Sequence[tuple],
               leaf_paths: Sequence[str], device_count: int):
    self.program = program
    self.decisions: dict[int, Decision] = {}
    self.kept: dict[int, str] = {}                 # leaf -> why it stays whole in a split
    self.split: dict[object, int] = {}             # value -> split dim
    self.parts: dict[object, int] = {}             # value -> fused parts of its split dim
    self.follow_indices = False                    # a gather's output follows its indices
    self.views: dict[object, D.View] = {}          # value -> parameter view
    self.candidates = candidates
    self.leaf_shapes = leaf_shapes
    self.leaf_paths = leaf_paths
    self.device_count = device_count
    self.data = D.data_values(program, len(leaf_shapes))
    for i, var in enumerate(program.invars[:len(leaf_shapes)]):
      self.views[var] = D.View(i, tuple(range(len(leaf_shapes[i]))))

  # -- reading operands -----------------------------------------------------------------
  def view(self, node: Node, pos: int) -> D.View | None:
    for b in node.inputs[pos]:
      v = self.views.get(b)
      if v is not None:
        return D.align(v, D.shape(node.eqn.invars[pos]), self.leaf_shapes[v.leaf])
    return None

  def split_dim(self, node: Node, pos: int) -> int | None:
    """The split dim of operand ``pos`` (a decided parameter view counts as split)."""
    for b in node.inputs[pos]:
      if b in self.split:
        return self.split[b]
    v = self.view(node, pos)
    if v is not None and v.leaf in self.decisions:
      dim = self.decisions[v.leaf].dim
      return v.dims.index(dim) if dim in v.dims else None
    return None

  def decide(self, v: D.View, view_dim: int, rule: str, parts: int = 1) -> None:
    if v.leaf in self.decisions or v.leaf not in self.candidates:
      return
    param_dim = v.dims[view_dim]
    if param_dim is not None:
      self.decisions[v.leaf] = Decision(v.leaf, param_dim, rule, parts)

  def set_out(self, node: Node, dim: int | None, idx: int = 0, parts: int = 1) -> None:
    if dim is not None and idx < len(node.eqn.outvars):
      self.split[node.eqn.outvars[idx]] = dim
      if parts > 1:
        self.parts[node.eqn.outvars[idx]] = parts

  def parts_of(self, node: Node, pos: int) -> int:
    """The fused parts of operand ``pos``'s split dim (a fused parameter's own, or its
    activation's): 1 when it is not a fusion."""
    for b in node.inputs[pos]:
      if b in self.split:
        return self.parts.get(b, 1)
    v = self.view(node, pos)
    return self.decisions[v.leaf].parts if v is not None and v.leaf in self.decisions else 1

  def _where(self, leaf: int) -> str:
    return (f"Parameter '{self.leaf_paths[leaf]}' (shape {tuple(self.leaf_shapes[leaf])}) "
            f"of a split({self.device_count}) task graph")

  # -- the rules ----------------------------------------------------------------------------
  def visit(self, node: Node) -> None:
    prim = node.primitive
    eqn = node.eqn
    if prim == "dot_general":
      self._dot(node)
    elif prim == "gather":
      self._gather(node)
    elif prim in D.SHAPE_OPS:
      self._shape_op(node)
    elif prim in ("split", "unstack"):
      dim = self.split_dim(node, 0)
      if dim is not None and dim != eqn.params.get("axis"):
        for idx in range(len(eqn.outvars)):
          self.set_out(node, D.pieces_dim(eqn, dim), idx, self.parts_of(node, 0))
      elif dim is not None and self.parts_of(node, 0) == len(eqn.outvars) > 1:
        for idx in range(len(eqn.outvars)):   # a fusion cut into its parts, each split
          self.set_out(node, dim, idx)
    elif prim == "slice" and self.view(node, 0) is not None and D.rows_only(eqn):
      # Rows of a parameter (a stage's chunk of stacked layers, ``pipeline/chunks.py``): still
      # that parameter, dimension for dimension.
      self.views[eqn.outvars[0]] = self.view(node, 0)
    elif prim in ("slice", "dynamic_slice", "pad", "argmax", "argmin") or prim.startswith(
        "reduce_"):
      dim = self.split_dim(node, 0)
      if dim is not None:
        self.set_out(node, D.passes(eqn, dim))
    elif prim == "concatenate":
      dims = {self.split_dim(node, pos) for pos in range(len(eqn.invars))} - {None}
      if len(dims) == 1:
        self.set_out(node, D.passes(eqn, dims.pop()))
    elif D.is_elementwise(eqn):
      self._elementwise(node)

  def _dot(self, node: Node) -> None:
    eqn = node.eqn
    contract, batch, free = D.dot_dims(eqn)
    views = (self.view(node, 0), self.view(node, 1))
    for side in (0, 1):
      w, other = views[side], 1 - side
      if w is None:
        continue
      act = self.split_dim(node, other)
      if w.leaf in self.decisions:
        self._check_agrees(w, node, side, act, contract)
        continue
      if w.leaf not in self.candidates:
        continue
      if views[other] is not None and views[other].leaf not in self.decisions:
        continue  # two undecided parameters: nothing tells which to split
      if batch[side] and any(w.dims[d] is not None for d in batch[side]):
        d = next(d for d in batch[side] if w.dims[d] is not None)
        self.decide(w, d, EXPERTS)
      elif act is not None and act in contract[other]:
        self.decide(w, contract[side][contract[other].index(act)], ROW)
      else:
        found = self._column(node, side, w, free[side])
        if found is not None:
          self.decide(w, found[0], COLUMN, found[1])
    # Where the output is split: the first split operand dim that survives.
    for side in (0, 1):
      dim = self.split_dim(node, side)
      if dim is not None and dim not in contract[side]:
        self.set_out(node, D.dot_out_dim(eqn, side, dim), parts=self.parts_of(node, side))
        return

  def _check_agrees(self, w: D.View, node: Node, side: int, act: int | None, contract) -> None:
    """A decided weight met again: an activation split on a contracting dimension must meet
    the weight's own split dimension there, or the two uses disagree."""
    decision = self.decisions[w.leaf]
    if act is None or act not in contract[1 - side] or decision.rule == "user":
      return
    wanted = w.dims[contract[side][contract[1 - side].index(act)]]
    if wanted is not None and wanted != decision.dim:
      raise PlanError(
          f"{self._where(w.leaf)} is split on dimension {decision.dim} ({decision.rule}) by "
          f"its first use, but a later use (equation {node.index}, {node.primitive} in "
          f"{'/'.join(node.frames) or 'the top level'}) contracts it against an activation "
          f"split on what is its dimension {wanted}. The uses disagree; give the parameter "
          "an explicit PartitionSpec with epl.annotate({'" + self.leaf_paths[w.leaf]
          + "': P(...)}), or keep the two uses in different task graphs.")

  def _column(self, node: Node, side: int, w: D.View,
              free: tuple[int, ...]) -> tuple[int, int] | None:
    """(the free weight dimension whose split flows to a row-split weight, its fused parts)
    (module doc); a weight with one free dimension is split on it unless its output would be
    mixed into unsplit activations (a stem or head feeding a residual stream stays
    replicated)."""
    dims = [d for d in free if w.dims[d] is not None]
    if not dims:
      return None
    fates = {d: self._follow(node, D.dot_out_dim(node.eqn, side, d)) for d in dims}
    if len(dims) == 1:
      fate = fates[dims[0]]
      mixed = [r for r in fate.bad if r.startswith(_MIXED)]
      if mixed:
        self.kept[w.leaf] = f"kept whole: split on dimension {w.dims[dims[0]]}, {mixed[0]}"
        return None
      return dims[0], 1 if fate.bad else fate.parts   # a fusion only when it splits cleanly
    clean = [d for d, f in fates.items() if f.good and not f.bad]
    # Among clean dimensions, the one that never makes a device hold the other operand of an
    # activation product whole (attention's value kernel: heads, a batch dimension of the
    # probabilities x values product, over head_dim, a free one).
    least = min((fates[d].whole for d in clean), default=0)
    best = [d for d in clean if fates[d].whole == least]
    if len(best) == 1:
      return best[0], fates[best[0]].parts
    shape = self.leaf_shapes[w.leaf]
    lines = "\n".join(
        f"  dimension {w.dims[d]} (size {shape[w.dims[d]]}): "
        + (f"{f.good} path(s) end at a weight (row split)" if f.good else "reaches no weight")
        + (f"; {f.whole} product(s) hold their other operand whole" if f.whole else "")
        + (f"; but {f.bad[0]}" if f.bad else "")
        for d, f in fates.items())
    why = ("several of its dimensions could carry the split"
           if clean else "none of its dimensions carries a split cleanly to another weight")
    raise PlanError(
        f"{self._where(w.leaf)} is used at equation {node.index} ({node.primitive} in "
        f"{'/'.join(node.frames) or 'the top level'}) against an unsplit activation, and "
        f"{why}, followed through the program:\n{lines}\nGive it an explicit PartitionSpec "
        "with epl.annotate({'" + self.leaf_paths[w.leaf] + "': P(...)}) (e.g. 'model' on "
        "the heads or hidden dimension), or leave this module out of the split.")

  def _follow(self, start: Node, dim: int) -> _Fate:
    """Follows the output of ``start`` split on ``dim`` forward, equations in trace order (so
    every operand's hypothetical split is known when its consumer is reached)."""
    fate = _Fate()
    hyp = {start.eqn.outvars[0]: dim}
    queue = [c.index for c, _ in self.program.consumers.get(start.eqn.outvars[0], ())]
    heapq.heapify(queue)
    done = set()
    while queue:
      node = self.program.nodes[heapq.heappop(queue)]
      if node.index in done:
        continue
      done.add(node.index)
      if len(done) > _LOOKAHEAD:
        fate.bad.append(f"it is still split after {_LOOKAHEAD} equations")
        break
      outs = self._carry(node, hyp, fate)
      for out, d in outs:
        hyp[out] = d
        for c, _ in self.program.consumers.get(out, ()):
          heapq.heappush(queue, c.index)
    return fate

  def _carry(self, node: Node, hyp: dict, fate: _Fate) -> list[tuple[object, int]]:
    """One step of ``_follow``: records in ``fate`` what ``node`` does to the hypothetical
    split, and returns the outputs it stays split on."""
    eqn = node.eqn
    split = {pos: d for pos in range(len(eqn.invars))
             for b in node.inputs[pos] if (d := hyp.get(b)) is not None}
    split = {pos: d for pos, d in split.items()
             if d < len(D.shape(eqn.invars[pos])) and D.shape(eqn.invars[pos])[d] != 1}
    if not split:
      return []
    pos, dim = next(iter(split.items()))
    prim = node.primitive
    where = f"equation {node.index} ({prim} in {'/'.join(node.frames) or 'the top level'})"
    if prim == "dot_general":
      contract, batch, _ = D.dot_dims(eqn)
      if len(split) == 2:
        if split[1] not in batch[1] or batch[0][batch[1].index(split[1])] != split[0]:
          fate.bad.append(f"both operands are split, not on one batch dimension, at {where}")
          return []
        return [(eqn.outvars[0], batch[0].index(split[0]))]
      other = self.view(node, 1 - pos) is not None or self._weight_ahead(node, 1 - pos)
      other_split = self.split_dim(node, 1 - pos)
      if dim in contract[pos]:
        if other:
          fate.good += 1
        else:
          fate.bad.append(f"it is contracted between two activations at {where}")
        return []
      matching = batch[1 - pos][batch[pos].index(dim)] if dim in batch[pos] else None
      if other_split is not None and other_split != matching:
        fate.bad.append(f"it meets an operand split on another dimension at {where}")
        return []
      fate.whole += not other and matching is None
      return [(eqn.outvars[0], D.dot_out_dim(eqn, pos, dim))]
    if prim in ("split", "unstack"):
      if dim == eqn.params.get("axis"):
        k = len(eqn.outvars)
        sizes = eqn.params.get("sizes", ())
        if (prim == "split" and k > 1 and fate.parts in (1, k) and len(set(sizes)) == 1
            and sizes[0] % self.device_count == 0):
          fate.parts = k   # a fusion of k equal parts (q/k/v): each part split on its own
          return [(out, dim) for out in eqn.outvars]
        fate.bad.append(f"it is cut into pieces at {where}")
        return []
      return [(out, D.pieces_dim(eqn, dim)) for out in eqn.outvars]
    if prim in ("slice", "dynamic_slice", "pad") and pos > 0:
      return []
    out = D.passes(eqn, dim) if pos == 0 or prim == "concatenate" else False
    if out is None:
      fate.bad.append(f"it does not survive whole through {where}")
      return []
    if out is False:
      in_shape = D.shape(eqn.invars[pos])
      out_shape = D.shape(eqn.outvars[0]) if len(eqn.outvars) == 1 else ()
      if not (D.is_elementwise(eqn) and len(out_shape) == len(in_shape)
              and out_shape[dim] == in_shape[dim]):
        fate.bad.append(f"it meets an operation split rules do not follow at {where}")
        return []
      for p in range(len(eqn.invars)):
        if p in split:
          if split[p] != dim:
            fate.bad.append(f"it meets an operand split on another dimension at {where}")
            return []
        elif self._unsplit_activation(node, p, dim):
          fate.bad.append(f"{_MIXED} at {where}")
          return []
      out = dim
    return [(eqn.outvars[0], out)]

  def _weight_ahead(self, node: Node, pos: int) -> bool:
    """Whether operand ``pos`` is a parameter seen through shape-only ops the pass has not
    reached yet (a kernel stored ``(out, in)`` and transposed at its use)."""
    leaves = set(self.program.invars[:len(self.leaf_shapes)])
    bases = list(node.inputs[pos])
    while len(bases) == 1:
      if bases[0] in leaves:
        return True
      producer = self.program.producer.get(bases[0])
      if producer is None or producer.primitive not in ("transpose", "convert_element_type"):
        return False
      bases = list(producer.inputs[0])
    return False

  def _unsplit_activation(self, node: Node, pos: int, dim: int) -> bool:
    """Whether operand ``pos`` is data (computed from the batch), whole along ``dim`` and not
    split there: a residual stream, not a bias, a constant, or a mask whose values along
    ``dim`` a broadcast or a constant makes (a label compared with the class index)."""
    shape = D.shape(node.eqn.invars[pos])
    if self.split_dim(node, pos) is not None:
      return False
    return self._data_along(node.inputs[pos], shape, dim, _MASK_DEPTH)

  def _data_along(self, bases, shape: tuple[int, ...], dim: int, depth: int) -> bool:
    """Whether a value of ``shape`` (made of ``bases``) carries data along ``dim``: followed
    back through broadcasts and elementwise operations, up to ``depth`` of them."""
    if len(shape) <= dim or shape[dim] == 1 or not any(b in self.data for b in bases):
      return False
    producer = next((self.program.producer.get(b) for b in bases
                     if b in self.program.producer), None)
    if producer is not None and producer.primitive == "broadcast_in_dim":
      src = D.shape(producer.eqn.invars[0])
      made = {d for i, d in enumerate(producer.eqn.params["broadcast_dimensions"])
              if src[i] == shape[d]}
      return dim in made
    if (producer is not None and depth and D.is_elementwise(producer.eqn)
        and D.shape(producer.eqn.outvars[0]) == shape):
      return any(self._data_along(producer.inputs[p], D.shape(producer.eqn.invars[p]), dim,
                                  depth - 1) for p in range(len(producer.eqn.invars)))
    return True

  def _gather(self, node: Node) -> None:
    rows = self.split_dim(node, 1) if self.follow_indices else None
    if rows is not None:
      self.set_out(node, gather_index_dims(node.eqn).get(rows))
    elif self.follow_indices and self.split_dim(node, 0) is not None:
      self.set_out(node, gather_offset_dim(node.eqn, self.split_dim(node, 0)))
    w = self.view(node, 0)
    if w is None:
      return
    dnums = node.eqn.params["dimension_numbers"]
    indexed = tuple(getattr(dnums, "start_index_map", ()))
    if len(indexed) == 1:
      self.decide(w, indexed[0], VOCAB)

  def _shape_op(self, node: Node) -> None:
    eqn = node.eqn
    in_shape, out_shape = D.shape(eqn.invars[0]), D.shape(eqn.outvars[0])
    mapping = D.dim_map(eqn.primitive.name, eqn.params, in_shape, out_shape)
    if mapping is None:
      return
    dim = self.split_dim(node, 0)
    if dim is not None and mapping.get(dim) is not None:
      same = in_shape[dim] == out_shape[mapping[dim]]   # a fusion stays one when kept whole
      self.set_out(node, mapping[dim], parts=self.parts_of(node, 0) if same else 1)
    v = self.view(node, 0)
    if v is not None:
      inverse = {o: i for i, o in mapping.items() if o is not None}
      self.views[eqn.outvars[0]] = D.View(
          v.leaf, tuple(v.dims[inverse[j]] if j in inverse else None
                        for j in range(len(out_shape))))

  def _elementwise(self, node: Node) -> None:
    eqn = node.eqn
    out_shape = D.shape(eqn.outvars[0])
    dim = None
    for pos in range(len(eqn.invars)):
      d = self.split_dim(node, pos)
      if d is not None and D.shape(eqn.invars[pos])[d] == out_shape[d]:
        dim = d
        break
    if dim is None:
      return
    parts = self.parts_of(node, pos)
    self.set_out(node, dim, parts=parts)
    for pos in range(len(eqn.invars)):
      v = self.view(node, pos)
      shape = D.shape(eqn.invars[pos])
      if v is not None and len(shape) == len(out_shape) and shape[dim] == out_shape[dim]:
        self.decide(v, dim, FOLLOWS, parts)
