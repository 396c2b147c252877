"""The plan search's estimate of a candidate before compiling (``epljax.search``).

Parameter, gradient, optimizer-state and model-state bytes per device follow exactly from the
traced specs and the features, each feature's footprint from the module that makes its
shardings (``memory.zero.footprint`` and ``hybrid_traffic``, ``memory.offload.footprint``,
``memory.remat.checkpointed_residuals``, ``mesh.builder.group_size``); activations, FLOPs and
collectives are estimated from the traced program: activations from the residuals of
``jax.vjp`` of the loss (``residual_bytes``), collectives over ``model`` from how each node
reads a split parameter (``split_uses``). The
search compiles the candidates it chooses among; their compiled costs (``cost.compiled_cost``)
replace these numbers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore

from epljax import cost as cost_lib
from epljax.errors import PlanError
from epljax.memory import offload as offload_lib
from epljax.memory import zero as zero_lib
from epljax.mesh import DATA, MODEL, REPLICA, STAGE, builder, data_axes, hosts
from epljax.pipeline.auto import node_flops
from epljax.pipeline.schedules import IDLE
from epljax.sharding import program as program_lib

# Outputs whose share split over model scales the residuals: matmuls, nonlinear functions.
_KEPT = {"dot_general", "conv_general_dilated", "exp", "log", "tanh", "logistic", "erf", "div",
         "integer_pow", "rsqrt", "sqrt", "max", "pow"}


# Equations XLA's cost analysis counts a FLOP per output element of (``update_flops``).
_ARITHMETIC = {"add", "add_any", "sub", "mul", "div", "max", "min", "neg", "sqrt", "rsqrt", "pow",
               "integer_pow", "abs", "exp", "log", "square", "sign", "tanh", "logistic",
               "reduce_sum", "reduce_max", "select_n"}


def update_flops(optimizer: optax.GradientTransformation, params_shape: Any) -> float:
  """FLOPs per parameter byte of one ``optimizer`` update applied to the parameters
  (``params_shape``: their avals), from its jaxpr, nothing compiled: each arithmetic
  equation's output elements. A step runs it on each device's share of the parameters."""
  state = jax.eval_shape(optimizer.init, params_shape)
  closed = jax.make_jaxpr(lambda g, st, p: optax.apply_updates(
      p, optimizer.update(g, st, p)[0]))(params_shape, state, params_shape)
  flops = sum(math.prod(getattr(v.aval, "shape", ())) for e in program_lib.eqns_in(closed.jaxpr)
              if e.primitive.name in _ARITHMETIC for v in e.outvars)
  total = sum(program_lib.nbytes(a) for a in jax.tree.leaves(params_shape))
  return flops / max(1, total)


@dataclasses.dataclass(frozen=True)
class ProgramFacts:
  """What ``step_cost`` reads from a base build's traced program, the same for every feature
  combination weighed on it: worked out once per base (``program_facts``)."""
  split_nodes: dict[int, Any]    # node index -> _SplitUse, the matmuls reading split weights
  flops: float                   # forward FLOPs per device (split matmuls divided by model)
  share: float                   # share of the kept activations left per device by model
  leaving: dict[str, tuple[int, float]]   # collectives where unsplit code reads split outputs
  recompute: float = 0.0         # of ``flops``, what the model's own rematerialization reruns
  use_bytes: int = 0             # trainable parameters in the dtype their uses compute in


def program_facts(built, split: str, amp: bool = False) -> ProgramFacts:
  """``step_cost``'s reading of ``built``'s program; ``split``: what ``epl.split(model)``
  holds ("all", a module path, or ""); ``amp``: mixed precision is on (uses read parameters
  in 16 bits)."""
  plan, cap = built.plan, built.capture
  mesh = dict(plan.mesh.shape)
  d, m = _replicas(plan.mesh), mesh.get(MODEL, 1)
  again = recomputed(cap.program)
  split_nodes = _split_uses(built, m, again)
  # Kept for the backward pass: the residuals of the loss's vjp (``residual_bytes``), split
  # like the batch, one micro batch at a time; over model split as the outputs of matmuls and
  # nonlinear functions are (split where a matmul keeps the split dimension).
  split_out = _split_outputs(cap.program, split_nodes, gathered=split not in ("", "all"))
  # Per device: the matmuls reading split weights and the operations on split outputs run on
  # a 1/model share.
  per_node = [(node_flops(n) / (d * (m if n.index in split_nodes or n.index in split_out
                                     else 1)), n) for n in cap.program.nodes]
  flops = sum(f for f, _ in per_node)
  recompute = sum(f for f, n in per_node if n.index in again)
  kept = [(_bytes(n.eqn.outvars) * n.trips, m if n.index in split_out else 1)
          for n in cap.program.nodes if n.primitive in _KEPT]
  share = (sum(b / k for b, k in kept) / sum(b for b, _ in kept)) if kept else 1.0
  leaving = (_leaving_split(cap.program, split_nodes) if split not in ("", "all") else {})
  return ProgramFacts(split_nodes, flops, share, leaving, recompute,
                      _use_bytes(built, 2 if amp else None))


# Operations whose backward pass reads none of their operands' values (linear in each, or
# moving data only): a value feeding only these needs no recomputing (``recomputed``).
_LINEAR = {"convert_element_type", "reshape", "broadcast_in_dim", "transpose", "squeeze",
           "expand_dims", "slice", "dynamic_slice", "concatenate", "pad", "rev", "copy",
           "copy_p", "add", "add_any", "sub", "neg", "reduce_sum"}


def recomputed(program) -> set[int]:
  """The nodes the backward pass runs again under the model's own rematerialization
  (``nn.remat``, ``jax.checkpoint``): inside a ``checkpoint`` whose policy does not save them
  (``Node.remat``), those whose outputs the body's own backward reads (a matmul's operand, a
  nonlinear function's input; through linear operations, which read none), and what they are
  computed from there. A rematerialized body's last matmul, read only by the body's outputs,
  is not run again, as JAX's partial evaluation leaves it."""
  needed: set[int] = set()
  for node in program.nodes:
    if not node.remat:
      continue
    todo, seen = [node], {node.index}
    while todo:
      users = [c for c in program.node_consumers(todo.pop()) if c.remat == node.remat]
      if any(c.primitive not in _LINEAR for c in users):
        needed.add(node.index)
        break
      for c in users:
        if c.index not in seen:
          seen.add(c.index)
          todo.append(c)
  again, todo = set(needed), list(needed)
  while todo:   # (and what they are computed from in the same body)
    node = program.nodes[todo.pop()]
    for p in program.node_producers(node):
      if p.remat == node.remat and p.index not in again:
        again.add(p.index)
        todo.append(p.index)
  return again


