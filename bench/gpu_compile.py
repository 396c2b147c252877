"""The train step as XLA:GPU compiles it for 8 H100s, measured on a machine without a GPU.

    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"
    JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python bench/gpu_compile.py [--record]

Compile-only H100s (``gpu_aot.py``) stand in for ``jax.devices()``; nothing runs, every figure
is read from the compiled programs. Two tables:

1. **Gradient sums.** Where a column-split matmul's input gradient is summed over the model axis,
   epljax rewrites the forward so that sibling matmuls share one all-reduce
   (``sharding/reductions.py``), because XLA:CPU has no all-reduce reassociation; it runs on
   ``reductions.PLATFORMS`` only. Each zoo model, split with its one ``epl.annotate`` rule (4
   replicas x model 2, 8 rows), is compiled on XLA:CPU and on XLA:GPU with and without the
   rewrite: all-reduces per step, their bytes, temp and bytes accessed.
2. **Data-parallel overhead.** ``overhead.py``'s models, epljax's step (non-finite skip and step
   metrics on) against the hand-written ``jax.jit`` with the same shardings, both compiled for 8
   H100s: temp, bytes accessed and FLOPs ratios.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
sys.path.insert(0, os.path.dirname(__file__))
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import argparse  # noqa: E402
import contextlib  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import epljax as epl  # noqa: E402
from common import hand_step, mlp_problem, record, step_cost, table  # noqa: E402
from epljax import hlo  # noqa: E402
from epljax.sharding import reductions  # noqa: E402
from gpu_aot import as_devices, h100s  # noqa: E402
from memory import gpt_problem  # noqa: E402
from overhead import SIZES  # noqa: E402


@contextlib.contextmanager
def rewrite(on: bool, platform: str):
  """epljax's gradient-sum rewrite forced on or off for ``platform``."""
  saved = reductions.PLATFORMS
  reductions.PLATFORMS = tuple(p for p in saved if p != platform) + ((platform,) if on else ())
  try:
    yield
  finally:
    reductions.PLATFORMS = saved


def compiled_zoo_step(name: str, devices: list):
  """The compiled train step of zoo model ``name`` split by its annotate rule, with the plan."""
  import models

  zoo = models.ZOO[name]
  with as_devices(devices):
    epl.init()
    epl.annotate(zoo.annotate_rules(2))
    trainer = epl.Trainer(zoo.init_fn, zoo.loss_fn, optax.sgd(0.1))
    rules = (nn.logical_axis_rules(zoo.logical_rules) if zoo.logical_rules
             else contextlib.nullcontext())
    with rules:
      built = trainer._build(jax.random.key(0), zoo.make_batch(8))
      return built.plan.compiled, built.plan


def sums_row(name: str, cpus: list, gpus: list) -> list[str]:
  row = [name]
  for platform, devices in (("cpu", cpus), ("gpu", gpus)):
    figures = []
    for on in (False, True):
      with rewrite(on, platform):
        compiled, _ = compiled_zoo_step(name, devices)
      sums = [c for c in hlo.executed_collectives(compiled.as_text()) if c.kind == "all-reduce"]
      figures.append((len(sums), sum(c.bytes for c in sums),
                      compiled.memory_analysis().temp_size_in_bytes,
                      step_cost(compiled, "bytes accessed")))
    (n0, b0, t0, a0), (n1, b1, t1, a1) = figures
    row += [f"{n0} → {n1}", f"{b0 / 2**10:.0f} → {b1 / 2**10:.0f}",
            f"{t1 / t0:.3f}", f"{a1 / a0:.3f}"]
  return row


def dp_row(name: str, gpus: list) -> list[str]:
  kind, *shape, _ = SIZES[name]
  model, batch, loss_fn = mlp_problem(*shape) if kind == "mlp" else gpt_problem(*shape)
  optimizer = optax.adamw(1e-3)
  with as_devices(gpus):
    epl.init()
    epl.set_default_strategy(epl.replicate(1))
    trainer = epl.Trainer(lambda key, b: model.init(key, b["x"]), loss_fn, optimizer)
    built = trainer._build(jax.random.key(0), batch)
    ours = built.plan.compiled
    mesh = built.plan.mesh
  replicated, split_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

  params = jax.eval_shape(lambda k: model.init(k, batch["x"][:1])["params"], jax.random.key(0))
  state = (params, jax.eval_shape(optimizer.init, params))
  abstract = lambda tree, s: jax.tree.map(  # noqa: E731
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree)
  hand = jax.jit(hand_step(loss_fn, optimizer),
                 out_shardings=((replicated, replicated), replicated), donate_argnums=0
                 ).lower(abstract(state, replicated), abstract(batch, split_rows)).compile()
  temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
  rows = jax.tree.leaves(batch)[0].shape[0]
  what = f"MLP {shape[1]}x{shape[0]}" if kind == "mlp" else "GPT 4x128, 128 tokens"
  return [f"{what}, batch {rows}", f"{temp(ours) / 2**20:.2f} / {temp(hand) / 2**20:.2f}",
          f"{temp(ours) / temp(hand):.3f}",
          f"{step_cost(ours, 'bytes accessed') / step_cost(hand, 'bytes accessed'):.3f}",
          f"{step_cost(ours, 'flops') / step_cost(hand, 'flops'):.3f}"]


def main(argv=None):
  import models

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", nargs="+", default=list(models.ZOO), choices=list(models.ZOO))
  parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  cpus, gpus = jax.devices("cpu")[:8], h100s("1x1x8")
  sums = table(["model", "CPU all-reduces", "CPU KiB", "CPU temp", "CPU bytes accessed",
                "GPU all-reduces", "GPU KiB", "GPU temp", "GPU bytes accessed"],
               [sums_row(name, cpus, gpus) for name in args.models])
  sums += ("\n\nEach zoo model split with its epl.annotate rule (4 replicas x model 2, 8 rows, "
           "sgd), compiled without → with epljax's gradient-sum rewrite (sharding/reductions.py) "
           "on XLA:CPU (8 host devices) and XLA:GPU (8 compile-only H100s, one host). "
           "All-reduces and KiB: executed per step (loops times their trips); temp and bytes "
           "accessed: with the rewrite / without.")
  print(f"{gpus[0].device_kind} x {len(gpus)} (compile only), jax {jax.__version__}\n\n{sums}")
  dp = table(["model, global batch", "temp MiB epljax / hand", "temp ratio",
              "bytes accessed ratio", "FLOPs ratio"], [dp_row(n, gpus) for n in args.sizes])
  dp += ("\n\nadamw, 8 replicas, data parallel, compiled for 8 H100s; epljax with its global "
         "norm, non-finite check and skip against hand-written jax.jit with the same shardings. "
         "Bytes accessed and FLOPs from cost_analysis(), each conditional's results counted "
         "once.")
  print(f"\n{dp}")
  if args.record:   # one section, keyed by the devices compiled for (as the docs name it)
    record("The step as XLA:GPU compiles it (bench/gpu_compile.py)",
           f"XLA:GPU compiling for {len(gpus)} compile-only {gpus[0].device_kind} (one host), "
           f"XLA:CPU for {len(cpus)} host devices.\n\n{sums}\n\n{dp}", argv,
           used=gpus)


if __name__ == "__main__":
  main()
