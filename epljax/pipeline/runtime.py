"""The pipelined gradient: one ``shard_map`` over the mesh, a ``lax.scan`` over ticks.

Every device runs the same loop (``schedules.py`` says what each tick holds). In a tick, a
stage

1. runs the forward of its micro batch (if any) with ``jax.vjp`` (replaying the program the
   plan traced for it, ``Branch.forward``), keeps the residuals the backward needs in a stash
   slot, and hands its outgoing activations to the next stage;
2. runs the backward of its micro batch (if any) from the stashed residuals and the gradient
   received from the next stage (the loss scale on the last stage), adds the parameter
   gradient to its accumulator and hands the activation gradient to the previous stage;
3. moves both with one ``ppermute`` each along the ``stage`` axis (round the ring with virtual
   stages: stage ``s`` holds chunks ``s, s + S, ...``, its ``v`` parameter rows).

The backward is written out per micro batch (not left to autodiff of the loop), which is what
lets 1F1B free a micro batch's residuals as soon as its backward ran. Stages that differ are
branches of a ``lax.switch`` on the stage index, over packed buffers (``packing.py``), or over
slots of whole arrays for tensor-parallel stages (``slots.py``: parameters and residuals keep
GSPMD's ``model`` split); an idle slot takes an extra branch that does nothing, so bubble ticks
cost no compute.

What is stashed: the *residuals* of ``jax.vjp`` (the forward runs once), minus the
parameters, incoming activations and batch leaves they contain, which are read again at
backward time instead of being copied per micro batch, and minus the residuals that are
functions of the parameters alone (a weight's low-precision cast), which the backward
recomputes (``derived.py``). The stacked weights of a stage's rolled layers (``roll.py``)
are parameters in this sense: each forward slices them from the packed buffer
(``packing.Layout.unpack_stacked``), and the backward, a reverse scan over the layers
(``roll.vjp``), reads each layer's weights from the buffer and adds each layer's gradient into
its rows of the accumulator (``packing.Layout.row``, ``add_row``). With
tensor-parallel stages every slot holds the largest residual of its shape over the distinct
stage functions, so a stage whose residuals are all small still carries the others' slots (the
plan's ``stash`` line gives the bytes). Gradient checkpointing features (their ``forward``
hook) trade recomputation for stash memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from epljax.errors import PlanError
from epljax.mesh import STAGE
from epljax.pipeline import derived, packing, roll, slots
from epljax.pipeline.partition import Stage, same_consts
from epljax.pipeline.schedules import Schedule

if TYPE_CHECKING:
  from epljax.pipeline.storage import ParamStore

# Name scopes of the tick loop's two switches (the ``op_name`` of their conditionals).
FORWARD_SWITCH = "pipeline_forward"
BACKWARD_SWITCH = "pipeline_backward"

StageFn = Callable[[Sequence[Any], Sequence[Any], Sequence[Any]], tuple[Any, Any, Any]]


@dataclasses.dataclass(frozen=True)
class Residuals:
  """How to rebuild a stage's ``jax.vjp`` pullback from the stash (found by a trial trace)."""
  treedef: Any
  # per pullback leaf: (param|act|batch|res|derived, index) or static
  kinds: tuple[tuple[str, Any], ...]
  layout: packing.Layout               # the stashed leaves
  kept: tuple[int, ...]                # which of the forward's stash outputs they are
  recompute: derived.Derived | None    # the rest, recomputed from the parameters