def _use_bytes(built, amp_itemsize: int | None) -> int:
  """A device's trainable parameters (its share under the plan's model split) in the dtype
  their uses read them: a leaf whose every use is a cast to a narrower float (a bfloat16
  layer's cast of its float32 kernel), or any floating leaf under mixed precision
  (``amp_itemsize``), counts at the narrower width, as ZeRO v3 gathers it (``memory.uses``)."""
  program, total = built.capture.program, 0
  for i, leaf in enumerate(built.plan.leaves):
    if not leaf.trainable:
      continue
    dtype = program.invars[i].aval.dtype
    itemsize = dtype.itemsize
    uses = program.uses_of_input(i)
    casts = [n.eqn.outvars[0].aval.dtype.itemsize for n, _ in uses
             if n.primitive == "convert_element_type"]
    if uses and len(casts) == len(uses):
      itemsize = min(itemsize, max(casts))
    elif amp_itemsize and jnp.issubdtype(dtype, jnp.floating):
      itemsize = min(itemsize, amp_itemsize)
    total += leaf.bytes_per_device * itemsize // dtype.itemsize
  return total


@dataclasses.dataclass(frozen=True)
class Residuals:
  """What the backward pass keeps of the forward pass (whole batch, ``residual_bytes``):
  ``plain``, and ``checkpointed`` under ``gradient_checkpoint.type="auto"``, the footprint of
  the segments that feature cuts (``memory.remat.checkpointed_residuals``)."""
  plain: int
  checkpointed: int


