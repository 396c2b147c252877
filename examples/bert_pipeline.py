"""A BERT-style encoder in 2 pipeline stages, trained as a byte-level masked language model on
the Python standard library's own source code (no download).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/bert_pipeline.py

EPL's BERT pipeline example: the model calls ``epl.set_default_strategy(epl.replicate(1))``
before each half of its encoder layers, which cuts it into two stages; the embedding (before
the first call) joins the first stage, the output head and the loss (after the last) the last.
``pipeline.num_micro_batch=4`` and the default ``pipeline.strategy="PreferBackward"`` (1F1B).
On 8 devices that is 4 pipeline replicas of 2 stages. The script prints the loss per step and
at the end the masked-byte accuracy on held-out files, computed on one device from
``trainer.variables(state)``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import glob  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import epljax as epl  # noqa: E402  # EPL

MASK = 256          # byte values are 0..255; one extra token for [MASK]
VOCAB = 257


class EncoderLayer(nn.Module):
  width: int
  heads: int

  @nn.compact
  def __call__(self, h):
    a = nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(h))
    h = h + a
    m = nn.Dense(4 * self.width)(nn.LayerNorm()(h))
    return h + nn.Dense(self.width)(nn.gelu(m))


class Bert(nn.Module):
  """Embedding -> 2 x layers encoder layers (one pipeline stage each) -> byte logits."""
  width: int = 64
  heads: int = 4
  layers: int = 2           # per stage
  length: int = 64

  @nn.compact
  def __call__(self, tokens):
    h = nn.Embed(VOCAB, self.width)(tokens)
    h = h + self.param("position", nn.initializers.normal(0.02), (self.length, self.width))
    for _ in range(2):
      epl.set_default_strategy(epl.replicate(1))                    # EPL: a new stage
      for _ in range(self.layers):
        h = EncoderLayer(self.width, self.heads)(h)
    return nn.Dense(VOCAB)(nn.LayerNorm()(h))


def corpus(length: int, held_out: int = 4) -> tuple[np.ndarray, np.ndarray]:
  """Byte chunks of the standard library's .py files: (train, held-out), each (N, length)."""
  files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
  chunks = []
  for path in files[:120]:
    with open(path, "rb") as f:
      data = np.frombuffer(f.read(), np.uint8)
    n = len(data) // length
    chunks.append(data[:n * length].reshape(n, length).astype(np.int32))
  return np.concatenate(chunks[held_out:]), np.concatenate(chunks[:held_out])


def masked(chunks: np.ndarray, rng: np.random.Generator, per_row: int) -> dict[str, np.ndarray]:
  """BERT's masking with a fixed number of predictions per row, so every row weighs the same
  in the loss (the mean over micro batches is then the mean over the whole batch)."""
  rows, length = chunks.shape
  where = np.argsort(rng.random((rows, length)), axis=1)[:, :per_row]
  tokens = chunks.copy()
  np.put_along_axis(tokens, where, MASK, axis=1)
  return {"tokens": tokens, "where": where.astype(np.int32),
          "labels": np.take_along_axis(chunks, where, axis=1)}


def loss_and_accuracy(model, variables, batch):
  logits = model.apply(variables, batch["tokens"])
  picked = jnp.take_along_axis(logits, batch["where"][..., None], axis=1)
  loss = optax.softmax_cross_entropy_with_integer_labels(picked, batch["labels"]).mean()
  return loss, (jnp.argmax(picked, -1) == batch["labels"]).mean()


def main(argv=None) -> list[float]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--micro_batch", type=int, default=8, help="rows per replica and micro batch")
  parser.add_argument("--layers", type=int, default=2, help="encoder layers per stage")
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--plan", action="store_true", help="print the parallel plan")
  args = parser.parse_args(argv)

  epl.init(epl.Config({"pipeline.num_micro_batch": 4}))               # EPL
  model = Bert(width=args.width, layers=args.layers)
  train, held_out = corpus(model.length)
  rng = np.random.default_rng(0)

  trainer = epl.Trainer(lambda key, batch: model.init(key, batch["tokens"]),
                        lambda variables, batch: loss_and_accuracy(model, variables, batch)[0],
                        optax.adamw(3e-3, weight_decay=1e-2))
  replicas = epl.Env.get().cluster.total_gpu_num // 2                  # 2 stages per replica
  rows = replicas * 4 * args.micro_batch

  def batch_at(step):
    index = np.random.default_rng(step).integers(0, len(train), rows)
    return masked(train[index], rng, per_row=model.length // 8)

  state = trainer.init(jax.random.key(0), epl.io.process_slice(batch_at(0)))   # my rows
  if args.plan:
    print(trainer.plan, "\n")
  losses = []
  for step in range(args.steps):
    state, metrics = trainer.train_step(state, epl.io.process_slice(batch_at(step), trainer.plan))
    losses.append(float(metrics["loss"]))
    print(f"step {step + 1:3d}  masked-byte loss {losses[-1]:.4f}")
  variables = trainer.variables(state)                                 # the user's structure
  test = masked(held_out[:256], np.random.default_rng(1), per_row=model.length // 8)
  loss, accuracy = jax.jit(lambda v, b: loss_and_accuracy(model, v, b))(variables, test)
  print(f"held-out loss {float(loss):.4f}, masked-byte accuracy {float(accuracy):.1%}")
  return losses


if __name__ == "__main__":
  main()
