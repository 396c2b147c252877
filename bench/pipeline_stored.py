"""epljax's pipeline step with its parameters stored as its loop reads them, against today's
step and the hand-written GPipe: the prototype of ``pipeline.param_layout='stage'``, kept for
its records (the library's layout is measured by ``bench/pipeline_memory.py``).

    python bench/pipeline_stored.py            # XLA:CPU, 8 simulated devices
    python bench/pipeline_stored.py --gpu      # 8 compile-only H100s (v312 venv, JAX_PLATFORMS=cpu)
    python bench/pipeline_stored.py --record   # and record the table in bench/RESULTS.md
    python bench/pipeline_stored.py --slots    # the stages' parameters in whole-leaf slots

Today the train state holds every user leaf split over ``stage`` and the step packs them into
each stage's buffers (``ParamStore.pack``, an ``all_to_all``) for its loop, so a stage's
parameters are held twice while the loop runs. The prototype here is built from the same plan's
pieces (``runtime.pipelined_gradients`` over ``Pipeline.loop``, the plan's ``ParamStore``): its
donated arguments are the loop's buffers and the optimizer state in the user's tree (as stored
today); after the loop the buffers and their gradients are moved into the user's leaves
(``ParamStore.gradients_of``, the transpose of ``pack``: a model without tied leaves), AdamW
updates those, and the new leaves are packed back. "+ optimizer on buffers" goes one step
further: AdamW's state is kept as the buffers too and AdamW updates the buffers in place of the
user's tree (exact for an elementwise optimizer like AdamW, not for one that reads a leaf's
shape or path: what ``store_layouts.py``'s (dl) does for the hand-written GPipe). Same model,
mesh, cut and schedule as ``pipeline_memory.py`` (GPipe); peak bytes per device from
``memory_analysis()``, compiled from shapes. (An ``optimization_barrier`` after the loop
changed nothing on either compiler.)

``--slots`` builds every variant, today's step included, with the stages' parameters in
whole-leaf slots instead of packed pieces: the store tensor-parallel stages use
(``ParamStore.slotted``, ``packing.assign``), forced on for this model by giving
``storage.make_store`` a split of 2 (its only use of the split). A weight gradient then has a
whole array of its own to be added into, which XLA:GPU compiles as the epilogue of the
gradient's matmul, in place, as it does for the hand-written GPipe's per-leaf accumulators
(a packed buffer's pieces cannot be a matmul's output). With the optimizer on the slots too,
the stored state is one whole array per leaf and stage, what AdamW would see in the user's
tree; the slots of a stage's rolled layers are stacked per tick (the ``stack`` in the
backward), which the 8-layer row pays today.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import epljax as epl  # noqa: E402
import pipeline_memory as pm  # noqa: E402
from epljax import batch as batch_lib  # noqa: E402
from epljax.pipeline import runtime  # noqa: E402
from gpu_aot import as_devices  # noqa: E402

CASES = ((8, 512, 8), (4, 1024, 4), (4, 256, 4))   # (layers, width, M), GPipe


def stored_bytes(layers: int, width: int, micro: int, devices
                 ) -> tuple[pm.Bytes, pm.Bytes, pm.Bytes]:
  """(today's epljax step, the stored-as-read prototype, it with the optimizer on the
  buffers), all compiled from shapes."""
  model = pm.GPT(layers, width)
  rows = {k: np.zeros(v.shape, v.dtype) for k, v in pm.batch_shapes(micro).items()}
  with as_devices(devices[:2 * pm.S]):
    epl.init({"pipeline.num_micro_batch": micro, "pipeline.num_stages": pm.S,
              "auto.auto_parallel": True, "pipeline.strategy": "PreferForward"})
    tx = optax.adamw(1e-3)
    trainer = epl.Trainer(lambda k, b: model.init(k, b["x"]),
                          lambda v, b: pm.ce(model.apply(v, b["x"]), b["y"]), tx)
    built = trainer._build(jax.random.key(0), rows)
    pipe, mesh = built.plan.pipeline, built.plan.mesh
    store, tree = pipe.store, pipe.params_def
    if pipe.shared:   # (gradients_of sums a tied leaf's stages: not an unpack then)
      raise ValueError(f"tied leaves {pipe.shared}: this prototype unpacks untied ones only")
    run = runtime.pipelined_gradients(pipe.loop, pipe.aux_avals, pipe.schedule, mesh,
                                      store.data_axes, P(None, pipe.batch_axes),
                                      manual=pipe._manual)
    bplan = batch_lib.BatchPlan(built.plan.num_replicas, micro, 1, pipe.batch_axes)
    leaves = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
              for a, s in zip(store.avals, store.shardings)]
    opt = jax.eval_shape(tx.init, jax.tree.unflatten(tree, leaves))
    opt_sh = pm.opt_shardings(tx, opt, jax.tree.unflatten(tree, list(store.shardings)), mesh)
    buffers = jax.eval_shape(lambda *ls: store.pack(list(ls)), *leaves)
    buffers_sh = jax.tree.map(lambda _: NamedSharding(mesh, P("stage")), buffers)

    def loop(buffers, batch):   # (loss, the buffers' gradients)
      micro_batches = batch_lib.micro_batches(batch, bplan, mesh)
      loss, _, grads, _ = run(buffers, pipe.pack_state({}), jax.tree.leaves(micro_batches),
                              jnp.ones((), jnp.float32))
      return loss, grads

    def compiled_step(step, opt, opt_sh):
      return pm.step_jit(step, buffers_sh, opt_sh, mesh).lower(
          pm.shaped(buffers, buffers_sh), pm.shaped(opt, opt_sh),
          pm.batch_args(micro, mesh, pipe.batch_axes)).compile()

    def step(buffers, opt, batch):
      loss, grads = loop(buffers, batch)
      grads = jax.tree.unflatten(tree, store.gradients_of(grads))
      params = jax.tree.unflatten(tree, store.gradients_of(buffers))
      updates, opt = tx.update(grads, opt, params)
      return store.pack(jax.tree.leaves(optax.apply_updates(params, updates))), opt, loss

    # The optimizer on the loop's buffers too: its state is AdamW's of the buffers (an
    # elementwise optimizer gives each element what it gives it in the user's tree).
    packed_opt = jax.eval_shape(tx.init, buffers)
    packed_opt_sh = jax.tree.map(
        lambda a: NamedSharding(mesh, P("stage") if a.ndim else P()), packed_opt)

    def packed_step(buffers, opt, batch):
      loss, grads = loop(buffers, batch)
      updates, opt = tx.update(grads, opt, buffers)
      return optax.apply_updates(buffers, updates), opt, loss

    compiled = compiled_step(step, opt, opt_sh)
    on_buffers = compiled_step(packed_step, packed_opt, packed_opt_sh)
    return (pm.Bytes.of(built.plan.compiled), pm.Bytes.of(compiled),
            pm.Bytes.of(on_buffers))


def whole_leaf_slots() -> None:
  """``--slots``: every pipeline store built with whole-leaf slots (see the module doc)."""
  from epljax.pipeline import storage

  make_store = storage.make_store

  def slotted(stages, avals, specs, paths, mesh, split, virtual):
    return make_store(stages, avals, specs, paths, mesh, [2] * len(split), virtual)

  storage.make_store = slotted


def rows(devices) -> list[list]:
  out, mib = [], lambda n: f"{n / 2**20:.1f}"  # noqa: E731
  for layers, width, micro in CASES:
    hand = pm.hand_bytes(layers, width, micro, devices)
    today, stored, packed = stored_bytes(layers, width, micro, devices)
    out.append([f"{layers} layers, width {width}, M={micro}, GPipe", mib(hand.peak),
                mib(today.peak), f"{today.peak / hand.peak:.2f}x", mib(stored.peak),
                f"**{stored.peak / hand.peak:.2f}x**", mib(stored.temp), mib(packed.peak),
                f"**{packed.peak / hand.peak:.2f}x**"])
    print(out[-1], flush=True)
  return out


HEADER = ["model, schedule", "hand GPipe MiB", "epljax today MiB", "today / hand",
          "stored as read MiB", "stored / hand", "stored temp MiB",
          "+ optimizer on buffers MiB", "+ optimizer / hand"]


def main(argv=None) -> None:
  from common import record, table
  args, devices, where = pm.cli(__doc__, argv, lambda parser: parser.add_argument(
      "--slots", action="store_true", help="stage parameters in whole-leaf slots"))
  if args.slots:
    whole_leaf_slots()
  text = table(HEADER, rows(devices))
  print(f"{where}, peak bytes per device\n{text}")
  if args.record:
    about = "\n\n".join(__doc__.split("\n\n")[2:4 if args.slots else 3])
    kind = "in whole-leaf slots " if args.slots else ""
    record(f"Pipeline parameters stored {kind}as the loop reads them (prototype), {where}",
           f"{about}\n\n{text}")


if __name__ == "__main__":
  main()
