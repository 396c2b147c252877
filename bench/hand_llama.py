"""Hand-written steps of the zoo's Llama, what ``bench/scale.py`` holds epljax's against where
the generic ``hand_layouts`` programs are not what a user writes: FSDP that gathers each layer's
kernels inside the scan (``llama_fsdp_loss``), and tensor x pipeline x data, a GPipe as a
``shard_map`` over the ``stage`` and ``data`` axes, ``model`` left to GSPMD (``llama_loss``).

GPipe:
Mesh ``data x stage x model`` (``model`` innermost: a stage's tensor-parallel devices on one
host). The scanned layers' leading axis is split over ``stage`` (stage ``s`` holds layers
``s*L/S .. (s+1)*L/S - 1``) and their other dimensions by the Megatron specs; the embedding, the
final norm and the head are Megatron-split and held by every stage. The forward: the embedding,
``M`` micro batches through ``M + S - 1`` ticks (stage 0 takes micro batch ``t``, the others
what their neighbour sent at ``t - 1``; every layer rematerialized as the model does), the last
stage's outputs broadcast over ``stage`` by a ``psum``, then the head and the loss. The backward
is jax's transpose of that (all forwards, then all backwards: GPipe).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import hand_layouts
from hand_layouts import Figures


def _layer_fn(size):
  """One rematerialized Llama layer as a function of ``(activation, its parameters)``."""
  from models import llama

  layer = llama.Layer(size)
  return jax.checkpoint(lambda h, p: layer.apply({"params": p}, h, None)[0], prevent_cse=False)


def _loss_around(size, layers_fn):
  """The Llama's loss with ``layers_fn(layers, x)`` in place of its scanned layers."""
  from models import llama
  from models.common import lm_loss

  def loss(params, batch):
    s = size
    x = nn.Embed(s.vocab, s.d_model, dtype=s.dtype).apply({"params": params["embed"]},
                                                           batch["x"])
    y = llama.RMSNorm().apply({"params": params["final_norm"]}, layers_fn(params["layers"], x))
    logits = nn.Dense(s.vocab, use_bias=False, dtype=s.dtype).apply(
        {"params": params["head"]}, y)
    return lm_loss(logits.astype(jnp.float32), batch["y"])

  return loss


def llama_fsdp_loss(size, mesh: Mesh):
  """FSDP as JAX users write it by hand: each layer's kernels cast to the compute dtype and
  gathered (a replicated sharding constraint) inside the rematerialized layer, so that the
  backward gathers them again instead of keeping every layer's whole; rows over ``data``."""
  from models import llama

  layer = llama.Layer(size)
  rows = NamedSharding(mesh, P("data"))
  whole = NamedSharding(mesh, P())

  def gathered(p):
    p = p.astype(size.dtype) if p.ndim >= 2 else p   # kernels; norm scales stay float32
    return jax.lax.with_sharding_constraint(p, whole)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def run(h, params):
    return layer.apply({"params": jax.tree.map(gathered, params)}, h, None)[0]

  def layers_fn(layers, x):
    def one(h, params):
      return jax.lax.with_sharding_constraint(run(h, params), rows), None
    return jax.lax.scan(one, jax.lax.with_sharding_constraint(x, rows), layers)[0]

  return _loss_around(size, layers_fn)


def llama_loss(size, mesh: Mesh, stages: int, micro: int):
  """``loss(params, batch)`` of ``llama.Llama(size)`` pipelined over ``mesh``'s ``stage``."""
  run = _layer_fn(size)

  def run_layers(layers, h):
    return jax.lax.scan(lambda h, p: (run(h, p), None), h, layers)[0]

  def stage_loop(layers, x):   # x: (micro, replica rows, length, d), the same on every stage
    # The float32 weights made varying over ``data`` here, so their gradients are summed over
    # it once, in float32, as they leave the loop (left to the use, the sum fell on each
    # layer's bfloat16 cotangent at every tick).
    layers = jax.lax.pcast(layers, "data", to="varying")
    stage = jax.lax.axis_index("stage")
    state, outs = jnp.zeros_like(x[0]), jnp.zeros_like(x)
    for t in range(micro + stages - 1):
      out = run_layers(layers, jnp.where(stage == 0, x[min(t, micro - 1)], state))
      if t >= stages - 1:
        outs = outs.at[t - stages + 1].set(out)
      state = jax.lax.ppermute(out, "stage", [(i, i + 1) for i in range(stages - 1)])
    return jax.lax.psum(jnp.where(stage == stages - 1, outs, 0), "stage")

  # Manual over ``data`` too: each replica runs its own rows through the stages (left to
  # GSPMD, the activations entered the loop whole on every replica and each replica computed
  # the whole batch); the layers' gradients are summed over ``data`` by the transpose.
  pipeline = jax.shard_map(stage_loop, mesh=mesh, in_specs=(P("stage"), P(None, "data")),
                           out_specs=P(None, "data"), axis_names=frozenset({"stage", "data"}))

  def layers_fn(layers, x):   # micro batch m: rows m, m + M, ... (a replica's rows stay its own)
    rows, length, d = x.shape
    out = pipeline(layers, x.reshape(rows // micro, micro, length, d).swapaxes(0, 1))
    return out.swapaxes(0, 1).reshape(x.shape)

  return _loss_around(size, layers_fn)


def fsdp(size, optimizer, variables, batch, devices: list) -> Figures:
  """``hand_layouts.fsdp``'s parameter layout with ``llama_fsdp_loss``."""
  mesh = Mesh(np.asarray(devices), ("data",))
  loss = llama_fsdp_loss(size, mesh)
  return hand_layouts.compile_hand(
      lambda v, b: loss(v["params"], b), optimizer, variables, batch, mesh,
      lambda _, shape: hand_layouts.fsdp_spec(shape, len(devices)), ("data",))


def gpipe(size, optimizer, variables, batch, devices: list, tp: int, stages: int, micro: int,
          megatron: dict) -> Figures:
  """The compiled hand step's figures (``hand_layouts.compile_hand`` with the pipelined loss
  and the layers' leading axis over ``stage``)."""
  data = len(devices) // (tp * stages)
  mesh = Mesh(np.asarray(devices).reshape(data, stages, tp), ("data", "stage", "model"))
  loss = llama_loss(size, mesh, stages, micro)

  def spec_of(path, _):
    spec = hand_layouts.megatron_spec("params/" + path, megatron)
    if path.startswith("layers/"):
      return P("stage", *tuple(spec)[1:])
    return spec

  return hand_layouts.compile_hand(lambda v, b: loss(v["params"], b), optimizer, variables,
                                   batch, mesh, spec_of, ("data",))