@dataclasses.dataclass(frozen=True, eq=False)
class Branch:
  """One distinct stage function, traced (``trace``): the layouts of its buffers and what its
  one trace found."""
  stage: Stage
  params: packing.Layout      # its layout in the parameter buffers (``storage.ParamStore``)
  incoming: packing.Layout
  outgoing: packing.Layout
  state_avals: tuple[Any, ...]
  state: packing.Layout       # model state (BatchNorm statistics) in slots, threaded in order
  loop: tuple[Mesh, frozenset[str]]   # the loop's mesh and manual axes
  # The trial trace's program (params, acts, batch, state) -> (outs, loss, aux, stash, new
  # state) and its output tree, replayed by the step's forward.
  forward: tuple[jcore.ClosedJaxpr, Any]
  residuals: Residuals
  loss_dtype: Any             # of the (feature-wrapped) stage's loss output
  stacks: packing.Stacks = packing.Stacks()   # its rolled layers' stacks in ``params``

  @property
  def signature(self) -> tuple:
    """Equal for stages that compute the same thing on buffers laid out the same way (with
    equal constants, ``partition.same_consts``)."""
    return (str(self.forward[0]), self.params, self.incoming, self.outgoing, self.stage.last,
            self.state)

  @property
  def needs_inputs(self) -> bool:
    return any(kind == "act" for kind, _ in self.residuals.kinds)

  def bound(self, fn):
    """``fn`` compiled alone (``pipeline.cost.branch_flops``): a stage averaging its batch
    statistics (``stats.py``) in a ``shard_map`` manual over the loop's axes, as in the loop."""
    if not self.stage.averaged:
      return fn
    mesh, manual = self.loop
    return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False,
                         axis_names=manual)


def trace(stage: Stage, fn: StageFn, params: packing.Layout, state_avals: Sequence[Any],
          state: packing.Layout, loop: tuple[Mesh, frozenset[str]], param_avals,
          batch_avals) -> Branch:
  """The stage's one trace (a trial ``jax.vjp`` of ``fn``): which pullback leaves must be
  stashed, and their shapes; its program is the forward the step replays."""
  found = {}

  # Rolled stacks in rows of one flat buffer are read and accumulated a layer at a time
  # (``roll.vjp``); stacks kept whole (in slots) and the chunks of ``nn.scan`` layers
  # (``chunks.py``) go through jax's derivative of their scan.
  layered = (range(len(stage.params), len(stage.params) + len(stage.stacks))
             if all(params.uniform(rows) for rows in stage.stacks) else ())

  def trial(p, acts, batch, old):
    outs, loss, aux, pull, new_state = _pullback(fn, p, acts, batch, old, layered)
    found["treedef"], found["kinds"], stash = _split(pull, p, acts, batch)
    return outs, loss, aux, stash, new_state

  sds = lambda a, *lead: jax.ShapeDtypeStruct((*lead, *a.shape), a.dtype)  # noqa: E731
  leaves = [param_avals[i] for i in stage.params]
  state_avals = tuple(state_avals[j] for j in stage.state)
  args = ([sds(a) for a in leaves] + [sds(leaves[rows[0]], len(rows)) for rows in stage.stacks],
          [sds(a) for a in stage.incoming], [sds(a) for a in batch_avals],
          [sds(a) for a in state_avals])
  # The loop's axes are bound as there (a stage averaging its batch statistics, ``stats.py``,
  # reduces over them), so the program replays inside the loop as it is.
  mesh, manual = loop
  closed, shapes = jax.make_jaxpr(trial, axis_env=[(a, mesh.shape[a]) for a in sorted(manual)],
                                  return_shape=True)(*args)
  _, loss, _, stash, _ = shapes
  # Functions of the parameters alone are recomputed by the backward, not stashed per micro
  # batch (``derived.py``).
  positions = jax.tree.unflatten(jax.tree.structure(shapes),
                                 range(len(closed.jaxpr.outvars)))[3]
  fixed, recompute = derived.split(closed, len(args[0]), positions)
  kept = tuple(k for k in range(len(stash)) if k not in fixed)
  index = {**{k: ("derived", i) for i, k in enumerate(fixed)},
           **{k: ("res", i) for i, k in enumerate(kept)}}
  kinds = tuple(index[v] if kind == "res" else (kind, v) for kind, v in found["kinds"])
  stash = [stash[k] for k in kept]
  for leaf in stash:
    if not jnp.issubdtype(leaf.dtype, np.number) and leaf.dtype != np.bool_:
      raise PlanError(f"Stage '{stage.name}' keeps a value of dtype {leaf.dtype} for its "
                      "backward pass; pipeline stages can keep numeric and boolean values "
                      "only. Pass PRNG keys as raw key data (jax.random.key_data).")
  return Branch(stage, params, packing.Layout.of(stage.incoming),
                packing.Layout.of(stage.outgoing), state_avals, state, loop,
                (closed, jax.tree.structure(shapes)),
                Residuals(found["treedef"], kinds, packing.Layout.of(stash), kept, recompute),
                loss.dtype, params.stacks_of(stage.stacks, stage.read_directly()))


