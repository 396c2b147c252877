"""epljax's data-parallel step against a hand-written ``jax.jit`` with the same shardings.

    python bench/overhead.py            # print the table
    python bench/overhead.py --record   # and replace its section in bench/RESULTS.md

Both steps train the same model (an MLP of two sizes, and a GPT of 4 layers) with the same optax
optimizer on the same pre-sharded global
batch (parameters replicated, batch split over the 'data' axis, state donated). They are timed
alternately in one process; the figure of merit is the median of the per-pair time ratios.
Per-device bytes come from ``compiled.memory_analysis()``. The host column is microseconds per
call dispatched back to back without waiting (``host_us``): ``train_step``, its jitted step
called directly, and the hand-written step; where the device keeps up (small models on a GPU)
that is the step's time.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS") or "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))
# This checkout's epljax, not an installed one (a worktree beside an editable install).
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import epljax as epl  # noqa: E402
from epljax import step as epl_step  # noqa: E402
from common import (hand_step, machine, mlp_problem, record, step_cost, table,  # noqa: E402
                    time_against_hand)
from memory import gpt_problem  # noqa: E402


def measure(name: str) -> list[str]:
  """One table row: step times, paired ratio and per-device bytes and cost for one model."""
  epl.init()
  epl.set_default_strategy(epl.replicate(1))
  kind, *shape, pairs = SIZES[name]
  model, batch, loss_fn = mlp_problem(*shape) if kind == "mlp" else gpt_problem(*shape)
  optimizer = optax.adamw(1e-3)

  # epljax
  trainer = epl.Trainer(lambda key, b: model.init(key, b["x"]), loss_fn, optimizer)
  epl_state = trainer.init(jax.random.key(0), batch)
  epl_batch = trainer.shard_batch(batch)

  # by hand: the same shardings on the same mesh
  mesh = trainer.plan.mesh
  replicated, split_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.jit(lambda k: model.init(k, batch["x"][:1])["params"],
                   out_shardings=replicated)(jax.random.key(0))
  hand_state = (params, jax.jit(optimizer.init, out_shardings=replicated)(params))
  hand_batch = jax.device_put(batch, split_rows)

  hand_jit = jax.jit(hand_step(loss_fn, optimizer),
                     in_shardings=((replicated, replicated), split_rows),
                     out_shardings=((replicated, replicated), replicated), donate_argnums=0)
  timing, epl_state, hand_state = time_against_hand(trainer, epl_state, epl_batch, hand_jit,
                                                    hand_state, hand_batch, pairs=pairs)
  box = {"epl": epl_state, "hand": hand_state}

  def call(name, fn, batch_):
    def once():
      box[name], out = fn(box[name], batch_)
      return out
    return once

  host = [host_us(call("epl", trainer.train_step, epl_batch), pairs),
          host_us(call("epl", trainer._require().step_jit, epl_batch), pairs),
          host_us(call("hand", hand_jit, hand_batch), pairs)]
  epl_state, hand_state = box["epl"], box["hand"]
  epl_c = trainer.lower(epl_state, epl_batch).compile()
  hand_c = hand_jit.lower(hand_state, hand_batch).compile()
  mib = lambda m: (f"{m.argument_size_in_bytes / 2**20:.2f} / "  # noqa: E731
                   f"{m.temp_size_in_bytes / 2**20:.2f}")
  rows = jax.tree.leaves(batch)[0].shape[0]
  what = f"MLP {shape[1]}x{shape[0]}" if kind == "mlp" else "GPT 4x128, 128 tokens"
  return [f"{what}, batch {rows}", f"{timing['first_s'] * 1e3:.2f}",
          f"{timing['second_s'] * 1e3:.2f}",
          f"**{timing['ratio']:.3f}** ({timing['ratio_q1']:.3f}-{timing['ratio_q3']:.3f})",
          str(pairs), " / ".join(f"{us:.0f}" for us in host),
          mib(epl_c.memory_analysis()), mib(hand_c.memory_analysis()),
          f"{step_cost(epl_c, 'bytes accessed') / step_cost(hand_c, 'bytes accessed'):.3f} / "
          f"{step_cost(epl_c, 'flops') / step_cost(hand_c, 'flops'):.3f}"]


def host_us(call, n: int) -> float:
  """Microseconds per call of ``call`` over ``n`` calls dispatched back to back (then waited
  for): host time where the device keeps up. On XLA:CPU each call first waits for the one
  before the last, as ``train_step`` does there (``epljax.step.waits_each_step``): many queued
  steps starve its collectives."""
  wait = jax.devices()[0].platform in epl_step.WAIT_EACH_STEP
  jax.block_until_ready(call())
  previous = None
  start = time.perf_counter()
  for _ in range(n):
    out = call()
    if wait and previous is not None:
      jax.block_until_ready(previous)
    previous = out
  elapsed = time.perf_counter() - start
  jax.block_until_ready(out)
  return elapsed / n * 1e6


# name: (kind, *problem arguments, timed pairs)
SIZES = {"small": ("mlp", 256, 2, 256, 200), "medium": ("mlp", 512, 4, 512, 60),
         "gpt": ("gpt", 64, 30), "large": ("mlp", 4096, 8, 8192, 40)}   # large: for a GPU


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", nargs="+", default=["small", "medium", "gpt"],
                      choices=list(SIZES))
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  rows = [measure(name) for name in args.sizes]
  body = (table(["model, global batch", "epljax ms", "hand ms", "ratio (quartiles)", "pairs",
                 "host us/call: train_step / its step / hand", "epljax args / temp MiB/dev",
                 "hand args / temp MiB/dev",
                 "bytes accessed / FLOPs ratio"], rows)
          + f"\n\nadamw, {len(jax.devices())} replicas, data parallel; epljax with its global "
          "norm, non-finite check and skip. Ratio: median over pairs of epljax step time / "
          "hand-written step time, timed alternately in one process. Target: <= 1.03. Bytes "
          "accessed and FLOPs from cost_analysis(), each conditional's results counted once.")
  print(f"{machine()}\n\n{body}")
  if args.record:
    record("Data-parallel step overhead (bench/overhead.py)", body, argv)


if __name__ == "__main__":
  main()
