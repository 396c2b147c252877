"""ZeRO: the reference's numbers with sharded state, reduce-scatter, the wire bytes of DP."""

import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import epljax as epl
from epljax import hlo
from helpers import (MLP, TOL, assert_trees_close, classification_batch, linen_fns, momentum_grads,
                     reference_run)

N = 8
STEPS = 2
MODEL = MLP(hidden=64, classes=16)     # every leaf has a dimension divisible by 8


def wire_bytes(plan) -> float:
  """Bytes each device sends per step, ring algorithms: an all-reduce is a reduce-scatter
  plus an all-gather."""
  per = {"all-reduce": lambda b: 2 * (N - 1) / N * b, "reduce-scatter": lambda b: (N - 1) * b,
         "all-gather": lambda b: (N - 1) / N * b}
  return sum(per[c.kind](c.bytes) for c in plan.collectives)


def optimizer():
  return optax.sgd(0.1, momentum=0.9)   # its trace holds the first step's gradients


def run(config, micro=1, caplog=None):
  """Trains ``STEPS`` steps: (trainer, state, (first loss, first gradients), losses)."""
  epl.init({**config, "pipeline.num_micro_batch": micro})
  init_fn, loss_fn = linen_fns(MODEL)
  batch = classification_batch(64, classes=16)
  trainer = epl.Trainer(init_fn, loss_fn, optimizer())
  state = trainer.init(jax.random.key(0), batch)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  losses = []
  with jax.log_compiles():
    for _ in range(STEPS):
      state, metrics = trainer.train_step(state, batch)
      losses.append(metrics["loss"])
      if len(losses) == 1:
        grads = jax.tree.map(np.asarray, momentum_grads(trainer, state))   # before donation
  assert jax.tree.map(lambda x: x.sharding, state) == shardings
  return trainer, state, (losses[0], grads), losses


@pytest.fixture(scope="module")
def reference():
  epl.init()
  init_fn, loss_fn = linen_fns(MODEL)
  batch = classification_batch(64, classes=16)
  return {m: reference_run(init_fn, loss_fn, optimizer(), jax.random.key(0), batch, STEPS,
                           micro_batches=m) for m in (1, 4)}


@pytest.fixture(scope="module")
def dp():
  return run({})