def _pullback(fn: StageFn, params, acts, batch, state, stacks: Sequence[int] = ()):
  """Outputs, loss, aux, pullback and the new model state of one forward. The state is not
  differentiated; a state value the pullback needs is stashed (it changes per micro batch).
  ``stacks``: the flat positions of a rolled stage's stacks, differentiated a layer at a time
  (``roll.vjp``)."""
  def f(p, a):
    outs, loss, aux, new_state = fn(p, a, batch, tuple(state))
    loss = jnp.zeros((), jnp.float32) if loss is None else loss
    return (tuple(outs), loss), (tuple(aux), tuple(new_state))

  primals = (tuple(params), tuple(acts))
  (outs, loss), pull, (aux, new_state) = (roll.vjp(f, primals, stacks) if stacks else
                                          jax.vjp(f, *primals, has_aux=True))
  return outs, loss, aux, pull, new_state


def _split(pull, params, acts, batch) -> tuple[Any, tuple, list]:
  """Pullback -> (treedef, kinds, leaves to stash). Inputs are referenced, not stashed."""
  known = {id(x): ("param", i) for i, x in enumerate(params)}
  known.update({id(x): ("act", i) for i, x in enumerate(acts)})
  known.update({id(x): ("batch", i) for i, x in enumerate(batch)})
  return roll.split_pullback(pull, known)


@dataclasses.dataclass(frozen=True)
class Buffers:
  """Sizes (per dtype) of every buffer the loop carries."""
  params: dict[str, Any]    # {dtype: size} packed (and {part: SlotType}), or slots
  payload: dict[str, int]
  grad_payload: dict[str, int]
  residuals: dict[str, Any]  # {dtype: size} packed, or {slot: SlotType} (tensor-parallel)
  keep_inputs: bool
  state: dict[str, Any]     # {slot: SlotType}


@dataclasses.dataclass(frozen=True)
class Loop:
  """The loop's distinct stage functions, the branch of every stage (chunk) and its buffers."""
  branches: tuple[Branch, ...]
  branch_of: tuple[int, ...]
  buffers: Buffers


def make_loop(stages: Sequence[Stage], fns: Sequence[StageFn], param_avals, batch_avals,
              store: ParamStore, *, state_avals: Sequence[Any], state_layouts: Sequence[Any],
              state_types: packing.Types, loop: tuple[Mesh, frozenset[str]]) -> Loop:
  """One ``Branch`` per distinct stage function, and the branch of every stage. ``store``: the
  parameter store (``storage.ParamStore``: per stage its layout in the parameter buffers,
  their type, and the stash's layouts and type); ``state_avals`` / ``state_layouts`` /
  ``state_types``: the model state leaves, per stage its state slots, and their types;
  ``loop``: the mesh and manual axes of ``pipelined_gradients``' loop, for stages with
  collectives of their own (batch statistics)."""
  branches: list[Branch] = []
  seen: list[tuple[tuple, list]] = []
  branch_of = []
  for stage, fn, layout, state in zip(stages, fns, store.layouts, state_layouts, strict=True):
    branch = trace(stage, fn, layout, state_avals, state, loop, param_avals, batch_avals)
    sig, consts = branch.signature, branch.forward[0].consts
    match = [i for i, (s, c) in enumerate(seen) if s == sig and same_consts(c, consts)]
    if not match:
      branches.append(branch)
      seen.append((sig, consts))
    branch_of.append(match[0] if match else len(branches) - 1)
  layouts, residuals = store.stash([b.residuals.layout for b in branches])
  branches = [dataclasses.replace(b, residuals=dataclasses.replace(b.residuals, layout=layout))
              for b, layout in zip(branches, layouts)]
  edges = [b.incoming for b in branches] + [b.outgoing for b in branches]
  buffers = Buffers(
      params=dict(store.buffers),
      payload=packing.padded_sizes(edges),
      grad_payload=packing.padded_sizes(edges, inexact_only=True),
      residuals=dict(residuals), keep_inputs=any(b.needs_inputs for b in branches),
      state=dict(state_types))
  return Loop(tuple(branches), tuple(branch_of), buffers)


