"""What happens where a parameter is used, in one pass over the traced forward (``ParamUses``):
offload copies it to device memory, ZeRO v3 all-gathers it, mixed precision casts it, and
ZeRO reduce-scatters its gradient where it is produced. They act on the same equations, so one
forward hook applies them, reading ``ctx.shardings``.

A matmul or convolution reading a parameter becomes one custom-VJP unit keeping only the
*stored* parameter (host memory, ZeRO shard, float32) as its residual; the backward pass
places it again (``recompute.refetch``: on CPU once the cotangent exists; on GPU and TPU free of
the backward's values, so the fetch can be scheduled ahead of its use). Its weight gradient is
reduce-scattered explicitly (``psum_scatter`` in a ``shard_map`` over ``data``: GSPMD alone
writes all-reduce + slice on CPU) when ``data`` is the only mesh axis with several devices (with
hybrid sharding's ``replica`` beside it: reduce-scattered within a group, then one all-reduce of
the shard across the groups).
Bodies of ``scan`` (``nn.scan``) and user ``checkpoint`` are rewritten the same way, so each
iteration copies in, gathers and casts its own layer only. Every other equation follows the
op policy (``amp.Policy``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from epljax.features import BuildContext, Feature, ForwardFn
from epljax.memory import amp as amp_lib
from epljax.memory import routes
from epljax.memory.offload import HOST
from epljax.memory.recompute import refetch
from epljax.memory.zero import device_layout, is_sharding
from epljax.mesh import DATA, REPLICA, STAGE, data_axes
from epljax.sharding import dims as D
from epljax.sharding.specs import spec_for
from epljax.sharding.program import (REMAT, bind_here, evaluate, in_context, inner_eqns,
                                     run_body, scan_counts, trace_steps)


class ParamUses(Feature):
  """The forward rewrite for offload, ZeRO and mixed precision (see the module docstring).

  What to do at a use is read from ``ctx.shardings`` (where each parameter is stored, the
  layout it is used in, its gradient's layout), never from the features that decided it."""

  name = "param_uses"

  def __init__(self, policy: amp_lib.Policy | None = None):
    self.policy = policy
    self._warned = False
    self._active: dict = {}

  def forward(self, fn: ForwardFn, ctx: BuildContext) -> ForwardFn:
    platform = ctx.mesh.devices.flat[0].platform
    zero = _Zero.of(ctx)
    explicit = zero is not None and all(
        size == 1 for axis, size in ctx.mesh.shape.items() if axis not in (REPLICA, DATA))
    stream = any(getattr(s, "memory_kind", None) == HOST for s in jax.tree.leaves(
        ctx.shardings.params, is_leaf=is_sharding)) if ctx.shardings is not None else False
    treedef = jax.tree.structure(ctx.params_shape)
    self._active = {"stream": stream, "zero": zero, "explicit": explicit,
                    "stages": ctx.mesh.shape.get(STAGE, 1)}

    def rewritten(params, *args):
      # Inside a per-replica computation (communication.fp16, local clipping: a shard_map
      # over data) the gradient is reduced by that feature; ZeRO then only slices it.
      per_replica = DATA in getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
      whole = zero is not None and not per_replica and jax.tree.structure(params) == treedef
      if zero is not None and not per_replica and not whole:
        self._warn_once()
      program, flat = trace_steps(fn, params, args, in_device_memory=stream)
      refs = {k: _Param(i) for i, k in enumerate(program.param_keys)}
      chosen = {}
      if whole and explicit and zero.gather and not stream:
        chosen = routes.choose(program, refs, zero.dim, ctx.mesh,
                               self.policy.low if self.policy is not None else None)
      self._active["routes"] = chosen
      return _Run(program, flat, refs, self.policy, platform, ctx.mesh,
                  zero if whole else None, explicit and whole, stream, routes=chosen)()

    return rewritten

  def _warn_once(self):
    if not self._warned:
      self._warned = True
      warnings.warn("ZeRO: a forward function over a part of the parameters (a pipeline "
                    "stage) is not resharded per use; GSPMD places its gathers and "
                    "reductions.", stacklevel=3)

  def describe(self) -> str:
    active = self._active
    zero = active.get("zero")
    parts = []
    if active.get("stream") and active["stages"] == 1:   # stages: see Offload.describe
      parts.append("copied from host memory")
    if zero is not None and zero.gather:
      left = sum(r == routes.SHARDED for r in active.get("routes", {}).values())
      parts.append("all-gathered" + (f" (but {left} used sharded: moving the other operand "
                                     "is cheaper)" if left else ""))
    if self.policy is not None:
      parts.append(f"cast to {self.policy.low.name} in each matmul")
    if zero is not None:
      how = "reduce-scattered" if active.get("explicit") else "constrained to the ZeRO layout"
      parts.append(f"weight gradients {how} where produced")
    return "parameters at each use: " + ", ".join(parts) if parts else ""


@dataclasses.dataclass(frozen=True)
class _Zero:
  """ZeRO as ``ctx.shardings`` shows it, per parameter leaf: the layout a use computes with
  (``full``) and the layout its gradient is reduced to (``sharded``); ``gather``: parameters
  are stored split (v3) and gathered at each use."""
  full: tuple
  sharded: tuple
  gather: bool

  @staticmethod
  def of(ctx: BuildContext) -> _Zero | None:
    sh = ctx.shardings
    if sh is None or sh.grads is None:
      return None
    leaves = lambda t: [device_layout(s) for s in jax.tree.leaves(  # noqa: E731
        t, is_leaf=is_sharding)]
    stored = leaves(sh.params)
    full = leaves(sh.params_at_use) if sh.params_at_use is not None else stored
    sharded = leaves(sh.grads)
    if all(f.spec == g.spec for f, g in zip(full, sharded)):
      return None       # no gradient is reduced to a layout of its own
    return _Zero(tuple(full), tuple(sharded),
                 any(s.spec != f.spec for s, f in zip(stored, full)))

  def layouts(self, ref: _Param) -> tuple[NamedSharding, NamedSharding]:
    """(full, sharded) layouts of a parameter at a use (one layer of it when ``sliced``)."""
    full, sharded = self.full[ref.index], self.sharded[ref.index]
    if not ref.sliced:
      return full, sharded
    drop = lambda sh: NamedSharding(sh.mesh, P(*tuple(sh.spec)[1:]))  # noqa: E731
    return drop(full), drop(sharded)

  def dim(self, ref: _Param) -> int | None:
    """The dimension split over ``data`` at a use, or None when it is not split."""
    full, sharded = self.full[ref.index].spec, self.sharded[ref.index].spec
    dim = next((d for d, e in enumerate(sharded)
                if e == DATA and (d >= len(full) or full[d] != DATA)), None)
    if not ref.sliced or dim is None:
      return dim
    return dim - 1 if dim > 0 else None


@dataclasses.dataclass(frozen=True)
class _Param:
  """A parameter leaf as a program sees it: whole, or one layer of it (``sliced``: the
  stacked parameter of ``nn.scan`` seen inside the loop body)."""
  index: int
  sliced: bool = False


@dataclasses.dataclass(frozen=True)
class _Run:
  """One evaluation of a traced program with the rewrites of ``ParamUses``; loops over
  layers (``scan``) and user rematerialization (``checkpoint``) are re-run with their bodies
  rewritten the same way, so every matmul is cast and every layer's weight gathered inside
  the loop, one layer at a time."""
  program: Any
  flat: Any
  refs: dict          # program input key -> the parameter it is
  policy: Any         # amp_lib.Policy or None
  platform: str
  mesh: Any
  zero: _Zero | None
  explicit: bool      # weight gradients reduce-scattered by an explicit psum_scatter
  stream: bool        # parameters in host memory, copied in at each use
  recomputed: bool = False   # inside a ``checkpoint`` body that saves nothing of its own
  routes: dict = dataclasses.field(default_factory=dict)   # leaf index -> ``routes`` choice

  @property
  def _rows(self) -> tuple[str, ...]:
    """The mesh axes splitting the batch rows: (replica, data) under hybrid sharding."""
    return data_axes(self.mesh)

  def __call__(self):
    param_like = set(self.refs)       # parameters, and reshapes/casts of them
    views: dict = {}                  # program key -> _View of one parameter

    def rule(step, raw):
      keys = [None if isinstance(a, jcore.Literal) else a for a in step.inputs]
      direct = [k in self.refs for k in keys]
      flags = [k in param_like for k in keys]
      if step.primitive in amp_lib.SHAPE_ONLY and any(flags) and all(
          f or k is None for f, k in zip(flags, keys)):
        param_like.update(k for k in step.outputs if k is not None)
        live = [(k, v) for k, v in zip(keys, raw) if k is not None]
        if len(live) == 1 and len(step.outputs) == 1:
          k, v = live[0]
          base = views.get(k) or (_View(self.refs[k], v, ()) if k in self.refs else None)
          if base is not None:
            views[step.outputs[0]] = dataclasses.replace(base, steps=(*base.steps, step))
      if step.primitive in amp_lib.LOW and len(raw) == 2 and any(flags):
        seen = [None if d else views.get(k) for k, d in zip(keys, direct)]
        return in_context(step, self._matmul, step, raw, flags, direct, seen)
      bind = self._nested if _rewrites_inside(step, direct) else self._bind
      return in_context(step, bind, step, raw, flags, direct)

    return evaluate(self.program, self.flat, rule, cast_back=self.policy is not None)

  def _nested(self, step, raw, flags, direct):
    """A ``scan`` or ``checkpoint`` step, its body run by a nested ``_Run``."""
    # The loop's carries keep their traced dtypes (mixed precision may hand in bfloat16).
    raw = [amp_lib.cast(v, step.in_aval(j).dtype) if hasattr(step.in_aval(j), "dtype") else v
           for j, v in enumerate(raw)]
    nc, nk = scan_counts(step.eqn) if step.primitive == "scan" else (len(raw), 0)
    refs = {}
    for j in range(len(raw)):
      if direct[j] and not nc <= j < nc + nk:
        outer = self.refs[step.inputs[j]]
        sliced = j >= nc + nk       # the stacked parameter of a loop over layers
        if not (sliced and outer.sliced):   # a loop inside a loop over layers: GSPMD places it
          refs[j] = _Param(outer.index, sliced or outer.sliced)
    recomputed = self.recomputed or (step.primitive in REMAT
                                     and _saves_no_gathers(step.eqn.params.get("policy")))
    return run_body(step, raw, lambda body, flat: dataclasses.replace(
        self, program=body, flat=flat, refs={body.inputs[j]: r for j, r in refs.items()},
        recomputed=recomputed, routes={})())

  # -- a parameter at one use ------------------------------------------------------------
  def _ref(self, step, j) -> _Param:
    return self.refs[step.inputs[j]]

  def _place(self, ref, value, autodiff: bool = False):
    """Device memory, full layout: what the use computes with. With ``autodiff`` (any use but
    a matmul) the gradient goes back to host memory and the ZeRO layout by autodiff."""
    if self.stream:
      value = jax.device_put(value, jax.memory.Space.Device)
    if self.zero is not None and (autodiff or self.zero.gather):
      full, sharded = self.zero.layouts(ref)
      full = full if self.zero.gather and self.routes.get(ref.index) != routes.SHARDED else None
      if autodiff:
        return _reshard_cotangent(full, sharded)(value)
      if self.routes.get(ref.index) == routes.KEEP:
        # Sharded first: the gather moves this value (the weight cast to bfloat16); XLA:GPU
        # gathers a weight kept for the backward in float32 and casts it after, else.
        value = jax.lax.with_sharding_constraint(value, sharded)
      value = jax.lax.with_sharding_constraint(value, full)
    return value

  def _gradient_back(self, ref, g, reduced: bool, space):
    """The gradient of a matmul's weight, in the layout and memory (``space``) of the
    parameter."""
    if self.zero is not None and not reduced:
      g = jax.lax.with_sharding_constraint(g, self.zero.layouts(ref)[1])
    if space != jax.memory.Space.Device:
      g = jax.device_put(g, space)
    return g

  # -- per equation ----------------------------------------------------------------------
  def _bind(self, step, raw, flags, direct):
    invals = [self._place(self._ref(step, j), v, autodiff=True) if direct[j] else v
              for j, v in enumerate(raw)]
    if self.policy is not None:
      return bind_here(step.eqn, self.policy.operands(step, invals, flags), **self._low(step))
    return bind_here(step.eqn, invals)

  def _low(self, step) -> dict:
    """The parameters of a matmul or convolution ``step`` computing in the low dtype."""
    return self.policy.low_params(step) if self.policy is not None and (
        step.primitive in amp_lib.LOW) else {}

  def _matmul(self, step, raw, flags, direct, views):
    """One custom-VJP unit: the weight is placed (and cast) inside, kept raw as the residual
    and placed again in the backward pass (``recompute.refetch``). A weight read through
    shape-only steps (``views``: a kernel stored ``(out, in)`` and transposed) comes in as
    stored, the steps replayed on its placed value."""
    sharded = [j for j in range(2) if (direct[j] or views[j]) and self.routes.get(
        (views[j].param if views[j] else self._ref(step, j)).index) == routes.SHARDED]
    if sharded:
      return self._sharded(step, raw, flags, direct, views, sharded[0])
    policy, platform = self.policy, self.platform
    low = policy.low if policy is not None else None
    changes = self._low(step)
    traced = raw
    raw = [w.stored if w else v for w, v in zip(views, raw)]
    direct = [d or w is not None for d, w in zip(direct, views)]
    index = [views[j].param if views[j] else self._ref(step, j) if direct[j] else None
             for j in range(2)]
    spaces = [_memory_space(v) for v in raw]
    scatter = [self._scatter_plan(step, raw, j) if direct[j] and not views[j] else None
               for j in range(2)]
    if low is None and (not any(direct) or (not self.stream and self.zero is None)):
      return bind_here(step.eqn, traced)

    def cast(x):
      return amp_lib.cast(x, low) if low is not None else x

    def placed(j, v):
      v = self._place(index[j], v)
      return views[j].apply(v) if views[j] else v

    # A ZeRO v3 weight used in a lower precision (mixed precision, or a layer that casts its
    # kernel) is cast before it is gathered: the all-gather moves the low-precision bytes, and
    # the values are the same (a cast is elementwise). Not for weights in host memory, whose
    # cast would run on the host, nor through views that change the shape.
    early = self.zero is not None and self.zero.gather and not self.stream
    # Inside a rematerialized layer the forward runs again in the backward pass, right before
    # this unit's backward: the weight it gathers there is kept for the backward matmuls (one
    # layer's weights, for that layer's backward only) instead of gathered a third time. The
    # step then gathers each weight twice, as a hand FSDP under remat does (bench/scale.py).
    # The last use of the forward pass (``routes.KEEP``) keeps it too.
    keep = early and (self.recomputed or any(
        i is not None and self.routes.get(i.index) == routes.KEEP for i in index))

    def value(j, v):
      if not direct[j]:
        return cast(v)
      if early and views[j] is None:
        return self._place(index[j], cast(v))
      if early and views[j].casts_only:
        return cast(self._place(index[j], views[j].apply(v)))
      return cast(placed(j, v))

    def forward(a, b):
      return bind_here(step.eqn, [value(0, a), value(1, b)], **changes)[0]

    @jax.custom_vjp
    def unit(a, b):
      return forward(a, b)

    def fwd(a, b):
      res = tuple(v if flags[j] else value(j, v) for j, v in enumerate((a, b)))
      if not keep:
        return forward(a, b), (res, None)
      used = tuple(value(j, v) for j, v in enumerate((a, b)))
      return bind_here(step.eqn, list(used), **changes)[0], (res, used)

    def bwd(saved, ct):
      res, used = saved
      if used is not None:
        ops = list(used)
      else:
        res = refetch(res, ct, platform=platform)
        ops = [value(j, r) if flags[j] else r for j, r in enumerate(res)]
      grads = _pullback(step, ops, changes)(ct)
      for j in range(2):   # back through a view's steps, to the stored layout
        if views[j] and early and views[j].casts_only:
          continue   # (the cast back to the stored dtype below is its pullback)
        if views[j]:
          out, pull = jax.vjp(views[j].apply, self._place(index[j], res[j]))
          grads[j] = pull(amp_lib.cast(grads[j], out.dtype))[0]
      for j in range(2):
        if scatter[j] is not None:
          grads[j] = self._reduce_scattered(step, ops, ct, j, scatter[j])
      grads = [amp_lib.cast(g, v.dtype) for g, v in zip(grads, raw)]
      return tuple(self._gradient_back(index[j], g, scatter[j] is not None, spaces[j])
                   if direct[j] else g for j, g in enumerate(grads))

    unit.defvjp(fwd, bwd)
    return [unit(*raw)]

  def _sharded(self, step, raw, flags, direct, views, j):
    """A matmul whose weight (operand ``j``, or a transposed view of it: a tied embedding's
    table) stays sharded (``routes.SHARDED``): its output is split over ``data`` where the
    weight's split dimension lands, so GSPMD gathers the other operand's rows for it, and the
    weight's gradient comes out split without a reduction."""
    out = self._bind(step, raw, flags, direct)[0]
    dim = self.zero.dim(views[j].param if views[j] else self._ref(step, j))
    dim = D.dot_out_dim(step.eqn, j, routes.view_dim(views[j].steps, dim) if views[j] else dim)
    spec = P(*[DATA if d == dim else P.UNCONSTRAINED for d in range(out.ndim)])
    return [jax.lax.with_sharding_constraint(out, NamedSharding(self.mesh, spec))]

  def _scatter_plan(self, step, invals, j):
    """For operand j (a sharded parameter), the dimension of the other operand to split and
    its position in the output, or None when the explicit reduce-scatter does not apply."""
    if not self.explicit or step.primitive != "dot_general":
      return None
    ref = self.refs.get(step.inputs[j])
    if ref is None or self.zero.dim(ref) is None:
      return None
    _, batch, free = D.dot_dims(step.eqn)
    if batch[0] or batch[1]:
      return None
    for d in free[1 - j]:
      if invals[1 - j].shape[d] % math.prod(self.mesh.shape[a] for a in self._rows) == 0:
        return d, D.dot_out_dim(step.eqn, 1 - j, d)
    return None

  def _reduce_scattered(self, step, operands, ct, j, plan):
    d, out_pos = plan
    dim = self.zero.dim(self._ref(step, j))
    other, w = operands[1 - j], operands[j]

    def local(other_l, ct_l, w):
      g = _pullback(step, (other_l, w) if j == 1 else (w, other_l), self._low(step))(ct_l)[j]
      g = jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)
      # Hybrid sharding: the shards are summed over the groups too (one all-reduce).
      return jax.lax.psum(g, REPLICA) if len(self._rows) > 1 else g

    rows = self._rows if len(self._rows) > 1 else DATA
    return jax.shard_map(local, mesh=self.mesh,
                         in_specs=(spec_for(other.ndim, d, rows), spec_for(ct.ndim, out_pos, rows),
                                   P()),
                         out_specs=spec_for(w.ndim, dim, DATA), check_vma=False)(other, ct, w)


