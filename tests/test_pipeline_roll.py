"""A stage's repeated layers as one scan (``pipeline/roll.py``) and the parameter exchange
(``pipeline/storage.py``): the compiled pipeline does not grow with depth, and stays exact."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.extend import core as jcore

import epljax as epl
from epljax import hlo
from epljax.pipeline import packing, roll
from epljax.pipeline.roll import Run, roll_repeats
from helpers import classification_batch, linen_fns
from pipeline_helpers import Stack, check_matches_reference


def _stack(leaves, stacks):
  """A rolled program's parameter inputs: the leaves, then each stack (``Rolled.stacks``)."""
  return [*leaves, *(jnp.stack([leaves[i] for i in rows]) for rows in stacks)]


def _params(blocks, width=8, seed=0):
  keys = jax.random.split(jax.random.key(seed), 2 * blocks)
  return [(jax.random.normal(keys[2 * k], (width, width)) * 0.3,
           jax.random.normal(keys[2 * k + 1], (width,)) * 0.1) for k in range(blocks)]


def _residual(params, x):
  h = x @ jnp.ones((x.shape[1], 8)) * 0.1
  for w, b in params:
    h = h + jnp.tanh(h @ w + b)
  return jnp.sum(h ** 2)


def _rolled_and_plain(fn, params, x):
  """The rolled program of ``fn(params, x)`` (its stacks made from the parameters' leaves, as
  the pipeline makes them), its run, and both programs' results.

  Both programs are compiled, as the pipeline compiles them: on jax 0.12 the plain program
  evaluated one equation at a time rounds differently from its own compiled form, and a
  cancelling sum turns that float32 rounding into a relative difference above 1e-6 that says
  nothing about rolling. Compiled, the two agree to the last bit on jax 0.10 and 0.12."""
  closed = jax.make_jaxpr(fn)(params, x)
  n = len(jax.tree.leaves(params))
  rolled = roll_repeats(closed, n)
  leaves, rest = jax.tree.leaves(params), jax.tree.leaves(x)
  got = jax.jit(jcore.jaxpr_as_fun(rolled.jaxpr))(*_stack(leaves, rolled.stacks), *rest)
  return rolled.jaxpr, rolled.run, got, jax.jit(jcore.jaxpr_as_fun(closed))(*leaves, *rest)