def forward_branch(branch: Branch, sizes: Buffers, aux_avals):
  def run(params, incoming, batch, state):
    leaves = branch.params.unpack_stacked(params, branch.stacks)
    acts = branch.incoming.unpack(incoming)
    old = [slots.as_key(x, a) for x, a in zip(branch.state.unpack(state), branch.state_avals)]
    closed, tree = branch.forward   # the trial trace's program, replayed
    args = jax.tree.leaves((leaves, acts, batch, old))
    if [(a.shape, a.dtype) for a in args] != [(v.shape, v.dtype) for v in closed.in_avals]:
      raise AssertionError(f"stage '{branch.stage.name}' replays its forward on other inputs")
    outs, loss, aux, stash, new_state = jax.tree.unflatten(tree, jcore.jaxpr_as_fun(closed)(*args))
    state = {**state, **{e.key: slots.as_data(x) for e, x in zip(branch.state.entries,
                                                                  new_state)}}
    if not branch.stage.last:
      aux = [jnp.zeros(a.shape, a.dtype) for a in aux_avals]
    return (branch.outgoing.pack(outs, sizes.payload), loss.astype(jnp.float32), list(aux),
            branch.residuals.layout.pack([stash[k] for k in branch.residuals.kept],
                                         sizes.residuals), state)

  return run


def backward_branch(branch: Branch, sizes: Buffers):
  # The stash comes in whole and is sliced here, where the slices fuse into their consumers,
  # rather than copying a slot out before the switch.
  def run(params, acc, stash_x, stash_r, slot, batch, grad_out, seed):
    leaves = branch.params.unpack_stacked(params, branch.stacks)
    acts = branch.incoming.unpack(_take(stash_x, slot)) if branch.needs_inputs else [
        jnp.zeros(a.shape, a.dtype) for a in branch.stage.incoming]
    stashed = branch.residuals.layout.unpack(_take(stash_r, slot))
    recompute = branch.residuals.recompute
    source = {"param": leaves, "act": acts, "batch": batch, "res": stashed,
              "derived": recompute(leaves) if recompute else []}
    pull_leaves = [value if kind == "static" else source[kind][value]
                   for kind, value in branch.residuals.kinds]
    pull = jax.tree.unflatten(branch.residuals.treedef, pull_leaves)
    ct = (tuple(branch.outgoing.unpack(grad_out)), seed.astype(branch.loss_dtype))
    if isinstance(pull, roll.LayeredPull):   # each layer's gradient added in place
      layout, n = branch.params, len(branch.params.entries)
      rows = [branch.stacks.rows[i - n] for i in pull.inputs]
      (g_params, g_acts), acc = pull.backward(
          ct, lambda j, l: layout.row(params, rows[j], l),
          lambda acc, j, l, g: layout.add_row(acc, rows[j], l, g), acc)
      stacked = {i for r in branch.stacks.rows for i in r} - branch.stacks.direct
      acc = layout.add_each(acc, [None if i in stacked else g
                                  for i, g in enumerate(g_params[:n])])
    else:
      g_params, g_acts = pull(ct)
      acc = branch.params.accumulate(acc, g_params, sizes.params, branch.stacks)
    return acc, branch.incoming.pack(g_acts, sizes.grad_payload, skip_missing=True)

  return run


def _idle_forward(sizes: Buffers, aux_avals):
  def run(params, incoming, batch, state):
    return (packing.zeros(sizes.payload), jnp.zeros((), jnp.float32),
            [jnp.zeros(a.shape, a.dtype) for a in aux_avals], packing.zeros(sizes.residuals),
            state)
  return run


def _idle_backward(sizes: Buffers):
  def run(params, acc, stash_x, stash_r, slot, batch, grad_out, seed):
    return acc, packing.zeros(sizes.grad_payload)
  return run


def _take(buffers: dict, index) -> dict:
  return {k: lax.dynamic_index_in_dim(v, index, keepdims=False) for k, v in buffers.items()}


