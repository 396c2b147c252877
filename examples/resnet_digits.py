"""A small ResNet trained data-parallel on scikit-learn's handwritten digits (shipped with it).

    pip install -e ".[examples]"     # in the repository: epljax and scikit-learn, the digits
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/resnet_digits.py

1797 8x8 images of the digits 0-9; 1437 train, 360 test. Each of the 8 replicas takes 16 images
per step (128 per step), BatchNorm statistics are taken over the whole step's batch. Expected:
about 97% test accuracy after 20 epochs (a few seconds on a CPU).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402


class ResidualBlock(nn.Module):
  channels: int
  stride: int = 1

  @nn.compact
  def __call__(self, x, train: bool):
    norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)  # noqa: E731
    y = nn.Conv(self.channels, (3, 3), self.stride, use_bias=False)(x)
    y = nn.relu(norm()(y))
    y = nn.Conv(self.channels, (3, 3), use_bias=False)(y)
    y = norm()(y)
    if x.shape != y.shape:
      x = norm()(nn.Conv(self.channels, (1, 1), self.stride, use_bias=False)(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """Conv stem, three residual blocks (16, 32, 64 channels), global pooling, classifier."""
  classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(
        nn.Conv(16, (3, 3), use_bias=False)(x)))
    for channels, stride in ((16, 1), (32, 2), (64, 2)):
      x = ResidualBlock(channels, stride)(x, train)
    return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


def load(seed: int = 0):
  """scikit-learn's digits, split 1437 / 360 (stratified); exits 2 with the command that
  installs scikit-learn when it is missing."""
  try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
  except ImportError as e:
    print(f"examples/resnet_digits.py reads scikit-learn's digits ({e}); install it: "
          'pip install -e ".[examples]" (in the repository)', file=sys.stderr)
    raise SystemExit(2) from e
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]   # (1797, 8, 8, 1) in [0, 1]
  return train_test_split(images, digits.target.astype(np.int32), test_size=360,
                          random_state=seed, stratify=digits.target)


def main(argv=None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=20)
  parser.add_argument("--micro_batch", type=int, default=16, help="images per replica per step")
  parser.add_argument("--lr", type=float, default=3e-3)
  args = parser.parse_args(argv)

  epl.init()
  epl.set_default_strategy(epl.replicate(1))
  x_train, x_test, y_train, y_test = load()
  model = ResNet()

  def loss_fn(variables, batch):
    logits, updates = model.apply(variables, batch["x"], mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return (loss, jnp.mean(logits.argmax(-1) == batch["y"])), updates

  rows = args.micro_batch * epl.Env.get().cluster.total_gpu_num
  steps_per_epoch = len(x_train) // rows
  schedule = optax.cosine_decay_schedule(args.lr, args.epochs * steps_per_epoch)
  trainer = epl.Trainer(lambda key, batch: model.init(key, batch["x"]), loss_fn,
                        optax.adamw(schedule, weight_decay=1e-4), has_aux=True,
                        mutable=["batch_stats"])

  @jax.jit
  def predict(variables, images):
    return model.apply(variables, images, train=False).argmax(-1)

  rng = np.random.default_rng(0)
  state = None
  accuracy = 0.0
  for epoch in range(args.epochs):
    start = time.perf_counter()
    order = rng.permutation(len(x_train))
    losses = []
    for i in range(steps_per_epoch):   # the last partial batch is dropped
      index = order[i * rows:(i + 1) * rows]
      batch = {"x": x_train[index], "y": y_train[index]}
      if state is None:
        state = trainer.init(jax.random.key(0), epl.io.process_slice(batch))
        print(f"{trainer.plan.num_replicas} replicas x {args.micro_batch} images, "
              f"{steps_per_epoch} steps per epoch")
      state, metrics = trainer.train_step(state, epl.io.process_slice(batch, trainer.plan))
      losses.append(metrics["loss"])
    accuracy = float(np.mean(np.asarray(predict(trainer.variables(state), x_test)) == y_test))
    print(f"epoch {epoch + 1:2d}  loss {float(np.mean(losses)):.4f}  "
          f"test accuracy {accuracy:.3f}  ({time.perf_counter() - start:.1f} s)")
  return accuracy


if __name__ == "__main__":
  main()
