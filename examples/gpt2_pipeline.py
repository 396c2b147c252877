"""A GPT-2-style decoder with tied input/output embeddings in 2 tensor-parallel pipeline stages,
trained as a byte-level language model on the Python standard library's own source code (no
download).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/gpt2_pipeline.py --plan

The token embedding ``wte`` is used twice, as in GPT-2: looked up at the start of the first
stage and, transposed, as the output projection at the end of the last. epljax holds it in
both stages and sums its two gradients before the update (the plan's ``tied`` line), exactly
like training the model on one device. The stages are named ``epl.split(2, name=...)`` scopes:
Megatron tensor parallelism inside each stage (attention heads and the MLP's hidden units split
over the stage's 2 devices), so on 8 devices the mesh is data 2 x stage 2 x model 2 (2 replicas
of 2 stages of 2 devices), ``pipeline.num_micro_batch=4``, 1F1B. The optimizer is AdamW
with weight decay masked off biases, LayerNorm scales and the embeddings (``mask=``), which
pipelines train like any other optax optimizer. The script prints the loss per step and the
held-out loss of ``trainer.variables(state)`` on one device.
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

VOCAB = 256         # bytes


class DecoderLayer(nn.Module):
  width: int
  heads: int

  @nn.compact
  def __call__(self, h):
    mask = nn.make_causal_mask(jnp.ones(h.shape[:2], jnp.int32))
    # No projection biases: a key bias has an exactly zero gradient (softmax over keys ignores
    # it), which leaves only rounding noise to compare with the single-device run.
    attend = nn.MultiHeadDotProductAttention(num_heads=self.heads, use_bias=False)
    h = h + attend(nn.LayerNorm()(h), mask=mask)
    m = nn.Dense(4 * self.width)(nn.LayerNorm()(h))
    return h + nn.Dense(self.width)(nn.gelu(m))


class GPT2(nn.Module):
  """wte + wpe -> layers decoder layers per stage, 2 stages -> LayerNorm -> wte^T."""
  width: int = 64
  heads: int = 4
  layers: int = 2            # per stage
  length: int = 64
  split: int = 2             # tensor-parallel devices per stage

  @nn.compact
  def __call__(self, tokens):
    wte = nn.Embed(VOCAB, self.width, embedding_init=nn.initializers.normal(0.02), name="wte")
    with epl.split(self.split, name="stage_0"):                       # EPL
      h = wte(tokens) + self.param("wpe", nn.initializers.normal(0.01),
                                   (self.length, self.width))[:tokens.shape[1]]
      for _ in range(self.layers):
        h = DecoderLayer(self.width, self.heads)(h)
    with epl.split(self.split, name="stage_1"):                       # EPL
      for _ in range(self.layers):
        h = DecoderLayer(self.width, self.heads)(h)
      return wte.attend(nn.LayerNorm()(h))                             # tied output projection


def corpus(length: int, held_out: int = 4) -> tuple[np.ndarray, np.ndarray]:
  """Byte chunks of the standard library's .py files: (train, held-out), each (N, length + 1)."""
  files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
  chunks = []
  for path in files[:120]:
    with open(path, "rb") as f:
      data = np.frombuffer(f.read(), np.uint8)
    n = len(data) // (length + 1)
    chunks.append(data[:n * (length + 1)].reshape(n, length + 1).astype(np.int32))
  return np.concatenate(chunks[held_out:]), np.concatenate(chunks[:held_out])


def next_byte_loss(model, variables, batch):
  logits = model.apply(variables, batch["tokens"][:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


def decay_mask(params):
  """Weight decay on the matrices of the layers only."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x.ndim > 1 and "wte" not in jax.tree_util.keystr(path), params)


def main(argv=None) -> list[float]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--micro_batch", type=int, default=8, help="rows per replica and micro batch")
  parser.add_argument("--layers", type=int, default=2, help="decoder layers per stage")
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--plan", action="store_true", help="print the parallel plan")
  args = parser.parse_args(argv)

  epl.init(epl.Config({"pipeline.num_micro_batch": 4}))               # EPL
  model = GPT2(width=args.width, layers=args.layers)
  train, held_out = corpus(model.length)
  trainer = epl.Trainer(lambda key, batch: model.init(key, batch["tokens"][:, :-1]),
                        lambda variables, batch: next_byte_loss(model, variables, batch),
                        optax.adamw(3e-3, weight_decay=1e-2, mask=decay_mask))
  replicas = epl.Env.get().cluster.total_gpu_num // (2 * model.split)
  rows = replicas * 4 * args.micro_batch

  def batch_at(step):
    return {"tokens": train[np.random.default_rng(step).integers(0, len(train), rows)]}

  state = trainer.init(jax.random.key(0), batch_at(0))
  if args.plan:
    print(trainer.plan, "\n")
  losses = []
  for step in range(args.steps):
    state, metrics = trainer.train_step(state, batch_at(step))
    losses.append(float(metrics["loss"]))
    print(f"step {step + 1:3d}  next-byte loss {losses[-1]:.4f}")
  variables = trainer.variables(state)                                 # the user's structure
  loss = jax.jit(lambda v, b: next_byte_loss(model, v, b))(variables, {"tokens": held_out[:256]})
  print(f"held-out next-byte loss {float(loss):.4f}")
  return losses


if __name__ == "__main__":
  main()
