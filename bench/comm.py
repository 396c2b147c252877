"""What each strategy communicates: collectives and bytes read from the compiled HLO, beside
the analytic minimum.

    python bench/comm.py            # print the table
    python bench/comm.py --record   # and append it to bench/RESULTS.md

For each case the forward pass alone (``Trainer.lower_loss``) and the whole train step
(``Trainer.lower``) are compiled on 8 simulated CPU devices; "bytes" are the result bytes of
each collective on one device.
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(__file__))

import argparse  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
from common import machine, record, table  # noqa: E402
from epljax import hlo  # noqa: E402
from epljax.nn import MoE, softmax_cross_entropy_with_integer_labels  # noqa: E402

ROWS, LENGTH, WIDTH = 32, 64, 256


class DataParallelMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(WIDTH)(nn.relu(nn.Dense(4 * WIDTH)(x)))


class MegatronMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    with epl.split(8, name="mlp"):
      return nn.Dense(WIDTH, name="wo")(nn.relu(nn.Dense(4 * WIDTH, name="wi")(x)))


class Classifier(nn.Module):
  classes: int

  @nn.compact
  def __call__(self, x):
    with epl.replicate(8, name="features"):
      x = nn.relu(nn.Dense(WIDTH)(x))
    with epl.split(8, name="classifier"):
      return nn.Dense(self.classes, name="fc")(x)


class MoELayer(nn.Module):
  @nn.compact
  def __call__(self, x):
    y, _ = MoE(8, 4 * WIDTH, top_k=2, experts=epl.split(8, name="experts"))(x)
    return y


def summary(found) -> str:
  counts = hlo.summarize(found)
  return ", ".join(f"{n} {k} ({b / 2**10:.0f} KiB)" for k, (n, b) in counts.items()) or "none"


def run(name, model, batch, loss_of, config, default=None, minimum=""):
  epl.init(config)
  if default is not None:
    epl.set_default_strategy(default)

  def loss_fn(variables, b):
    return loss_of(model.apply(variables, b["x"]), b)

  trainer = epl.Trainer(lambda key, b: model.init(key, b["x"]), loss_fn, optax.sgd(0.1))
  state = trainer.init(jax.random.key(0), batch)
  forward = hlo.collectives(trainer.lower_loss(state, batch).compile().as_text())
  step = trainer.plan.collectives
  return [name, dict(trainer.plan.mesh.shape).__repr__().replace("'", ""), summary(forward),
          summary(step), minimum]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--classes", type=int, default=100_000)
  parser.add_argument("--record", action="store_true")
  args = parser.parse_args(argv)
  rng = np.random.default_rng(0)
  tokens = {"x": rng.normal(size=(ROWS, LENGTH, WIDTH)).astype(np.float32)}
  rows = {"x": rng.normal(size=(256, WIDTH)).astype(np.float32),
          "y": rng.integers(0, args.classes, 256).astype(np.int32)}
  mse = lambda out, b: ((out - b["x"]) ** 2).mean()  # noqa: E731
  act = ROWS * LENGTH * WIDTH * 4
  params_mlp = (WIDTH * 4 * WIDTH * 2 + 5 * WIDTH) * 4
  colocate = {"cluster.colocate_split_and_replicate": True}
  capacity = -(-LENGTH * 2 * 5 // (4 * 8))   # MoE's ceil(tokens * top_k * 1.25 / experts)
  a2a = 8 * (ROWS // 8) * capacity * WIDTH * 4
  cases = [
      run("data parallel MLP", DataParallelMLP(), tokens, mse, {},
          minimum=f"forward none; step 1 all-reduce of the gradients ({params_mlp // 1024} KiB)"),
      run("split(8) Megatron MLP", MegatronMLP(), tokens, mse, {},
          minimum=f"forward 1 all-reduce of the activations ({act // 1024} KiB)"),
      run(f"split(8) classifier, {args.classes} classes, integer-label CE",
          Classifier(args.classes), rows,
          lambda out, b: optax.softmax_cross_entropy_with_integer_labels(out, b["y"]).mean(),
          colocate, minimum="no gather of logits or kernel"),
      run(f"split(8) classifier, {args.classes} classes, epl.nn CE",
          Classifier(args.classes), rows,
          lambda out, b: softmax_cross_entropy_with_integer_labels(out, b["y"]).mean(),
          colocate, minimum="gather features (256 KiB), row sums only"),
      run("MoE layer, experts split(8)", MoELayer(), tokens, mse, colocate,
          default=epl.replicate(8),
          minimum=f"forward 2 all-to-all per layer ({a2a // 1024} KiB each)"),
  ]
  body = (table(["case", "mesh", "forward (compiled)", "train step (compiled)",
                 "analytic minimum"], cases)
          + f"\n\nTokens {ROWS}x{LENGTH}x{WIDTH} float32; classifier batch 256 x {WIDTH}. "
          "Counts and result bytes per device, from the compiled HLO.")
  print(f"{machine()}\n\n{body}")
  if args.record:
    record("Communication per strategy (bench/comm.py)", body, argv)


if __name__ == "__main__":
  main()