def step_cost(built, facts: ProgramFacts, features: dict[str, Any], chip, batch_bytes: int,
              residuals: int | Residuals, update: float = 0.0) -> cost_lib.StepCost:
  """A candidate's bytes and time before compiling: parameters, gradients, optimizer and
  model state per device exactly from the specs; activations (the vjp's ``residuals``, split
  like the batch and like the model's split outputs), FLOPs (``node_flops``, x3 for the
  backward, once more for what the model's own rematerialization reruns or, with
  checkpointing, for the whole forward pass) and collectives (gradient reduction over data;
  over model, an all-reduce of the output of each matmul that contracts a split dimension,
  and of the input gradient of each that does not) estimated from the traced program, as ``facts``
  (``program_facts``) read it; and ``update`` FLOPs per byte of the parameters a device
  updates (``update_flops``: ZeRO shards the update over data)."""
  plan = built.plan
  mesh = dict(plan.mesh.shape)
  d, m = _replicas(plan.mesh), mesh.get(MODEL, 1)
  micro = features["num_micro_batch"]
  zero, offload = features["zero_level"], features["offload"]
  # ZeRO's group: all the data replicas, or (HSDP, ``zero_shard``) one host's (``zero_group``),
  # each shard replicated over the groups ('replica').
  g = zero_group(plan.mesh, features) if zero else d
  full_params = plan.param_bytes
  # Each feature's footprint, from the module that makes its shardings: ZeRO's sharded parts
  # (``zero.footprint``), then what offload moves to the host (``offload.footprint``).
  on_device = zero_lib.footprint(zero, micro, {zero_lib.PARAMETERS: full_params,
                                               zero_lib.GRADIENTS: full_params,
                                               zero_lib.OPTIMIZER_STATE: plan.optimizer_bytes},
                                 g)
  on_device, host = offload_lib.footprint(offload, on_device)
  params, grads, opt = (on_device[k] for k in (zero_lib.PARAMETERS, zero_lib.GRADIENTS,
                                               zero_lib.OPTIMIZER_STATE))
  batch_bytes //= max(1, math.prod(mesh[a] for a in plan.batch_axes))
  split_nodes = facts.split_nodes
  if not isinstance(residuals, Residuals):   # (one figure: the same with checkpointing)
    residuals = Residuals(residuals, residuals)
  checkpointed = features["gradient_checkpoint"] == "auto"
  kept = ((residuals.checkpointed if checkpointed else residuals.plain)
          / max(1, math.prod(mesh[a] for a in plan.batch_axes)) * facts.share / micro)
  # The peak is either in the backward pass (residuals beside the gradient accumulator, with
  # micro batches) or at the gradients' sum over data (a second buffer: all-reduced, or its
  # shard under ZeRO), after the residuals are freed.
  activations = cost_lib.Activations(kept, grads if micro > 1 else 0,
                                     (full_params // g if zero else grads) if d > 1 else 0)
  # The backward pass runs the forward again: all of it under checkpointing (the model's own
  # rematerialized layers counted once), else what the model rematerializes.
  flops = (facts.flops * 3 + (facts.flops if checkpointed else facts.recompute)
           + update * full_params / (g if zero else 1))
  comm: dict[tuple[str, str], float] = {}
  nbytes: dict[tuple[str, str], int] = {}

  def add(kind, axis, result, group, times=1, across=None):
    nbytes[(kind, axis)] = nbytes.get((kind, axis), 0) + int(result)
    across = hosts.crosses_hosts(plan.mesh, axis) if across is None else across
    comm[(kind, axis)] = comm.get((kind, axis), 0.0) + times * cost_lib.link_seconds(
        kind, result / times, group, across, chip)

  # Plain gradients are summed in one combined all-reduce; ZeRO reduce-scatters and gathers
  # each parameter on its own (v3: gathered again in the forward and the backward pass).
  leaves = sum(leaf.trainable for leaf in plan.leaves)
  if d > 1:
    if zero:   # (``zero.hybrid_traffic``: within the groups, and across them under HSDP)
      for t in zero_lib.hybrid_traffic(zero, full_params, leaves, g, d // g,
                                       facts.use_bytes or full_params):
        add(t.kind, t.axis, t.bytes, t.group, times=t.times,
            across=(t.axis == REPLICA) if g < d else None)
    else:
      add("all-reduce", "+".join(a for a in data_axes(plan.mesh) if mesh[a] > 1),
          full_params, d)
  forwards = 2 if checkpointed else 1   # (checkpointing runs the forward pass again)
  for use in split_nodes.values():      # each micro batch
    if use.forward:
      again = 2 if checkpointed or use.recomputed else 1
      add("all-reduce", MODEL, again * use.forward / d, m, times=again * micro)
    if use.backward:
      add("all-reduce", MODEL, use.backward / d, m, times=micro)
  if split_nodes:   # the step's finite check and gradient norm sum over split shards
    add("all-reduce", MODEL, 2 * 4, m, times=2)
  for kind, (count, out_bytes) in facts.leaving.items():   # split outputs met by unsplit code
    add(kind, MODEL, forwards * out_bytes / d, m, times=forwards * count * micro)
  parts = {"parameters": params + grads, "optimizer state": opt,
           "activations": activations.bytes(),
           "model state and batch": plan.model_state_bytes + batch_bytes}
  compute_s = flops / (chip.peak_flops * chip.efficiency)
  return cost_lib.StepCost(sum(parts.values()), flops, nbytes, compute_s, comm,
                           host_s=host / chip.host_bandwidth, parts=parts,
                           hidden_s=hidden_estimate(comm, compute_s, chip),
                           activations=activations)


HOST_SHARD = "host"   # ``zero_shard``: ZeRO within each host, replicated across (HSDP)


def _replicas(mesh) -> int:
  """The data replicas: the product of the data axes (``mesh.data_axes``: 'replica' x 'data'
  under hybrid sharding)."""
  return math.prod(dict(mesh.shape).get(a, 1) for a in data_axes(mesh))


def zero_group(mesh, features: dict[str, Any]) -> int:
  """Data replicas ZeRO shards over: all of them; with ``zero_shard="host"`` (HSDP, MaxText's
  ``ici_fsdp`` x ``dcn_data``) one host's; with an int ``zero_shard`` (``zero.shard_size``)
  that many. A hybrid mesh (its 'replica' axis) says it: its 'data' axis is the group."""
  d = _replicas(mesh)
  if REPLICA in mesh.axis_names:
    return dict(mesh.shape)[DATA]
  try:   # (the group the mesh builder makes: ``mesh.builder.group_size``)
    return builder.group_size(features.get("zero_shard") or "all", d, mesh.size // d,
                              list(mesh.devices.flat), dict(mesh.shape).get(STAGE, 1))
  except PlanError:   # (a group the build refuses: the row is refused when compiled)
    return d


def hybrid_shape(mesh, features: dict[str, Any]) -> dict[str, int]:
  """The mesh shape a candidate builds: under HSDP (``zero_group`` below the replicas) a
  leading 'replica' axis over the groups and 'data' the group, as ``mesh.build_mesh`` makes
  it; else ``mesh``'s own."""
  shape = dict(mesh.shape)
  d = _replicas(mesh)
  g = zero_group(mesh, features) if features.get("zero_level") else d
  if REPLICA in shape or g >= d:
    return shape
  return {REPLICA: d // g, **shape, DATA: g}


def data_per_host(mesh) -> int:
  """How many devices of one line of the data axis share the first one's host."""
  names = list(mesh.axis_names)
  line = np.moveaxis(np.asarray(mesh.devices), names.index(DATA), 0).reshape(
      dict(mesh.shape)[DATA], -1)[:, 0]
  return sum(dev.process_index == line[0].process_index for dev in line)


def hidden_estimate(comm: dict[tuple[str, str], float], compute_s: float, chip) -> float:
  """Of the data axis's collectives, the share ``chip.overlap`` XLA's latency-hiding scheduler
  runs beside the layers' compute, at most the compute (``chips.OVERLAP``); the model axis's
  all-reduces sit between a layer's matmuls and are not hidden."""
  data = sum(t for (_, axis), t in comm.items() if axis.split("+")[0] in (REPLICA, DATA))
  return min(chip.overlap * data, compute_s)


# A pipeline step's bytes per byte of a device's stored parameters: the parameters and three
# copies in its temp (``stage_cost``). Fitted 2026-11-28 on test_auto_plan's Convs (8
# convolutions of width 512, SGD with momentum; compiled bytes less the optimizer state,
# activations, model state and batch, over the stored parameters), once a rolled stage's
# backward stopped holding its stacks (``pipeline/roll.py``, ``vjp``): with data replicas
# 5.03x and 5.08x on XLA:CPU (2 stages x 4 replicas, 4 x 2), written out or rolled alike, and
# 4.27x and 4.57x on XLA:GPU (compile-only H100s), against 5 estimated. Rolled stages were 6.0x
# on XLA:CPU before, and the constant was fitted to them (one more), which overestimated
# written-out stages by 1.16x.
PIPELINE_PARAM_COPIES = 4
# With data replicas (d > 1), one more copy of the stored parameters: the gradients all-reduced
# over data beside the accumulator (without ZeRO), or the updated shards gathered (ZeRO v1).
# Measured 2026-11-27 on Convs as data=2 x stage=4 (a copy: 2.11 MB), with rolled stages that
# then held one copy more than today: 14.92 MB compiled without ZeRO on XLA:CPU against 12.82 MB
# estimated with 5 copies; 12.85 MB on 2026-11-28, with 12.73 MB estimated with 4 + 1.
DATA_SYNC_COPIES = 1


def stage_cost(dp, facts: ProgramFacts, pipe, schedule, features: dict[str, Any], chip,
               batch_bytes: int, over_model: cost_lib.StepCost | None = None,
               update: float = 0.0) -> cost_lib.StepCost:
  """A pipeline candidate's bytes and time before compiling, from its plan (``pipe``, made
  without compiling, its bytes per micro batch scaled to ``schedule``'s micro batches) and
  ``dp``, the build of the same devices without stages (``facts``:
  its program's unsplit reading). Stages under ``epl.split(k)``: ``over_model``, the estimate of
  ``dp`` as data x model, gives the work per device and the traffic over model (the same
  bytes per device: a stage's share of the nodes on S times the rows), and the stash is split
  over model. ``update``: as ``step_cost``'s, on the parameters a stage's device stores.

  Bytes (fitted to compiled steps of a conv stack on 2 and 4 stages: 0.98-1.0x on XLA:CPU,
  1.08-1.14x on XLA:GPU): the stored parameters and, in the step's temp, three more copies
  of them (the loop's packed parameters, the gradient accumulator, the gradients summed:
  ``PIPELINE_PARAM_COPIES``; with data replicas one more, ``DATA_SYNC_COPIES``),
  the optimizer state in proportion to the parameters
  (``dp``'s, unsharded; under ZeRO each stage's is sharded over its ``d`` replicas), and the
  tick loop's stash: the schedule's slots of the largest stage's residuals per micro
  batch, twice (the loop's carry in and out).
  Time: the work of the data-parallel step (each device runs a stage's share of S times the
  rows), stretched by the schedule's tick table (a tick runs at the pace of its busiest stage:
  1 for a forward, 2 for a backward); gradients all-reduced over data, activations and their
  gradients sent between stages once per micro batch."""
  mesh = dict(pipe.mesh.shape)
  d, s = mesh.get(DATA, 1), mesh.get(STAGE, 1)
  micro = features["num_micro_batch"]
  per_micro = pipe.schedule.num_micro_batch / micro   # (rows per micro batch, relative)
  params = pipe.param_bytes_per_device
  opt = dp.plan.optimizer_bytes * params // max(1, dp.plan.param_bytes)
  zero = features.get("zero_level", "")   # (its optimizer state sharded: _stage_data_sync)
  m = mesh.get(MODEL, 1)
  kept = max((info.kept_bytes for info in pipe.stage_info()), default=0) * per_micro / m
  activations = cost_lib.Activations(2 * schedule.num_slots * kept)
  busy = ((schedule.forward != IDLE).astype(int) + 2 * (schedule.backward != IDLE)).max(axis=1)
  flops = ((over_model.flops if over_model is not None else facts.flops * 3 + facts.recompute)
           + update * params / (d if zero else 1))
  work = flops / (chip.peak_flops * chip.efficiency)
  comm: dict[tuple[str, str], float] = {}
  nbytes: dict[tuple[str, str], int] = {}
  if over_model is not None:   # (its traffic over data is the stages' own, added below)
    comm = {key: t for key, t in over_model.comm_s.items() if key[1] == MODEL}
    nbytes = {key: b for key, b in over_model.collective_bytes.items() if key[1] == MODEL}

  def add(kind, axis, result, group, times=1):
    nbytes[(kind, axis)] = nbytes.get((kind, axis), 0) + int(result)
    comm[(kind, axis)] = comm.get((kind, axis), 0.0) + times * cost_lib.link_seconds(
        kind, result / times, group, hosts.crosses_hosts(pipe.mesh, axis), chip)

  if d > 1:
    opt = _stage_data_sync(add, params, opt, d, features["zero_level"])
  boundary = max((sum(program_lib.nbytes(a) for a in st.outgoing) for st in pipe.stages),
                 default=0) * per_micro / d   # (a split stage's output: whole on each)
  add("collective-permute", STAGE, 2 * micro * boundary, s, times=2 * micro)
  # pipeline.param_layout='stage': the loop reads the stored slots, no packed copy is made.
  copies = (PIPELINE_PARAM_COPIES - (1 if pipe.in_stages else 0)
            + (DATA_SYNC_COPIES if d > 1 else 0))
  parts = {"parameters": copies * params, "optimizer state": opt,
           "activations": activations.bytes(),
           "model state and batch": dp.plan.model_state_bytes + batch_bytes // d}
  return cost_lib.StepCost(sum(parts.values()), flops, nbytes, work, comm,
                           bubble_s=work * (busy.sum() / (3 * micro) - 1), parts=parts,
                           activations=activations)


def _stage_data_sync(add, params: int, opt: int, d: int, zero: str) -> int:
  """A stage's gradients summed over its ``d`` data replicas: all-reduced, or with ZeRO v1 (a
  distributed optimizer) reduce-scattered and the updated shards gathered, the stage's
  optimizer state sharded over its replicas. Its optimizer bytes per device."""
  if not zero:
    add("all-reduce", DATA, params, d)
    return opt
  add("reduce-scatter", DATA, params / d, d)
  add("all-gather", DATA, params, d)
  return opt // d


@dataclasses.dataclass(frozen=True)
class _SplitUse:
  """How a node reading a model-split parameter runs: whether its output stays split, the
  bytes (whole batch) it all-reduces over model in the forward and in the backward pass, and
  whether the backward pass runs it again (the model's own rematerialization)."""
  output_split: bool
  forward: int = 0
  backward: int = 0
  recomputed: bool = False


_WHOLE = _SplitUse(False)


def _split_uses(built, m: int, again: set[int]) -> dict[int, _SplitUse]:
  """Nodes reading a parameter split over ``model``. A matmul contracting the split dimension
  (row-parallel; a lookup in a vocabulary-split table likewise) all-reduces its output in the
  forward pass; one keeping it (column-parallel: a classifier split by classes) has a split output,
  and the gradient of its other operand, summed over the split dimension, is all-reduced in
  the backward pass unless that operand is a program input (the batch). ``again``: the nodes
  the backward pass runs again (``recomputed``), whose forward all-reduces run twice."""
  if m == 1:
    return {}
  out: dict[int, _SplitUse] = {}
  program = built.capture.program
  for i, leaf in enumerate(built.plan.leaves):
    spec = tuple(leaf.spec)
    split = [dim for dim, a in enumerate(spec) if a is not None and MODEL in jax.tree.leaves(a)]
    if not split:
      continue
    for node, pos in (use for direct in program.uses_of_input(i)
                      for use in _through_casts(program, *direct)):
      nbytes = _bytes(node.eqn.outvars) * node.trips
      if node.primitive == "gather":   # a lookup in a split table: partial rows, summed
        use = _SplitUse(False, forward=nbytes)
      elif node.primitive != "dot_general":   # elementwise (a split bias): stays split
        use = _SplitUse(True)
      else:
        (contracting, batch) = node.eqn.params["dimension_numbers"]
        side = min(pos, 1)
        if any(dim in contracting[side] for dim in split):
          use = _SplitUse(False, forward=nbytes)
        elif any(dim in batch[side] for dim in split):
          use = _SplitUse(True)
        else:
          other = node.inputs[1 - side] if len(node.inputs) > 1 else ()
          produced = any(b in program.producer for b in other)
          use = _SplitUse(True, backward=(_bytes([node.eqn.invars[1 - side]]) * node.trips
                                          if produced else 0))
      use = dataclasses.replace(use, recomputed=node.index in again)
      seen = out.get(node.index)
      out[node.index] = use if seen is None else _SplitUse(
          seen.output_split and use.output_split, max(seen.forward, use.forward),
          max(seen.backward, use.backward), use.recomputed)
  return out


# Operations that hand a parameter on with its dimensions as they are: a bfloat16 model's
# cast of its float32 weights before the matmul reads them (``_through_casts``).
_CASTS = {"convert_element_type", "copy", "copy_p", "reduce_precision"}


def _through_casts(program, node, pos: int):
  """(node, operand position) of the uses of a value, a cast's uses in its place: the matmul
  of a model computing in bfloat16 reads its weight's cast, split as the weight is."""
  if node.primitive not in _CASTS:
    yield node, pos
    return
  for user in program.node_consumers(node):
    for j, bases in enumerate(user.inputs):
      if any(program.producer.get(b) is node for b in bases):
        yield from _through_casts(program, user, j)
        break


# Operations XLA does not fuse into a consumer's loop (it materializes their outputs); the
# others (elementwise, broadcasts, layout changes) it fuses, recomputing them where needed.
_MATERIALIZED = {"dot_general", "conv_general_dilated", "reduce_sum", "reduce_max",
                 "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin",
                 "gather", "scatter", "scatter-add", "scatter_add", "dynamic_slice",
                 "dynamic_update_slice", "scan", "while", "cond", "cumsum", "cumprod", "cummax",
                 "cumlogsumexp", "sort", "custom_vjp_call", "custom_jvp_call", "all_gather",
                 "psum", "reduce_precision", "random_bits", "threefry2x32"}


def residual_bytes(closed_jaxpr) -> int:
  """Bytes (whole batch) the backward pass keeps from the forward pass, read from the jaxpr of
  ``jax.vjp`` of the traced loss: its vjp function's leaves are the residuals. XLA keeps a
  residual made by a fusible operation (elementwise, a broadcast, a layout change) as the
  values it is computed from, recomputing it in the backward pass: those are followed back to
  values the forward pass materializes anyway (an argument, a matmul's or reduction's output,
  a value read twice), and each such value counts once; the arguments (parameters, batch) are
  not counted."""
  fun = jcore.jaxpr_as_fun(closed_jaxpr)
  args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed_jaxpr.jaxpr.invars]
  inexact = [i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.inexact)]

  def pullback(*a):   # the vjp with respect to the floating inputs (not token ids, keys)
    def of(*x):
      full = list(a)
      for i, xi in zip(inexact, x):
        full[i] = xi
      return fun(*full)
    return jax.vjp(of, *(a[i] for i in inexact))[1]

  jaxpr = jax.make_jaxpr(pullback)(*args).jaxpr
  producer = {o: e for e in jaxpr.eqns for o in e.outvars}
  reads: dict[Any, int] = {}
  for e in jaxpr.eqns:
    for x in e.invars:
      if not isinstance(x, jcore.Literal):
        reads[x] = reads.get(x, 0) + 1
  arguments = set(jaxpr.invars) | set(jaxpr.constvars)
  kept: set[Any] = set()
  todo = [v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)]
  seen: set[Any] = set()
  while todo:
    v = todo.pop()
    if v in seen or v in arguments:
      continue
    seen.add(v)
    eqn = producer.get(v)
    if eqn is None or reads.get(v, 0) > 1 or not _fusible(eqn):
      kept.add(v)
    else:
      todo.extend(x for x in eqn.invars if not isinstance(x, jcore.Literal))
  return _bytes(kept)


def _fusible(eqn) -> bool:
  if eqn.primitive.name in _MATERIALIZED:
    return False
  inner = [p for p in eqn.params.values() if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))]
  return all(_fusible(e) for j in inner for e in getattr(j, "jaxpr", j).eqns)


