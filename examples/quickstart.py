"""EPL's quick start in Flax: the same model, data and optimizer, data-parallel on every device.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/quickstart.py
    python -m epljax.launch --num_workers 2 --gpu_per_worker 4 examples/quickstart.py

EPL's added lines are marked with ``# EPL``. Each of the 8 replicas (8 simulated CPU devices,
or every GPU) takes a micro batch of 10 rows, so a step trains on 80 rows; the loss is the mean
over all of them, exactly what one device would compute on the 80 rows. Under the launcher
every worker computes the same global batch and feeds ``train_step`` its own rows
(``epl.io.process_slice``): the same 80 rows per step, the same losses.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402  # EPL


class LocalModel(nn.Module):
  """``tf.layers.dense(x, 2)`` then ``tf.layers.dense(logits, 10)``."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(10)(nn.Dense(2)(x))


def main(argv=None) -> list[float]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--micro_batch", type=int, default=10, help="rows per replica per step")
  parser.add_argument("--plan", action="store_true", help="print the parallel plan")
  parser.add_argument("--peak_tflops", type=float, default=None,
                      help="device peak for the progress bar's MFU (default: known chips)")
  args = parser.parse_args(argv)

  epl.init()                                                  # EPL
  epl.set_default_strategy(epl.replicate(1))                  # EPL

  rng = np.random.default_rng(0)
  num_x = rng.integers(0, 10, (500, 20)).astype(np.float32)
  num_y = rng.integers(0, 10, 500).astype(np.int32)

  model = LocalModel()

  def loss_fn(variables, batch):
    logits = model.apply(variables, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  trainer = epl.Trainer(lambda key, batch: model.init(key, batch["x"]), loss_fn,
                        optax.sgd(learning_rate=0.001, momentum=0.9))
  rows = args.micro_batch * epl.Env.get().cluster.total_gpu_num   # global batch per step

  def batch_at(step):
    index = np.arange(step * rows, (step + 1) * rows) % len(num_x)
    return {"x": num_x[index], "y": num_y[index]}

  state = trainer.init(jax.random.key(0), epl.io.process_slice(batch_at(0)))   # EPL: my rows
  if args.plan:
    print(trainer.plan, "\n")
  losses = []
  with epl.progress(total=args.steps, trainer=trainer, peak_tflops=args.peak_tflops) as bar:
    for step in range(args.steps):
      mine = epl.io.process_slice(batch_at(step), trainer.plan)                # EPL: my rows
      state, metrics = trainer.train_step(state, mine)
      losses.append(float(metrics["loss"]))
      bar.update(metrics)     # loss, steps/s, tokens/s, MFU (where the peak is known)
      bar.write(f"Iteration {step + 1} , Loss: {losses[-1]:.6f} .")   # above the bar, never in it
  print("Train Finished.")
  return losses


if __name__ == "__main__":
  main()
