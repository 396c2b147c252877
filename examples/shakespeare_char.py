"""nanoGPT's "baby GPT" on tiny Shakespeare (characters), trained with epljax.

    pip install -e ".[grain]"        # in the repository: epljax and Grain, its data pipeline
    python examples/shakespeare_char.py --layout dp
    python examples/shakespeare_char.py --logdir runs/shakespeare --sample 500

nanoGPT's README trains it on a CPU (``config/train_shakespeare_char.py`` with ``--device=cpu
--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
--lr_decay_iters=2000 --dropout=0.0``) to "a loss of only 1.88". Here the same model, written
as nanoGPT writes it (one fused ``c_attn`` matmul split into q, k, v; ``c_proj``; an MLP
``c_fc`` -> GELU -> ``c_proj``; LayerNorm without bias; no biases; the output projection is the
token embedding, tied), the same optimizer (AdamW, lr 1e-3, 100 warmup steps, cosine decay to
1e-4 at 2000, beta2 0.99, weight decay 0.1 on matrices only, gradient clip 1.0) and the same
90/10 split of the text. Batches of random windows come from a Grain pipeline
(``epljax.data.windows``): shuffled with a seed, each process its own shard.

``--layout`` picks how epljax lays the model out; the global batch is nanoGPT's 12 rows in all:

========  ===================================================  =======  ===================
layout    strategy                                             devices  12 rows =
========  ===================================================  =======  ===================
single    plain ``jax.jit`` on one device, no epljax           1        12
dp        ``epl.replicate(1)`` default strategy                4        4 replicas x 3
split     ``epl.split(2)`` around the blocks (colocated)       4        2 replicas x 6
pipeline  stages ``epl.replicate(1, name="stage_i")``          4        2 x 2 rows x M=3
3d        stages ``epl.split(2, name="stage_i")``              8        2 x 2 rows x M=3
========  ===================================================  =======  ===================

(devices: ``cluster.run_visible_devices``; 12 does not divide over 8 data-parallel replicas.)
The validation loss is measured as nanoGPT's ``estimate_loss`` does, on ``--eval_iters``
(200) random batches of the held-out 10%, with the trained variables on one device. The text is
the repository's copy of tiny Shakespeare (``examples/data/tinyshakespeare.txt``, the file
nanoGPT downloads); ``--data`` reads another.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import epljax as epl  # noqa: E402
from epljax.data import CharVocab, split_train_val, windows  # noqa: E402

# tiny Shakespeare, as nanoGPT downloads it from char-rnn (public domain): its md5 and length
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "tinyshakespeare.txt")
MD5 = "6fb458f1232090904fb40fe944165e91"
CHARS = 1_115_394
BATCH = 12                    # nanoGPT's batch_size: the global batch of every layout


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab_size: int = 65
  block_size: int = 64
  n_layer: int = 4
  n_head: int = 4
  n_embd: int = 128
  # "einsum": nanoGPT's scores, mask and softmax; "epl": epl.nn.dot_product_attention (memory
  # linear in block_size; runs over context parallelism, examples/shakespeare_long.py)
  attention: str = "einsum"


# layout -> (cluster.run_visible_devices count, pipeline.num_micro_batch, blocks' scopes)
LAYOUTS = {
    "single": (1, 1, None),
    "dp": (4, 1, None),
    "split": (4, 1, "split"),
    "pipeline": (4, 3, "replicate stages"),
    "3d": (8, 3, "split stages"),
}


def _normal(std):
  return nn.initializers.normal(std)


class CausalSelfAttention(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    b, t, c = x.shape
    qkv = nn.Dense(3 * c, use_bias=False, kernel_init=_normal(0.02), name="c_attn")(x)
    q, k, v = (y.reshape(b, t, cfg.n_head, c // cfg.n_head) for y in jnp.split(qkv, 3, axis=-1))
    if cfg.attention == "epl":
      y = epl.nn.dot_product_attention(q, k, v, causal=True).reshape(b, t, c)
    else:
      att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(c // cfg.n_head)
      causal = jnp.tril(jnp.ones((t, t), bool))
      att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
      y = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, c)
    # nanoGPT's scaled init of the residual projections: 0.02 / sqrt(2 n_layer)
    return nn.Dense(c, use_bias=False, kernel_init=_normal(0.02 / math.sqrt(2 * cfg.n_layer)),
                    name="c_proj")(y)


class MLP(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, x):
    c = self.config.n_embd
    h = nn.Dense(4 * c, use_bias=False, kernel_init=_normal(0.02), name="c_fc")(x)
    h = nn.gelu(h, approximate=False)                       # torch.nn.GELU()
    return nn.Dense(c, use_bias=False, name="c_proj",
                    kernel_init=_normal(0.02 / math.sqrt(2 * self.config.n_layer)))(h)


class Block(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, x):
    x = x + CausalSelfAttention(self.config, name="attn")(
        nn.LayerNorm(epsilon=1e-5, use_bias=False, name="ln_1")(x))
    return x + MLP(self.config, name="mlp")(
        nn.LayerNorm(epsilon=1e-5, use_bias=False, name="ln_2")(x))


class GPT(nn.Module):
  """nanoGPT's GPT without dropout or biases; ``scopes`` says where the epljax scopes go."""
  config: GPTConfig
  scopes: str | None = None      # None | "split" | "replicate stages" | "split stages"

  def _groups(self):
    """(blocks, scope factory) in order: the blocks under each scope."""
    n = self.config.n_layer
    if self.scopes is None:
      return [(range(n), contextlib.nullcontext)]
    if self.scopes == "split":
      return [(range(n), lambda: epl.split(2))]
    scope = epl.split if self.scopes == "split stages" else epl.replicate
    count = 2 if self.scopes == "split stages" else 1
    return [(range(0, n // 2), lambda: scope(count, name="stage_0")),
            (range(n // 2, n), lambda: scope(count, name="stage_1"))]

  @nn.compact
  def __call__(self, idx):
    cfg = self.config
    wte = nn.Embed(cfg.vocab_size, cfg.n_embd, embedding_init=_normal(0.02), name="wte")
    wpe = nn.Embed(cfg.block_size, cfg.n_embd, embedding_init=_normal(0.02), name="wpe")
    x = wte(idx) + wpe(jnp.arange(idx.shape[1]))   # before the first scope: its task graph
    for blocks, scope in self._groups():
      with scope():
        for i in blocks:
          x = Block(cfg, name=f"h_{i}")(x)
    x = nn.LayerNorm(epsilon=1e-5, use_bias=False, name="ln_f")(x)  # after the last: its graph
    return wte.attend(x)                              # tied output projection (lm_head)


def loss_fn(model, variables, batch):
  """Mean next-character cross entropy of a batch of ``block_size + 1`` windows."""
  logits = model.apply(variables, batch["tokens"][:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()


_eval_loss = jax.jit(loss_fn, static_argnums=0)


def optimizer(steps: int = 2000, lr: float = 1e-3, min_lr: float = 1e-4, warmup: int = 100):
  """nanoGPT's AdamW: weight decay on matrices only (``dim >= 2``: embeddings and kernels)."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, min_lr)
  decay = lambda params: jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)  # noqa: E731
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=0.1, mask=decay))


def read_text(path: str | None = None) -> str:
  """The text at ``path``; without one, the repository's tiny Shakespeare (``DATA``)."""
  path = DATA if path is None else path
  if not os.path.exists(path):
    raise epl.ConfigError(f"--data {path}: no such file; pass the path of a text file (the "
                          f"repository's tiny Shakespeare: {DATA})")
  with open(path, encoding="utf-8") as f:
    return f.read()


def require_grain() -> None:
  """Exits with a message (status 2) when Grain, this example's data pipeline, is missing."""
  try:
    import grain  # noqa: F401
  except ImportError as e:
    print(f"examples/shakespeare_char.py reads its batches with Grain ({e}); install it: "
          'pip install -e ".[grain]" (in the repository)', file=sys.stderr)
    raise SystemExit(2) from e


def evaluate(model, variables, tokens, *, seed: int, iters: int, block_size: int) -> float:
  """nanoGPT's ``estimate_loss``: mean loss of ``iters`` random batches, on one device."""
  it = iter(windows(tokens, block_size, BATCH, seed=seed, process_index=0, process_count=1))
  rows = np.concatenate([next(it)["tokens"] for _ in range(iters)])
  variables = jax.device_put(jax.device_get(variables), jax.devices()[0])
  chunks = [rows[i:i + 300] for i in range(0, len(rows), 300)]  # 300 rows at a time
  losses = [_eval_loss(model, variables, {"tokens": chunk}) for chunk in chunks]
  return float(np.average(losses, weights=[len(chunk) for chunk in chunks]))


def train(layout: str, text: str, *, steps: int = 2000, eval_interval: int = 250,
          eval_iters: int = 200, seed: int = 0, log_interval: int = 0, plan: bool = False,
          logdir: str | None = None):
  """Trains ``layout``; returns a dict with per-step losses, evaluations and timing. With
  ``logdir``, the training loss (every ``log_interval`` steps) and the evaluations go to
  TensorBoard event files there (``epl.MetricsWriter``)."""
  if layout not in LAYOUTS:
    raise epl.ConfigError(f"--layout {layout!r}: choose one of {sorted(LAYOUTS)}")
  devices, micro_batches, scopes = LAYOUTS[layout]
  vocab = CharVocab.of(text)
  train_tokens, val_tokens = split_train_val(vocab.encode(text))
  cfg = GPTConfig(vocab_size=len(vocab))
  model = GPT(cfg, scopes)
  opt = optimizer(steps=2000)
  init_fn = lambda key, batch: model.init(key, batch["tokens"][:1, :-1])  # noqa: E731

  if layout == "single":
    data = windows(train_tokens, cfg.block_size, BATCH, seed=seed, process_index=0,
                   process_count=1)
    device = jax.devices()[0]

    @jax.jit
    def step_fn(state, batch):
      params, opt_state = state
      loss, grads = jax.value_and_grad(lambda p: loss_fn(model, {"params": p}, batch))(params)
      updates, opt_state = opt.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    it = iter(data)
    first = next(it)
    params = jax.device_put(init_fn(jax.random.key(seed), first)["params"], device)
    state = (params, opt.init(params))
    step = lambda s, b: step_fn(s, jax.device_put(b, device))  # noqa: E731
    variables_of = lambda s: {"params": s[0]}  # noqa: E731
    trainer = None
    it = iter(data)
  else:
    epl.init({"cluster.run_visible_devices": ",".join(map(str, range(devices))),
              "cluster.colocate_split_and_replicate": scopes == "split",
              "pipeline.num_micro_batch": micro_batches})
    if scopes is None:
      epl.set_default_strategy(epl.replicate(1))
    if scopes == "split stages":
      # The tied embedding is used by both split stages, which would split its 65 rows of
      # vocabulary over 2 devices: 65 does not divide, so it is held whole (4 KiB per stage).
      epl.annotate({"params/wte/embedding": P()})
    rows = BATCH // jax.process_count()       # this process's share of the global batch
    data = windows(train_tokens, cfg.block_size, rows, seed=seed)
    trainer = epl.Trainer(init_fn, lambda v, b: loss_fn(model, v, b), opt)
    it = iter(data)
    state = trainer.init(jax.random.key(seed), next(it))
    it = iter(data)
    if plan:
      print(trainer.plan, "\n")

    def step(s, b):
      s, metrics = trainer.train_step(s, b)
      return s, metrics["loss"]
    variables_of = trainer.variables

  def estimate(s):
    variables = variables_of(s)
    return tuple(evaluate(model, variables, tokens, seed=1000 + seed, iters=eval_iters,
                          block_size=cfg.block_size) for tokens in (train_tokens, val_tokens))

  losses, evals, train_s, start = [], [], 0.0, None
  writer = epl.MetricsWriter(logdir) if logdir else None

  def evaluate_at(i):
    nonlocal train_s, start
    jax.block_until_ready(state)
    if start is not None:
      train_s += time.perf_counter() - start
    evals.append((i, *estimate(state)))
    print(f"step {i}: train loss {evals[-1][1]:.4f}, val loss {evals[-1][2]:.4f}")
    if writer is not None:
      writer.write(i, {"eval/train_loss": evals[-1][1], "eval/val_loss": evals[-1][2]})
    start = time.perf_counter()

  for i in range(steps):
    if eval_interval and i % eval_interval == 0:
      evaluate_at(i)
    state, loss = step(state, next(it))
    losses.append(loss)
    if i == 0:                   # the first step compiles: not in the timing
      jax.block_until_ready(state)
      start = time.perf_counter()
    if log_interval and (i + 1) % log_interval == 0:
      print(f"iter {i + 1}: loss {float(loss):.4f}")
      if writer is not None:
        writer.write(i + 1, {"loss": loss})
  evaluate_at(steps)
  if writer is not None:
    writer.close()
  tokens = (steps - 1) * BATCH * cfg.block_size
  return {"layout": layout, "losses": [float(x) for x in losses], "evals": evals,
          "train_loss": evals[-1][1], "val_loss": evals[-1][2],
          "tokens_per_s": tokens / train_s if steps > 1 else float("nan"),
          "state": state, "variables": variables_of(state), "model": model, "vocab": vocab,
          "trainer": trainer, "optimizer": opt, "data": it}


def sample(model, variables, vocab, *, chars: int = 500, seed: int = 0,
           temperature: float = 0.8) -> str:
  """Text generated from a newline, as nanoGPT's ``sample.py`` (one device)."""
  block = model.config.block_size
  variables = jax.device_put(jax.device_get(variables), jax.devices()[0])
  plain = model.clone(scopes=None)

  @jax.jit
  def next_token(idx, last, key):
    logits = plain.apply(variables, idx[None])[0, last] / temperature
    return jax.random.categorical(key, logits)

  out = [vocab.chars.index("\n")]
  key = jax.random.key(seed)
  for _ in range(chars):
    key, sub = jax.random.split(key)
    context = out[-block:]          # padded on the right to one shape (one compile): causal,
    window = np.zeros(block, np.int32)  # so the padding does not reach the last real position
    window[:len(context)] = context
    out.append(int(next_token(jnp.asarray(window), len(context) - 1, sub)))
  return vocab.decode(out)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--data", help="a text file (default: the repository's tiny Shakespeare)")
  parser.add_argument("--layout", default="dp", choices=sorted(LAYOUTS))
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--eval_interval", type=int, default=250)
  parser.add_argument("--eval_iters", type=int, default=200)
  parser.add_argument("--log_interval", type=int, default=100)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--plan", action="store_true", help="print the parallel plan")
  parser.add_argument("--logdir", help="write TensorBoard scalars here (tensorboard --logdir)")
  parser.add_argument("--sample", type=int, default=0, metavar="CHARS",
                      help="print this many characters generated by the trained model")
  args = parser.parse_args(argv)
  require_grain()
  text = read_text(args.data)
  result = train(args.layout, text, steps=args.steps, eval_interval=args.eval_interval,
                 eval_iters=args.eval_iters, seed=args.seed, log_interval=args.log_interval,
                 plan=args.plan, logdir=args.logdir)
  print(f"{args.layout}: val loss {result['val_loss']:.4f}, train loss {result['train_loss']:.4f}, "
        f"{result['tokens_per_s']:,.0f} tokens/s")
  if args.sample:
    print(sample(result["model"], result["variables"], result["vocab"], chars=args.sample))
  return result


if __name__ == "__main__":
  main()
