"""A training script for the ``python -m epljax.plan`` tests: an MLP whose 4 hidden layers run
under ``nn.scan`` (one stack of layers), trained with AdamW on 8 rows per device; its first
kernel has Flax logical axis names, the rules set around ``trainer.init``.

    python -m epljax.plan tests/plan_scripts/scanned_mlp.py --topology cpu:8 [-- --fail MODE]

``--fail raise`` raises before ``trainer.init``, ``--fail exit`` calls ``sys.exit(5)``,
``--fail end`` ends without calling it, ``--fail init`` gives ``trainer.init`` an ``init_fn``
that returns None (its PlanError raised in ``trainer.init``).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))   # tests/helpers.py

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
from helpers import classification_batch, cross_entropy  # noqa: E402


class Layer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.relu(nn.Dense(x.shape[-1])(x)), None


# The first kernel's Flax logical axis names, mapped to mesh axes by the rules the script
# sets around trainer.init (as examples/llama.py does).
RULES = (("features", None), ("hidden", None))


class ScannedMLP(nn.Module):
  width: int = 64

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.width, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("features", "hidden")))(x)
    x, _ = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=4)()(x, None)
    return nn.Dense(10)(x)


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--fail", choices=["raise", "exit", "end", "init"])
  args = parser.parse_args(argv)
  epl.init()
  model = ScannedMLP()
  batch = classification_batch(8 * jax.device_count())
  if args.fail == "raise":
    raise ValueError("no data: the script's own error")
  if args.fail == "exit":
    sys.exit(5)
  if args.fail == "end":
    return
  trainer = epl.Trainer(lambda rng, b: None if args.fail == "init" else model.init(rng, b["x"]),
                        lambda v, b: cross_entropy(model.apply(v, b["x"]), b["y"]),
                        optax.adamw(1e-3))
  with nn.logical_axis_rules(RULES):
    trainer.init(jax.random.key(0), batch)
  print("trained")   # (never, under python -m epljax.plan)


if __name__ == "__main__":
  main()
