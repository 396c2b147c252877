"""Text data for language models: a character vocabulary and Grain datasets of token windows.

``windows(tokens, length, rows, seed=...)`` is nanoGPT's ``get_batch`` as a Grain pipeline:
every start position of a ``length + 1`` window is an index, the indices are shuffled with a
seed (a new permutation each epoch, so no window repeats before all were seen, where nanoGPT
draws with replacement), each process keeps every ``process_count``-th of them (its own shard:
the processes together read each window once) and they are batched into this process's
``rows``. The iterator is a ``grain.DatasetIterator``: ``get_state()`` is its position, which
``epl.Checkpointer.save(..., data=iterator)`` stores so that a resume repeats no batch.

    vocab = CharVocab.of(text)
    train = windows(vocab.encode(text), 64, rows=12, seed=0)
    batch = next(iter(train))        # {"tokens": int32 (12, 65)}
"""

from __future__ import annotations

import dataclasses

import numpy as np

from epljax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class CharVocab:
  """The sorted characters of a text, as nanoGPT's ``shakespeare_char/prepare.py`` makes it."""
  chars: str

  @classmethod
  def of(cls, text: str) -> "CharVocab":
    return cls("".join(sorted(set(text))))

  def __len__(self) -> int:
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    index = {c: i for i, c in enumerate(self.chars)}
    unknown = sorted(set(text) - index.keys())
    if unknown:
      raise ConfigError(f"characters {unknown[:10]!r} are not in the vocabulary of "
                        f"{len(self.chars)} characters; build it with CharVocab.of(text) from "
                        "a text that holds them")
    return np.fromiter((index[c] for c in text), np.int32, len(text))

  def decode(self, tokens) -> str:
    return "".join(self.chars[int(t)] for t in np.asarray(tokens).reshape(-1))


def split_train_val(tokens: np.ndarray, train_fraction: float = 0.9):
  """The first ``train_fraction`` of the tokens for training, the rest for validation (nanoGPT)."""
  n = int(len(tokens) * train_fraction)
  return tokens[:n], tokens[n:]


def windows(tokens: np.ndarray, length: int, rows: int, *, seed: int,
            process_index: int | None = None, process_count: int | None = None):
  """A Grain ``IterDataset`` of ``{"tokens": int32 (rows, length + 1)}`` batches (module doc).

  ``rows`` is this process's share of the global batch; ``process_index`` / ``process_count``
  default to ``jax.process_index()`` / ``jax.process_count()``.
  """
  try:
    import grain
  except ImportError as e:
    raise ImportError("epljax.data.windows needs Grain, an optional dependency: "
                      'pip install -e ".[grain]" in epljax\'s repository') from e
  import jax

  index = jax.process_index() if process_index is None else process_index
  count = jax.process_count() if process_count is None else process_count
  tokens = np.asarray(tokens, np.int32)
  starts = len(tokens) - length
  if starts < count * rows:
    raise ConfigError(f"{len(tokens)} tokens hold {max(starts, 0)} windows of {length + 1}, "
                      f"fewer than one batch of {rows} rows on each of {count} processes; use "
                      "more text or a shorter length")

  def window(start):
    return tokens[start:start + length + 1]

  ds = grain.MapDataset.range(starts).shuffle(seed=seed)[index::count].repeat()
  return (ds.map(window)
          .batch(rows, drop_remainder=True, batch_fn=lambda w: {"tokens": np.stack(w)})
          .to_iter_dataset())