@dataclasses.dataclass(frozen=True)
class _View:
  """A value made from one parameter by shape-only steps (transpose, reshape, cast)."""
  param: _Param
  stored: Any             # the parameter's value as this program reads it
  steps: tuple = ()

  @property
  def casts_only(self) -> bool:
    """Its steps change the dtype only (a layer casting its kernel to its compute dtype)."""
    return all(step.primitive == "convert_element_type" for step in self.steps)

  def apply(self, value):
    """The steps, replayed on ``value`` (the parameter, placed)."""
    for step in self.steps:
      value = bind_here(step.eqn, [value if not isinstance(a, jcore.Literal) else a.val
                                   for a in step.inputs])[0]
    return value


def _pullback(step, operands, changes):
  """The pullback of a two-operand ``step`` at ``operands``: cotangent -> operand gradients."""
  _, pull = jax.vjp(lambda x, y: bind_here(step.eqn, [x, y], **changes)[0], *operands)
  return lambda ct: list(pull(ct))


def _reshard_cotangent(forward_sharding, backward_sharding):
  """Identity (a gather when ``forward_sharding`` is given) whose cotangent is constrained to
  ``backward_sharding``."""

  @jax.custom_vjp
  def f(x):
    return x if forward_sharding is None else jax.lax.with_sharding_constraint(
        x, forward_sharding)

  f.defvjp(lambda x: (f(x), None),
           lambda _, ct: (jax.lax.with_sharding_constraint(ct, backward_sharding),))
  return f


def _saves_no_gathers(policy) -> bool:
  """Whether a ``checkpoint`` with this policy keeps none of a unit's gathered weights: no
  policy (nothing saved) or one that saves only matmul outputs."""
  named = (None, jax.checkpoint_policies.nothing_saveable,
           jax.checkpoint_policies.dots_saveable,
           jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  return any(policy is p for p in named)


def _rewrites_inside(step, direct) -> bool:
  """A loop or user rematerialization whose body uses a parameter or holds a matmul."""
  if step.primitive != "scan" and step.primitive not in REMAT:
    return False
  return any(direct) or any(e.primitive.name in amp_lib.LOW for e in inner_eqns(step.eqn))


def _memory_space(x):
  return getattr(jax.typeof(x), "memory_space", jax.memory.Space.Device)

