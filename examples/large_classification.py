"""EPL's large-scale classification: data-parallel features, a 100k-class classifier split over
every device, trained on synthetic data.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/large_classification.py

    with epl.replicate(8):   features
    with epl.split(8):       classifier          # cluster.colocate_split_and_replicate=True

The classifier's kernel is split on the classes, so each device holds 1/8 of it and computes
1/8 of the logits; the softmax cross entropy is taken on the split logits (only per-row maxima
and sums cross devices; ``epl.nn.softmax_cross_entropy_with_integer_labels`` avoids the gather
that would move a logits-sized tensor). No device ever holds the whole kernel or the whole
logits: the printout lists the step's collectives, read from the compiled program.

The synthetic task: 1000 of the 100k classes occur, each a noisy copy of a random point; the
loss falls from about ln(100k) = 11.5 as the classifier finds them.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
from epljax.nn import softmax_cross_entropy_with_integer_labels  # noqa: E402


class Model(nn.Module):
  classes: int
  devices: int

  @nn.compact
  def __call__(self, x):
    with epl.replicate(self.devices, name="features"):
      x = nn.relu(nn.Dense(256)(x))
      x = nn.LayerNorm()(nn.Dense(128)(x))
    with epl.split(self.devices, name="classifier"):
      return nn.Dense(self.classes, name="fc")(x)


def main(argv=None) -> list[float]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--classes", type=int, default=100_000)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--active", type=int, default=1000, help="classes that occur in the data")
  parser.add_argument("--batch", type=int, default=256)
  args = parser.parse_args(argv)

  env = epl.init({"cluster.colocate_split_and_replicate": True})
  devices = env.cluster.total_gpu_num
  rng = np.random.default_rng(0)
  # Synthetic data: each class is a random point in a 64-d space; samples are noisy copies.
  centers = rng.normal(size=(args.classes, 64)).astype(np.float32)
  active = rng.choice(args.classes, args.active, replace=False)

  def batch_at(step):
    labels = active[np.random.default_rng(step).integers(0, args.active, args.batch)]
    noise = np.random.default_rng(10_000 + step).normal(scale=0.1, size=(args.batch, 64))
    return {"x": centers[labels] + noise.astype(np.float32), "y": labels.astype(np.int32)}

  model = Model(args.classes, devices)

  def loss_fn(variables, batch):
    logits = model.apply(variables, batch["x"])
    return softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  trainer = epl.Trainer(lambda key, b: model.init(key, b["x"]), loss_fn, optax.adam(3e-3))
  state = trainer.init(jax.random.key(0), epl.io.process_slice(batch_at(0)))   # my rows
  plan = trainer.plan
  kernel = next(leaf for leaf in plan.leaves if leaf.path == "params/fc/kernel")
  print(f"classifier kernel {kernel.shape} split as {kernel.spec}: "
        f"{kernel.bytes_per_device / 2**20:.1f} MiB per device of "
        f"{np.prod(kernel.shape) * 4 / 2**20:.1f} MiB")
  print("collectives per step:", ", ".join(
      f"{c.kind} {'+'.join(c.shapes)}" for c in plan.collectives))
  losses = []
  for step in range(args.steps):
    state, metrics = trainer.train_step(state, epl.io.process_slice(batch_at(step), plan))
    losses.append(float(metrics["loss"]))
    if step % 5 == 0 or step == args.steps - 1:
      print(f"step {step:3d}  loss {losses[-1]:.3f}")
  return losses


if __name__ == "__main__":
  main()
