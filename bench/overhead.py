"""epljax's data-parallel step against a hand-written ``jax.jit`` with the same shardings.

    python bench/overhead.py            # print the table
    python bench/overhead.py --record   # and append it to bench/RESULTS.md

Both steps train the same MLP with the same optax optimizer on the same pre-sharded global
batch (parameters replicated, batch split over the 'data' axis, state donated). They are timed
alternately in one process; the figure of merit is the median of the per-pair time ratios.
Per-device bytes come from ``compiled.memory_analysis()``.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(__file__))

import argparse  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import epljax as epl  # noqa: E402
from common import machine, mlp_problem, paired_ratio, record, table  # noqa: E402


def measure(width: int, depth: int, rows: int, pairs: int) -> list[str]:
  """One table row: step times, paired ratio and per-device bytes for one model size."""
  epl.init()
  epl.set_default_strategy(epl.replicate(1))
  model, batch, loss_fn = mlp_problem(width, depth, rows)
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

  def hand_step(state, b):
    params, opt_state = state
    loss, grads = jax.value_and_grad(lambda p: loss_fn({"params": p}, b))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  hand_jit = jax.jit(hand_step, in_shardings=((replicated, replicated), split_rows),
                     out_shardings=((replicated, replicated), replicated), donate_argnums=0)
  box = {"epl": epl_state, "hand": hand_state}

  def run_epl():
    box["epl"], metrics = trainer.train_step(box["epl"], epl_batch)
    return metrics["loss"]

  def run_hand():
    box["hand"], loss = hand_jit(box["hand"], hand_batch)
    return loss

  timing = paired_ratio(run_epl, run_hand, pairs=pairs)
  epl_mem = trainer.lower(box["epl"], epl_batch).compile().memory_analysis()
  hand_mem = hand_jit.lower(box["hand"], hand_batch).compile().memory_analysis()
  mib = lambda m: (f"{m.argument_size_in_bytes / 2**20:.2f} / "  # noqa: E731
                   f"{m.temp_size_in_bytes / 2**20:.2f}")
  return [f"{depth}x{width}, batch {rows}", f"{timing['first_s'] * 1e3:.2f}",
          f"{timing['second_s'] * 1e3:.2f}",
          f"**{timing['ratio']:.3f}** ({timing['ratio_q1']:.3f}-{timing['ratio_q3']:.3f})",
          str(pairs), mib(epl_mem), mib(hand_mem)]


SIZES = {"small": (256, 2, 256, 200), "medium": (512, 4, 512, 60)}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  rows = [measure(*SIZES[name]) for name in args.sizes]
  body = (table(["MLP, global batch", "epljax ms", "hand ms", "ratio (quartiles)", "pairs",
                 "epljax args / temp MiB/dev", "hand args / temp MiB/dev"], rows)
          + "\n\nadamw, 8 replicas, data parallel. Ratio: median over pairs of epljax step "
          "time / hand-written step time, timed alternately in one process. Target: <= 1.03.")
  print(f"{machine()}\n\n{body}")
  if args.record:
    record("Data-parallel step overhead (bench/overhead.py)", body, argv)


if __name__ == "__main__":
  main()