def test_layers_written_in_a_loop_become_one_scan_with_the_same_result():
  x = jax.random.normal(jax.random.key(1), (4, 6))
  rolled, run, got, want = _rolled_and_plain(_residual, _params(5), x)
  assert run is not None and run.repeats == 5, run
  scans = [e for e in rolled.jaxpr.eqns if e.primitive.name == "scan"]
  assert [e.params["length"] for e in scans] == [5]
  outside = [e for e in rolled.jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(outside) == 1, "only the stem's matmul stays outside the scan"
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # And its derivative, which is what the pipeline's stages take.
  stacks = roll_repeats(jax.make_jaxpr(_residual)(_params(5), x), 10).stacks
  g_rolled = jax.grad(lambda p, x: jcore.jaxpr_as_fun(rolled)(
      *_stack(jax.tree.leaves(p), stacks), x)[0])(_params(5), x)
  g_plain = jax.grad(_residual)(_params(5), x)
  for a, b in zip(jax.tree.leaves(g_rolled), jax.tree.leaves(g_plain)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_value_read_two_layers_later_is_not_a_loop():
  def dense_skips(params, x):     # layer k reads layers k-1 and k-2: no single carry
    prev, h = x, x
    for w, b in params:
      prev, h = h, jnp.tanh(h @ w + b) + prev
    return h      # compared element by element: their sum cancels to a twentieth of its terms

  x = jax.random.normal(jax.random.key(1), (4, 8))
  rolled, run, got, want = _rolled_and_plain(dense_skips, _params(4), x)
  # Not a loop of one layer; a loop of two (its carry is both values) is.
  assert run is not None and run.repeats == 2 and run.length == 2 * 5, run
  np.testing.assert_allclose(got, want, rtol=1e-6)
  if run is not None:   # only a stretch whose dataflow is a loop's may be rolled
    assert isinstance(run, Run) and run.repeats >= 2


def test_shared_weights_are_closed_over_not_stacked():
  w, b = _params(1)[0]
  x = jax.random.normal(jax.random.key(1), (4, 6))
  rolled, run, got, want = _rolled_and_plain(lambda p, x: _residual([p] * 4, x), (w, b), x)
  assert run is not None and run.repeats == 4
  np.testing.assert_allclose(got, want, rtol=1e-6)


def _step_text(stages, layers, **config):
  """(trainer, compiled step text) of ``Stack(stages, layers)`` trained against the reference;
  built once (the tests only read them): the tests below ask for 8, 5 of them distinct
  (``pipeline.roll_layers`` is on by default)."""
  trainer, compiled = _step(stages, layers, **config)
  return trainer, compiled.as_text()


def _step(stages, layers, **config):
  """(trainer, compiled step) of ``_step_text``'s model."""
  config = {"pipeline.roll_layers": True, **config}
  return _step_of(stages, layers, tuple(sorted(config.items())))


@functools.cache
def _step_of(stages, layers, config):
  epl.init({"pipeline.num_micro_batch": 4, **dict(config)})
  batch = classification_batch(32)
  model = Stack(stages=stages, layers=layers, width=32)
  if stages == 1:   # no pipeline: the same model trained data-parallel
    init_fn, loss_fn = linen_fns(model)
    trainer = epl.Trainer(init_fn, loss_fn, optax.adam(1e-2))
    state = trainer.init(jax.random.key(0), batch)
  else:
    trainer, state = check_matches_reference(model, batch, optax.adam(1e-2))
  return trainer, trainer.lower(state, batch).compile()


def _moves(text):
  return sorted(c.kind for c in hlo.collectives(text)
                if c.kind in ("all-to-all", "all-gather", "collective-permute"))


def test_parameters_reach_their_stage_in_one_all_to_all_whatever_the_depth():
  _, text_2 = _step_text(2, 2)
  _, text_6 = _step_text(2, 6)
  # One all-to-all per dtype each way moves the parameters and their gradients (not one gather
  # per leaf); the loop's two permutes carry activations and their gradients.
  assert _moves(text_6).count("all-to-all") == 2, _moves(text_6)
  assert _moves(text_2) == _moves(text_6)


def test_rolled_layers_stay_exact_and_the_program_grows_slower_than_unpipelined():
  shallow, text_2 = _step_text(2, 2, **{"pipeline.roll_layers": True})
  deep, text_6 = _step_text(2, 6, **{"pipeline.roll_layers": True})
  plan = str(deep.plan)
  assert "6 x " in plan and "loop" in plan, plan
  assert _moves(text_2) == _moves(text_6)
  # 8 more layers add less program than they add to the same model without stages (its
  # optimizer and checks grow per leaf in both; the layers themselves only there).
  _, dp_4 = _step_text(1, 4)
  _, dp_12 = _step_text(1, 12)
  assert len(text_6) - len(text_2) < 0.8 * (len(dp_12) - len(dp_4)), (
      len(text_2), len(text_6), len(dp_4), len(dp_12))


def test_rolled_layers_hold_no_more_than_written_out_ones():
  # The stacks are made outside each stage's derivative, so the stash holds what the
  # written-out layers' stash held: the same residual buffers, and no stacked weights among
  # them. The backward reads each layer's weights from the parameter buffer and adds each
  # layer's gradient into the accumulator in place (roll.vjp), so it holds no stack either:
  # with jax's own derivative of the scan this step's temp was 1.20x the written-out one's.
  kept, temp = {}, {}
  for roll_on in (False, True):
    trainer, compiled = _step(2, 6, **{"pipeline.roll_layers": roll_on})
    pipe = trainer.plan.pipeline
    kept[roll_on] = (pipe.loop.buffers.residuals, [s.rolled is not None for s in pipe.stages])
    temp[roll_on] = compiled.memory_analysis().temp_size_in_bytes
  assert kept[True][1] == [True, True] and kept[False][1] == [False, False]
  assert kept[True][0] == kept[False][0], kept
  assert temp[True] <= 1.05 * temp[False], temp


def test_a_block_reading_a_weight_made_inside_the_stage_stays_unrolled_and_says_why():
  def scaled_first(params, x):    # the weights are computed before the layers read them
    h, ws = x, [(w * 2.0, b) for w, b in params]
    for w, b in ws:
      h = h + jnp.tanh(h @ w + b)
    return jnp.sum(h)

  x = jax.random.normal(jax.random.key(1), (4, 8))
  rolled, run, got, want = _rolled_and_plain(scaled_first, _params(4), x)
  assert run is None and rolled is not None
  np.testing.assert_allclose(got, want, rtol=1e-6)
  closed = jax.make_jaxpr(scaled_first)(_params(4), x)
  assert "4 x 5 ops left unrolled" in roll_repeats(closed, 8).why_not


class _ScaledFirst(nn.Module):
  """Two stages whose layers read kernels all computed before the first layer runs: stacking
  them would copy values made inside the stage, so the stages stay unrolled."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16)(x)
    for s in range(2):
      epl.set_default_strategy(epl.replicate(1))
      kernels = [self.param(f"k{s}{i}", nn.initializers.normal(0.1), (16, 16)) * 0.5
                 for i in range(3)]
      for k in kernels:
        h = h + jnp.tanh(h @ k)
    return nn.Dense(10)(h)


def test_a_stage_left_unrolled_says_why_in_the_plan():
  epl.init({"pipeline.num_micro_batch": 4})
  trainer, _ = check_matches_reference(_ScaledFirst(), classification_batch(32), optax.sgd(0.1))
  plan = str(trainer.plan)
  assert "left unrolled: each block reads a float32[16,16] made inside the stage" in plan, plan
  assert all(s.rolled is None for s in trainer.plan.pipeline.stages)


def test_a_stages_stacks_sit_side_by_side_at_the_same_offsets_in_every_stage():
  # storage.placement: each stack's rows one contiguous range (one slice unpacks it, its
  # gradient goes back as one piece), at the same offsets in every stage of the same layers,
  # so the stages' branches share their compiled kernels.
  trainer, _ = _step_text(2, 6, **{"pipeline.roll_layers": True})
  pipe = trainer.plan.pipeline
  offsets = []
  for stage, layout in zip(pipe.stages, pipe.store.layouts):
    assert len(stage.stacks) > 1
    assert all(layout.side_by_side(rows, stage.stacks) for rows in stage.stacks)
    offsets.append([layout.entries[rows[0]].offset for rows in stage.stacks])
  assert offsets[0] == offsets[1] and offsets[0][0] == 0, offsets


@pytest.mark.parametrize("shape, dim", [((5, 3), None), ((5, 8), 1)])
def test_a_stack_unpacked_and_accumulated_in_one_piece_matches_its_rows(shape, dim):
  pieces, k = 4, 3
  avals = [jax.ShapeDtypeStruct(shape, jnp.float32)] * k + [jax.ShapeDtypeStruct((7,), jnp.float32)]
  layout = packing.Layout.of(avals, pieces, [dim] * k + [None], order=[3, 0, 1, 2])
  stacks = ((0, 1, 2),)
  assert layout.side_by_side(stacks[0], stacks)
  assert not layout.side_by_side((2, 1, 0), ((2, 1, 0),))
  keys = jax.random.split(jax.random.key(0), 7)
  values = [jax.random.normal(key, a.shape) for key, a in zip(keys, avals)]
  types = {"float32": pieces * max(e.offset + e.size for e in layout.entries) + pieces}
  buffers = layout.pack(values, types)
  *leaves, stacked = layout.unpack_stacked(buffers, layout.stacks_of(stacks))
  np.testing.assert_array_equal(stacked, jnp.stack(values[:k]))
  for got, want in zip(leaves, values):
    np.testing.assert_array_equal(got, want)
  # Gradients: the stack's, and leaf 1 also read outside the stack (``direct``); the other
  # rows' own gradients are zeros, as a rolled program's are.
  g_stack = jax.random.normal(keys[4], (k, *shape))
  own = [jnp.zeros(shape), jax.random.normal(keys[5], shape), jnp.zeros(shape),
         jax.random.normal(keys[6], (7,))]
  acc = {"float32": jnp.full((types["float32"],), 0.5)}
  got = layout.accumulate(acc, [*own, g_stack], types, layout.stacks_of(stacks, frozenset({1})))
  want = layout.accumulate(acc, [o + g for o, g in zip(own, g_stack)] + [own[3]], types)
  np.testing.assert_allclose(got["float32"], want["float32"], rtol=0, atol=1e-6)
  # A layer at a time (the rolled backward, roll.vjp): each row read, and its gradient added
  # in place; then the rest, a value at a time (values left out are not touched).
  assert layout.uniform(stacks[0])
  for j in range(k):
    np.testing.assert_array_equal(layout.row(buffers, stacks[0], jnp.int32(j)), values[j])
  rows = acc
  for j in reversed(range(k)):
    rows = layout.add_row(rows, stacks[0], jnp.int32(j), g_stack[j] + own[j])
  got = layout.add_each(rows, [None, None, None, own[3]])
  np.testing.assert_allclose(got["float32"], want["float32"], rtol=0, atol=1e-6)
  assert layout.pack([None, values[1], None, None], types)["float32"].reshape(pieces, -1)[
      :, :layout.entries[0].offset + layout.entries[0].size].sum() == 0


def test_a_rolled_program_differentiated_a_layer_at_a_time_matches_jax_vjp():
  # roll.vjp: the steps after the scan, a reverse scan of each layer's pullback (reading its
  # weights and adding its gradient where the caller says), the steps before; a weight read
  # outside the stack as well (``w0`` below, ``direct``) gets both gradients.
  def model(params, x):
    h = x @ params[0][0]
    for w, b in params:
      h = h + jnp.tanh(h @ w + b)
    return h

  params, x = _params(5), jax.random.normal(jax.random.key(1), (4, 8))
  leaves = jax.tree.leaves(params)
  closed = jax.make_jaxpr(lambda *a: model(jax.tree.unflatten(jax.tree.structure(params),
                                                               a[:10]), a[10]))(*leaves, x)
  rolled = roll_repeats(closed, 10)
  assert rolled.run is not None
  fun = jcore.jaxpr_as_fun(rolled.jaxpr)
  primals = (tuple(_stack(leaves, rolled.stacks)), (x,))
  f = lambda p, a: ((tuple(fun(*p, *a)), jnp.zeros(())), ())  # noqa: E731
  ct = ((jax.random.normal(jax.random.key(2), (4, 8)),), jnp.zeros(()))
  stacks = range(10, 10 + len(rolled.stacks))

  def layered():
    _, pull, _ = roll.vjp(f, primals, stacks)
    assert isinstance(pull, roll.LayeredPull)
    add = lambda acc, j, l, g: [a.at[l].add(g) if i == j else a  # noqa: E731
                                for i, a in enumerate(acc)]
    (g_p, g_a), acc = pull.backward(ct, lambda j, l: primals[0][stacks[j]][l], add,
                                    [jnp.zeros_like(primals[0][i]) for i in stacks])
    assert all(g_p[i] is None for i in stacks)
    return g_p[:10], g_a, acc

  g_p, g_a, acc = jax.jit(layered)()
  want_p, want_a = jax.jit(lambda: jax.vjp(f, *primals, has_aux=True)[1](ct))()
  np.testing.assert_array_equal(g_a[0], want_a[0])
  for j, i in enumerate(stacks):
    np.testing.assert_array_equal(acc[j], want_p[i])
  for got, want in zip(g_p, want_p[:10]):
    np.testing.assert_array_equal(got, want)