def _put(buffers: dict, index, values: dict, keep=None) -> dict:
  """``values`` written at ``index``; where ``keep``, the slot as it was (an idle forward
  writes its busy slot back in place, so idle ticks need no stash slot of their own)."""
  if keep is not None:
    values = {k: jnp.where(keep, lax.dynamic_index_in_dim(v, index, keepdims=False), values[k])
              for k, v in buffers.items()}
  return {k: lax.dynamic_update_index_in_dim(v, values[k], index, 0) for k, v in buffers.items()}


def branch_shares(loop: Loop, schedule: Schedule, stage: int) -> dict[str, list[Fraction]]:
  """Per switch of the tick loop (its name scope), the share of the ticks in which stage
  ``stage`` takes each branch (the idle one last): what ``hlo.executed_collectives`` needs to
  count the collectives one device of that stage executes, where the compiled program holds
  every branch once in each tick."""
  idle = len(loop.branches)
  tables = tick_tables(schedule, loop.branch_of, idle)[:, stage]
  return {name: [Fraction(int(np.sum(tables[:, column] == b)), schedule.num_ticks)
                 for b in range(idle + 1)]
          for name, column in ((FORWARD_SWITCH, 0), (BACKWARD_SWITCH, 4))}


def tick_tables(schedule: Schedule, branch_of: Sequence[int], idle: int) -> np.ndarray:
  """``(ticks, stages, 8)`` int32 rows of the loop: per stage, the forward's switch branch,
  micro batch, stash slot and chunk (which of the stage's ``v`` parameter rows), then the
  same for the backward. Chunk ``j`` of stage ``s`` is model chunk ``s + jS``; idle slots take
  the ``idle`` branch (and micro batch, slot and chunk 0)."""
  n_stages = schedule.num_stages
  stage = np.arange(n_stages)[None, :]
  out = []
  for m, slot, j in ((schedule.forward, schedule.forward_slot, schedule.forward_chunk),
                     (schedule.backward, schedule.backward_slot, schedule.backward_chunk)):
    branch = np.asarray(branch_of, np.int32)[j * n_stages + stage]
    out += [np.where(m >= 0, branch, idle), np.maximum(m, 0), slot, j]
  return np.stack(out, axis=-1).astype(np.int32)


def _chunk(buffers: dict, j, v: int) -> dict:
  """Chunk ``j``'s row of a stage's ``{dtype: (v, size)}`` buffers."""
  return {k: x[0] for k, x in buffers.items()} if v == 1 else _take(buffers, j)


def _set_chunk(buffers: dict, j, values: dict, v: int) -> dict:
  """Chunk ``j``'s row of ``buffers`` replaced by ``values``."""
  if v == 1:
    return {k: x[None] for k, x in values.items()}
  return _put(buffers, j, values)


def _hops(n_stages: int, step: int, ring: bool) -> list[tuple[int, int]]:
  """``ppermute`` pairs one stage down (``step=1``) or up; round the ring with virtual stages
  (stage ``S - 1`` feeds stage 0 its next chunk)."""
  pairs = [(i, i + step) for i in range(n_stages)]
  return [(a, b % n_stages) for a, b in pairs if ring or 0 <= b < n_stages]