_REDUCTIONS = {"reduce_max", "reduce_min", "reduce_sum", "argmax", "argmin", "gather"}


def _leaving_split(program, split_nodes: dict[int, _SplitUse]) -> dict[str, tuple[int, int]]:
  """Collectives where a split module's split outputs meet code outside it: a reduction over
  them (a softmax's row maxima and sums, a label's logit) all-reduces its output; a matmul
  that does not read a split parameter gathers them whole. Followed through elementwise ops.
  (kind -> (count, result bytes, whole batch)); only for a split module, whose split ends
  at its outputs (a whole split model pairs its matmuls instead)."""
  found: dict[str, tuple[int, int]] = {}
  seen: set[int] = set()
  todo = [program.nodes[i] for i, use in split_nodes.items() if use.output_split]
  while todo:
    node = todo.pop()
    for user in program.node_consumers(node):
      if user.index in seen or user.index in split_nodes:
        continue
      seen.add(user.index)
      if user.primitive in _REDUCTIONS or user.primitive == "dot_general":
        kind, nbytes = (("all-reduce", _bytes(user.eqn.outvars)) if user.primitive != "dot_general"
                        else ("all-gather", _bytes(node.eqn.outvars)))
        count, total = found.get(kind, (0, 0))
        found[kind] = (count + 1, total + nbytes * user.trips)
      else:
        todo.append(user)
  return found


def _split_outputs(program, split_nodes: dict[int, _SplitUse], gathered: bool) -> set[int]:
  """The nodes whose outputs are split over model: those of matmuls keeping a split dimension,
  and what is computed from them up to a reduction, a row-split matmul, or (``gathered``: a
  split module, whose outputs unsplit code reads whole) a matmul outside it."""
  found = {i for i, use in split_nodes.items() if use.output_split}
  todo = [program.nodes[i] for i in found]
  while todo:
    for user in program.node_consumers(todo.pop()):
      if (user.index in found or user.index in split_nodes or user.primitive in _REDUCTIONS
          or (gathered and user.primitive == "dot_general")):
        continue
      found.add(user.index)
      todo.append(user)
  return found


def _bytes(variables) -> int:
  return sum(program_lib.nbytes(v.aval) for v in variables)
