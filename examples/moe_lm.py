"""A mixture-of-experts transformer language model, experts split over every device, trained on
the Python standard library's own source code read as bytes (no download).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/moe_lm.py

EPL's MoE pattern, three annotations:

    epl.init({"cluster.colocate_split_and_replicate": True})
    epl.set_default_strategy(epl.replicate(n))     # attention, gating: data parallel
    MoE(..., experts=epl.split(n))                 # experts' weights defined under split(n)

Each device holds 1/n of every MoE layer's experts; tokens go to their experts' devices and
back with all-to-all. The loss (bits per byte would be loss / ln 2) falls from ln(256) = 5.5.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import glob  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402
from epljax.nn import MoE  # noqa: E402


def stdlib_bytes(limit: int = 4_000_000) -> np.ndarray:
  """The standard library's .py files, concatenated, as a uint8 array."""
  files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
  chunks, size = [], 0
  for path in files:
    with open(path, "rb") as f:
      data = f.read()
    chunks.append(np.frombuffer(data, np.uint8))
    size += len(data)
    if size >= limit:
      break
  return np.concatenate(chunks)


class Block(nn.Module):
  heads: int
  experts: int
  devices: int

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(x), mask=mask)
    y, aux = MoE(self.experts, 4 * x.shape[-1], top_k=2,
                 experts=epl.split(self.devices, name="experts"))(nn.LayerNorm()(x))
    return x + y, aux


class MoELM(nn.Module):
  devices: int
  width: int = 64
  layers: int = 2
  heads: int = 4
  experts: int = 8
  length: int = 64

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(256, self.width)(ids) + self.param(
        "position", nn.initializers.normal(0.02), (self.length, self.width))
    aux_total = 0.0
    for _ in range(self.layers):
      x, aux = Block(self.heads, self.experts, self.devices)(x)
      aux_total = aux_total + aux
    return nn.Dense(256)(nn.LayerNorm()(x)), aux_total / self.layers


def main(argv=None) -> list[float]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--sequences", type=int, default=32, help="global batch")
  parser.add_argument("--length", type=int, default=64)
  args = parser.parse_args(argv)

  env = epl.init({"cluster.colocate_split_and_replicate": True})
  devices = env.cluster.total_gpu_num
  epl.set_default_strategy(epl.replicate(devices))
  corpus = stdlib_bytes()
  split = int(len(corpus) * 0.95)
  train, held_out = corpus[:split], corpus[split:]
  print(f"corpus: {len(corpus) / 1e6:.1f} MB of standard-library source, {devices} devices")

  def batch_from(data, rng):
    starts = rng.integers(0, len(data) - args.length - 1, args.sequences)
    windows = np.stack([data[s:s + args.length + 1] for s in starts]).astype(np.int32)
    return {"x": windows[:, :-1], "y": windows[:, 1:]}

  model = MoELM(devices, length=args.length)

  def loss_fn(variables, batch):
    logits, aux = model.apply(variables, batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss + 0.01 * aux

  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, args.steps)
  trainer = epl.Trainer(lambda key, b: model.init(key, b["x"]), loss_fn,
                        optax.adamw(schedule, weight_decay=0.01))
  rng = np.random.default_rng(0)
  state = trainer.init(jax.random.key(0), epl.io.process_slice(batch_from(train, rng)))
  kinds = {}
  for c in trainer.plan.collectives:
    kinds[c.kind] = kinds.get(c.kind, 0) + 1
  print("collectives per step:", kinds)
  losses, start = [], time.perf_counter()
  for step in range(args.steps):
    mine = epl.io.process_slice(batch_from(train, rng), trainer.plan)   # this worker's rows
    state, metrics = trainer.train_step(state, mine)
    losses.append(float(metrics["loss"]))
    if step % 20 == 0 or step == args.steps - 1:
      print(f"step {step:4d}  loss {losses[-1]:.3f}  ({time.perf_counter() - start:.0f} s)")
  held_batch = batch_from(held_out, np.random.default_rng(1))
  held = trainer.loss_and_grads(state, epl.io.process_slice(held_batch, trainer.plan))[0]
  print(f"held-out loss {float(held):.3f} (from {np.log(256):.2f} at chance)")
  return losses


if __name__ == "__main__":
  main()