# v2 without gradient accumulation compiles to v1's program (memory/zero.py): it is run with
# accumulation below. (1, 2): hybrid sharding (zero.shard_size=4), 2 groups of 4 replicas.
# v3 in 2 groups also runs the backward's refetch of GPUs and TPUs (a barrier over the stored
# shard alone, recompute.refetch) on CPU.
@pytest.mark.parametrize("level,groups", [("v1", 1), ("v3", 1), ("v1", 2), ("v3", 2)])
def test_matches_the_reference_with_sharded_state(level, groups, reference, dp, caplog,
                                                  monkeypatch):
  caplog.set_level(logging.WARNING)
  config = {"zero.level": level} if groups == 1 else {"zero.level": level,
                                                      "zero.shard_size": N // groups}
  seen = as_on_gpu(monkeypatch) if (level, groups) == ("v3", 2) else [None]
  trainer, state, (loss0, grads0), losses = run(config)
  assert seen
  history, expected = reference[1]
  np.testing.assert_allclose(loss0, history[0][0], **TOL)
  assert_trees_close(grads0, history[0][1])
  for step in range(STEPS):
    np.testing.assert_allclose(losses[step], history[step][0], **TOL)
  assert_trees_close(trainer.variables(state), expected)
  assert len([r for r in caplog.records if "Compiling" in r.getMessage()
              and "epl_step" in r.getMessage()]) <= 1

  plan, base = trainer.plan, dp[0].plan
  p, shards = base.param_bytes, N // groups
  assert plan.optimizer_bytes == base.optimizer_bytes // shards   # the momentum trace
  assert plan.param_bytes == (p // shards if level == "v3" else p)
  assert plan.grads_bytes == p // shards
  # Argument bytes: P + P/N with momentum (P/N + P/N with v3), besides the same batch and step.
  state_bytes = plan.param_bytes + plan.optimizer_bytes
  assert (plan.memory.argument_size_in_bytes - state_bytes
          == base.memory.argument_size_in_bytes - (p + base.optimizer_bytes))
  kinds = hlo.summarize(plan.collectives)
  assert kinds["reduce-scatter"][0] == 2                  # the two kernels' gradients
  assert kinds["all-gather"][1] >= p - 400                # parameters gathered (v3: per use)
  if groups == 1:
    assert kinds["all-reduce"][1] < 400                   # the loss and the biases only
    if level != "v3":   # v3 gathers in the forward pass and again for the backward matmul
      np.testing.assert_allclose(wire_bytes(plan), wire_bytes(base), rtol=0.03)
    assert any(f"ZeRO {level}" in f for f in plan.features)
  else:
    assert_hybrid(plan, level, groups)


def assert_hybrid(plan, level, groups):
  """Hybrid sharding: ZeRO's gathers and reduce-scatters stay inside a group (``data``), the
  kernels' gradient shards are all-reduced once across the groups (``replica``), as
  ``zero.hybrid_traffic`` says; the plan says so."""
  from epljax.memory import zero

  assert dict(plan.mesh.shape) == {"replica": groups, "data": N // groups, "stage": 1,
                                   "model": 1}
  by_axes = {}
  for c in plan.collectives:
    by_axes.setdefault((c.kind, c.axes), []).append(c)
  assert {a for k, a in by_axes if k in ("all-gather", "reduce-scatter")} == {"data"}
  (across,) = by_axes[("all-reduce", "replica")]
  # Besides: the loss, the biases' gradients (all-reduced over both, as GSPMD does for ZeRO
  # over data alone) and the step's finite flags.
  assert sum(c.bytes for (k, a), cs in by_axes.items() for c in cs
             if k == "all-reduce" and a != "replica") < 400
  kernels = [leaf for leaf in plan.leaves if len(leaf.shape) == 2]
  kernel_bytes = sum(4 * np.prod(leaf.shape) for leaf in kernels)
  rows = {(t.kind, t.axis): t for t in zero.hybrid_traffic(level, kernel_bytes, len(kernels),
                                                           N // groups, groups)}
  assert across.bytes == rows[("all-reduce", "replica")].bytes
  assert sum(c.bytes for c in by_axes[("reduce-scatter", "data")]) == \
      rows[("reduce-scatter", "data")].bytes
  text = str(plan)
  assert f"over 'data' inside each of {groups} groups (zero.shard_size)" in text
  assert "split over (replica, data)" in text
  assert re.search(r"all-reduce\s+replica\s+1\s", text), text


def test_with_gradient_accumulation_v2_keeps_the_accumulator_sharded(reference):
  history, expected = reference[4]
  temps = {}
  for level in ["v1", "v2"]:
    trainer, state, (loss0, grads0), losses = run({"zero.level": level}, micro=4)
    np.testing.assert_allclose(loss0, history[0][0], **TOL)
    assert_trees_close(grads0, history[0][1])
    for step in range(STEPS):
      np.testing.assert_allclose(losses[step], history[step][0], **TOL)
    assert_trees_close(trainer.variables(state), expected)
    temps[level] = trainer.plan.memory.temp_size_in_bytes
    kinds = hlo.summarize(trainer.plan.collectives)
    # v1 accumulates whole gradients as data parallelism does, then keeps its shard; v2
    # reduce-scatters each micro batch's gradient inside the loop.
    assert ("reduce-scatter" in kinds) == (level == "v2")
  assert temps["v2"] < temps["v1"]


def test_unshardable_leaves_stay_replicated_and_are_listed():
  epl.init({"zero.level": "v1"})
  init_fn, loss_fn = linen_fns(MLP(hidden=64, classes=10))
  trainer = epl.Trainer(init_fn, loss_fn, optax.adam(1e-2))
  trainer.init(jax.random.key(0), classification_batch(64))
  assert any("not sharded (no dimension divisible by the data axis): Dense_1/bias (10,)" in f
             for f in trainer.plan.features)


def test_hybrid_shard_size_errors_and_hosts():
  """zero.shard_size: a bad value names the key and what is allowed; a size that does not
  divide the replicas says which do; 'host' is the replicas one host holds (all of them on
  one host: no groups)."""
  from types import SimpleNamespace

  from epljax.mesh import group_size

  for bad in ("rack", 0):
    with pytest.raises(epl.ConfigError, match=r"'zero.shard_size' .* must be 'all', 'host' or "
                       r"a positive number"):
      epl.Config({"zero.shard_size": bad})
  with pytest.raises(epl.PlanError, match=r"zero.shard_size=3 does not divide the 8 data "
                     r"replicas .* Use a divisor of 8 \(1, 2, 4, 8\), 'host' or 'all'"):
    group_size(3, 8, 1, jax.devices())
  hosts = [SimpleNamespace(process_index=i // 4) for i in range(8)]
  assert group_size("host", 8, 1, hosts) == 4          # 2 hosts of 4: groups of 4 replicas
  assert group_size("host", 4, 2, hosts) == 2          # replicas of 2 devices: 2 per host
  assert group_size("host", 8, 1, jax.devices()) == 8  # one host: one group, no replica axis
  with pytest.raises(epl.PlanError, match=r"a host holds 4 devices, which is not a whole number "
                     r"of model replicas of 8 devices"):
    group_size("host", 2, 8, [SimpleNamespace(process_index=i // 4) for i in range(16)])


def test_hybrid_by_host_keeps_zero_inside_each_host_of_a_two_host_cluster():
  """zero.shard_size='host' on 2 hosts of 4 compile-only H100s: ZeRO's gathers and
  reduce-scatters run over 'data' inside a host, the gradient shards' all-reduce over 'replica'
  is the one collective that crosses hosts."""
  from test_aot import needs_plugin

  if needs_plugin.args[0]:
    pytest.skip(needs_plugin.kwargs["reason"])
  epl.init({"zero.level": "v3", "zero.shard_size": "host"},
           devices=epl.topology("h100", hosts=2, per_host=4))
  init_fn, loss_fn = linen_fns(MODEL)
  plan = epl.Trainer(init_fn, loss_fn, optax.adam(1e-2)).compile(
      classification_batch(64, classes=16))
  assert dict(plan.mesh.shape) == {"replica": 2, "data": 4, "stage": 1, "model": 1}
  rows = {(c.kind, c.axes, c.crosses_hosts) for c in plan.collectives}
  assert {("all-gather", "data", False), ("reduce-scatter", "data", False),
          ("all-reduce", "replica", True)} <= rows, rows
  assert {r for r in rows if r[2]} <= {("all-reduce", "replica", True),
                                       ("all-reduce", "replica+data", True)}, rows


def test_invalid_level_lists_the_valid_ones():
  with pytest.raises(epl.ConfigError, match=r"'zero.level' .* must be one of '', 'v1', 'v2', "
                     r"'v3'; got 'v4'"):
    epl.Config({"zero.level": "v4"})


@pytest.mark.slow
def test_two_workers_of_two_devices_with_zero_and_checkpointing(tmp_path):
  """EPL ran ZeRO with one GPU per worker only: here 2 processes x 2 devices, with
  gradient checkpointing, train like one device (launcher, CPU collectives over gloo)."""
  import json
  import os
  import subprocess
  import sys

  here = os.path.dirname(__file__)
  out_file = tmp_path / "zero.json"
  env = {k: v for k, v in os.environ.items() if not k.startswith(("EPL_", "XLA_FLAGS"))}
  env.update(EPL_ZERO_LEVEL="v2", EPL_GRADIENT_CHECKPOINT_TYPE="auto")
  done = subprocess.run(
      [sys.executable, "-m", "epljax.launch", "--num_workers", "2", "--gpu_per_worker", "2",
       os.path.join(here, "launch_scripts", "train_dp.py"), str(out_file)],
      cwd=os.path.dirname(here), env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stdout + done.stderr
  result = json.loads(out_file.read_text())
  assert result["cluster"] == [2, 0, 4, 2] and result["replicas"] == 4
  init_fn, loss_fn = linen_fns(MLP())
  history, expected = reference_run(init_fn, loss_fn, optax.adamw(1e-2), jax.random.key(0),
                                    classification_batch(32), 3)
  np.testing.assert_allclose(result["losses"], [h[0] for h in history], **TOL)
  trained = jax.tree.map(np.asarray, result["params"], is_leaf=lambda x: isinstance(x, list))
  assert_trees_close(trained, expected["params"])
  config = epl.Config(environ={k: v for k, v in env.items() if k.startswith("EPL_")})
  assert (config.zero.level, config.gradient_checkpoint.type) == ("v2", "auto")


def test_gpu_and_tpu_refetch_does_not_wait_for_the_cotangent():
  """The backward pass places a stored parameter again; on CPU only after its cotangent
  exists (XLA:CPU would merge it with the forward's copy), elsewhere behind a barrier over the
  stored value alone, so the scheduler may fetch it ahead of its use."""
  from epljax.memory.recompute import refetch
  w, ct = np.ones((4, 4), np.float32), np.ones((2, 4), np.float32)
  for platform, operands in (("cpu", 2), ("gpu", 1), ("tpu", 1)):
    jaxpr = jax.make_jaxpr(lambda w, ct, p=platform: refetch((w,), ct, platform=p))(w, ct)
    (barrier,) = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barrier.invars) == operands, (platform, barrier)
    assert barrier.invars[0] is jaxpr.jaxpr.invars[0]


def as_on_gpu(monkeypatch) -> list:
  """ZeRO's per-use rewrite places a stored weight again in the backward as on GPU and TPU;
  returns the platforms it was asked for (one entry per refetch)."""
  from epljax.memory import uses
  real, seen = uses.refetch, []

  def refetch(stored, cts, *, platform):
    seen.append(platform)
    return real(stored, cts, platform="gpu")

  monkeypatch.setattr(uses, "refetch", refetch)
  return seen


def test_zero3_gathers_weights_in_the_compute_dtype():
  """Under mixed precision a ZeRO v3 weight is cast to bfloat16 before its all-gather (half
  the bytes): every gather of a kernel in the lowered step is bfloat16, and the run is the
  mixed-precision run without ZeRO at bfloat16's tolerance, as test_memory_amp compares (the
  reduce-scatter sums the bfloat16 products in another order). XLA:CPU computes bfloat16
  collectives in float32, so the compiled bytes are read on XLA:GPU (tests/test_aot.py)."""
  import re

  from test_memory_amp import LOSS_RTOL, assert_close_in_bf16

  batch = classification_batch(32)
  init_fn, loss_fn = linen_fns(MLP())
  runs = {}
  for name, config in (("amp", {"amp.level": "O1", "amp.loss_scale": 1.0}),
                       ("zero", {"amp.level": "O1", "amp.loss_scale": 1.0, "zero.level": "v3"})):
    epl.init(config)
    trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1, momentum=0.9))
    state = trainer.init(jax.random.key(0), batch)
    text = trainer.lower(state, batch).as_text()
    losses = []
    for _ in range(2):
      state, metrics = trainer.train_step(state, batch)
      losses.append(float(metrics["loss"]))
    runs[name] = (losses, trainer.variables(state)["params"], text, trainer.plan)
  np.testing.assert_allclose(runs["zero"][0], runs["amp"][0], rtol=LOSS_RTOL)
  assert_close_in_bf16(runs["zero"][1], runs["amp"][1])
  text, plan = runs["zero"][2], runs["zero"][3]
  kernels = {"x".join(map(str, leaf.shape)) for leaf in plan.leaves if len(leaf.shape) == 2}
  # A constraint to the whole (replicated) layout is the gather at a use.
  gathered = re.findall(r"sharding_constraint %\S+ <@mesh, \[\{\}(?:, \{\})*\]> : "
                        r"tensor<([\dx]+)x(\w+)>", text)
  dtypes = {(shape, dtype) for shape, dtype in gathered if shape in kernels}
  assert {shape for shape, _ in dtypes} == kernels and {d for _, d in dtypes} == {"bf16"}, dtypes


class _TinyLM(nn.Module):
  """An embedding and an LM head of a 256-token vocabulary around one small layer; with
  ``tied`` the head reads the embedding table transposed (``Embed.attend``, GPT-2's head)."""
  tied: bool = False

  @nn.compact
  def __call__(self, ids):
    embed = nn.Embed(256, 16)
    x = jnp.tanh(nn.Dense(16)(embed(ids)))
    return embed.attend(x) if self.tied else nn.Dense(256, use_bias=False)(x)


@pytest.mark.parametrize("tied", [False, True])
def test_zero3_leaves_vocabulary_sized_weights_sharded_where_their_inputs_are_smaller(tied):
  """ZeRO v3 at 8 rows of 4 tokens: the embedding table (256 x 16, split along its 256 rows)
  and the LM head (16 x 256, split along the vocabulary), or one table serving as both
  (``tied``: looked up, then read transposed), are never gathered; the ids, the activations and
  their gradients move instead (memory/routes.py), and the whole step moves fewer bytes than
  one gather of the head would. Same numbers as the reference."""
  from models.common import lm_fns, token_batch

  init_fn, loss_fn = lm_fns(_TinyLM(tied))
  batch = token_batch(8, 4, 256)
  optimizer = optax.sgd(0.1, momentum=0.9)   # its trace holds the first step's gradients
  history, expected = reference_run(init_fn, loss_fn, optimizer, jax.random.key(0), batch,
                                    STEPS)
  epl.init({"zero.level": "v3"})
  trainer = epl.Trainer(init_fn, loss_fn, optimizer)
  state = trainer.init(jax.random.key(0), batch)
  for step in range(STEPS):
    state, metrics = trainer.train_step(state, batch)
    np.testing.assert_allclose(metrics["loss"], history[step][0], **TOL)
    if step == 0:
      assert_trees_close(momentum_grads(trainer, state), history[0][1])
  assert_trees_close(trainer.variables(state), expected)

  left = "1 used sharded" if tied else "2 used sharded"
  assert any(left in f for f in trainer.plan.features), trainer.plan.features
  found = hlo.executed_collectives(trainer.plan.compiled.as_text())
  gathered = {s for c in found if c.kind == "all-gather" for s in c.shapes}
  assert not gathered & {"f32[256,16]", "f32[16,256]"}, gathered
  assert sum(c.bytes for c in found) < 16 * 256 * 4, found