def _gather_aux(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """One replica's aux, stacked over micro batches -> the global batch's, by the rule of the
  data-parallel step: float scalars averaged, integer ones summed, arrays (one row per
  example) concatenated along the batch axis."""
  if x.ndim == 1:
    return lax.pmean(x, axes) if jnp.issubdtype(x.dtype, jnp.inexact) else lax.psum(x, axes)
  return lax.all_gather(x, axes, axis=1, tiled=True)


def pipelined_gradients(loop: Loop, aux_avals, schedule: Schedule, mesh: Mesh,
                        data_axes: tuple[str, ...], batch_spec: P, manual: frozenset[str]):
  """``(params {dtype: (S v, size)}, state {slot: (S, ...)}, micro batch leaves (M, rows, ...),
  seed) -> (mean loss, aux (M, ...), summed-over-data mean gradients {dtype: (S v, size)}, new
  state)``, as one shard_map. Row ``s v + j`` holds chunk ``s + jS`` (stage ``s``'s ``j``-th;
  ``v = 1``: row ``s``).

  ``manual``: the mesh axes the loop is written for. Tensor-parallel stages
  leave ``model`` to GSPMD: their parameters come in whole (slots, ``v = 1``), with a
  ``model`` split. ``state``: model state per stage (``v = 1``), updated by each
  forward in micro batch order."""
  branches, sizes = loop.branches, loop.buffers
  fwd = [forward_branch(b, sizes, aux_avals) for b in branches] + [
      _idle_forward(sizes, aux_avals)]
  bwd = [backward_branch(b, sizes) for b in branches] + [_idle_backward(sizes)]
  idle = len(branches)
  n_stages, n_micro = schedule.num_stages, schedule.num_micro_batch
  n_virtual = schedule.num_virtual_stages
  slots = schedule.num_slots
  shards = int(np.prod([mesh.shape[a] for a in data_axes]))
  tables = tick_tables(schedule, loop.branch_of, idle)   # (T, S, 8)
  down = _hops(n_stages, 1, n_virtual > 1)
  up = _hops(n_stages, -1, n_virtual > 1)

  def local(params, state, micro, seed):   # params: this stage's v chunk rows
    stage = lax.axis_index(STAGE)
    # The mean over micro batches and replicas, folded into the cotangent every backward
    # starts from: the summed gradients come out scaled, with no pass over them.
    seed = seed / (n_micro * shards)
    carry = dict(
        fwd=packing.zeros(sizes.payload), bwd=packing.zeros(sizes.grad_payload),
        stash_x=packing.zeros(sizes.payload if sizes.keep_inputs else {}, (slots,)),
        stash_r=packing.zeros(sizes.residuals, (slots,)),
        grads=packing.zeros(sizes.params, (n_virtual,)), losses=jnp.zeros((n_micro,), jnp.float32),
        aux=[jnp.zeros((n_micro, *a.shape), a.dtype) for a in aux_avals],
        state={k: v[0] for k, v in state.items()})

    def tick(c, row):
      f_branch, f_m, f_slot, f_j, b_branch, b_m, b_slot, b_j = (row[stage, i] for i in range(8))
      batch = [lax.dynamic_index_in_dim(x, f_m, keepdims=False) for x in micro]
      with jax.named_scope(FORWARD_SWITCH):
        out, loss, aux, res, new_state = lax.switch(
            f_branch, fwd, _chunk(params, f_j, n_virtual), c["fwd"], batch, c["state"])
      stash_x = _put(c["stash_x"], f_slot, c["fwd"], keep=f_branch == idle)
      stash_r = _put(c["stash_r"], f_slot, res, keep=f_branch == idle)
      losses = c["losses"].at[f_m].add(loss)
      auxes = [acc.at[f_m].add(a) for acc, a in zip(c["aux"], aux)]
      batch = [lax.dynamic_index_in_dim(x, b_m, keepdims=False) for x in micro]
      with jax.named_scope(BACKWARD_SWITCH):
        acc, g_in = lax.switch(
            b_branch, bwd, _chunk(params, b_j, n_virtual), _chunk(c["grads"], b_j, n_virtual),
            stash_x, stash_r, b_slot, batch, c["bwd"], seed)
      grads = _set_chunk(c["grads"], b_j, acc, n_virtual)
      return dict(fwd=lax.ppermute(out, STAGE, down), bwd=lax.ppermute(g_in, STAGE, up),
                  stash_x=stash_x, stash_r=stash_r, grads=grads, losses=losses,
                  aux=auxes, state=new_state), None

    c, _ = lax.scan(tick, carry, jnp.asarray(tables))
    grads = {k: lax.psum(g, data_axes) for k, g in c["grads"].items()}
    loss = lax.pmean(lax.psum(jnp.sum(c["losses"]), STAGE) / n_micro, data_axes)
    aux = [_gather_aux(lax.psum(a, STAGE), data_axes) for a in c["aux"]]  # made on the last
    return loss, aux, grads, {k: v[None] for k, v in c["state"].items()}

  stage_spec = P(STAGE)
  # check_vma=False: the stages replay equations captured outside any shard_map (their
  # calls, scans and custom rules carry no varying-axes types); every reduction is explicit.
  return jax.shard_map(local, mesh=mesh, in_specs=(stage_spec, stage_spec, batch_spec, P()),
                       out_specs=(P(), P(), stage_spec, stage_spec), check_vma=False,
                       axis_names=manual)
