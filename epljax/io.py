"""Each worker's share of the input: its files (``config.io``) and its rows of a batch.

In a multi-process job every worker feeds ``train_step`` its own slice of the global batch.
Two ways to get there:

- **Files** (``io.slicing``): ``slice_files(files)`` gives this worker its files, with EPL's
  rules: ``n`` files over ``W`` workers, file ``i`` goes to worker ``i % W``, so each worker
  reads a disjoint part and the workers together read everything once.

  ================================  ======================================================
  ``n % W == 0``                    even split, ``n / W`` files each
  ``io.unbalanced_io_slicing``      workers ``0 .. n % W - 1`` get one file more
  ``io.drop_last_files``            the last ``n % W`` files are dropped, then even split
  neither                           ``IOSlicingError`` naming the sizes and the options
  fewer files than workers          ``IOSlicingError`` (a worker without data would stall
                                    the job), whatever the options
  ``io.slicing=False``              every worker gets every file
  ================================  ======================================================

  EPL turned slicing off with a warning where epljax refuses; setting both options is refused
  too. The list works with any reader: ``iter_records(files, read)`` chains a plain Python
  reader over this worker's files, ``grain_files(files)`` gives them as a Grain
  ``MapDataset`` (``pip install grain``) to ``.map`` a reader over.

- **Rows**: every worker computes (or loads) the same global batch and keeps its rows with
  ``process_slice(global_batch)``; ``Trainer.shard_batch`` (called by ``train_step``) puts the
  slices of all workers back together as one global array
  (``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from epljax.config import IOConfig
from epljax.errors import ConfigError, PlanError

T = TypeVar("T")
R = TypeVar("R")


class IOSlicingError(ConfigError):
  """The files cannot be divided over the workers with the ``io`` options given."""


def slice_files(files: Sequence[T], *, config: IOConfig | None = None,
                num_workers: int | None = None, worker_index: int | None = None) -> list[T]:
  """This worker's files under ``config.io`` (module doc). Defaults come from ``epl.Env``."""
  if config is None or num_workers is None or worker_index is None:
    from epljax.env import Env
    env = Env.get()
    config = env.config.io if config is None else config
    num_workers = env.cluster.worker_num if num_workers is None else num_workers
    worker_index = env.cluster.worker_index if worker_index is None else worker_index
  files = list(files)
  if not config.slicing:
    return files
  if config.unbalanced_io_slicing and config.drop_last_files:
    raise IOSlicingError(
        "io.unbalanced_io_slicing and io.drop_last_files are both set, but they disagree on "
        "the files that do not divide over the workers (give some workers one more, or drop "
        "them). Set one of them.")
  n, w = len(files), num_workers
  if n < w:
    raise IOSlicingError(
        f"io.slicing: {n} files cannot be shared by {w} workers; each worker needs at least one "
        f"file. Split the data into at least {w} files (a multiple of {w} for an even split), "
        "or set io.slicing=False so that every worker reads every file.")
  extra = n % w
  if extra and not config.unbalanced_io_slicing:
    if not config.drop_last_files:
      raise IOSlicingError(
          f"io.slicing: {n} files do not divide evenly over {w} workers ({n} = {w} x {n // w} "
          f"+ {extra}). Set io.unbalanced_io_slicing=True to give {extra} worker(s) one file "
          f"more, or io.drop_last_files=True to drop the last {extra} file(s), or use a "
          f"multiple of {w} files.")
    files = files[:n - extra]
  return files[worker_index::w]


def iter_records(files: Sequence[T], read: Callable[[T], Iterable[R]], **kwargs) -> Iterator[R]:
  """The records of this worker's files, in order: ``read(file)`` for each, chained."""
  return itertools.chain.from_iterable(read(f) for f in slice_files(files, **kwargs))


def grain_files(files: Sequence[T], **kwargs) -> Any:
  """This worker's files as a ``grain.MapDataset`` (Grain is optional: ``pip install grain``).

  >>> ds = grain_files(paths).map(load_file)      # doctest: +SKIP
  """
  try:
    import grain
  except ImportError:
    raise ImportError("epljax.io.grain_files needs Grain: pip install grain (or use "
                      "slice_files / iter_records with any other reader).") from None
  return grain.MapDataset.source(slice_files(files, **kwargs))


def process_slice(global_batch: Any, plan: Any = None) -> Any:
  """This process's rows of ``global_batch`` (what it passes to ``train_step``).

  Without ``plan``: block ``jax.process_index()`` of ``jax.process_count()`` equal blocks, the
  rows of this process's devices under epljax's default placement (replicas in process
  order). With ``trainer.plan``: exactly the rows the step's batch sharding puts on this
  process's devices, whatever the placement.
  """
  count, index = jax.process_count(), jax.process_index()
  leaves = jax.tree.leaves(global_batch)
  if not leaves:
    return global_batch
  rows = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
  if len(rows) != 1 or None in rows:
    raise PlanError(f"Batch leaves have leading sizes {sorted(map(str, rows))}; every leaf needs "
                    "the same leading (batch) dimension.")
  total = rows.pop()
  if total % count:
    raise PlanError(f"The global batch of {total} rows does not divide over {count} processes; "
                    f"use a multiple of {count} rows.")
  if plan is None:
    per = total // count
    return jax.tree.map(lambda x: x[index * per:(index + 1) * per], global_batch)
  sharding = NamedSharding(plan.mesh, P(tuple(plan.batch_axes)))
  spans = sorted({(s[0].start or 0, total if s[0].stop is None else s[0].stop)
                  for s in sharding.addressable_devices_indices_map((total,)).values()})
  return jax.tree.map(lambda x: np.concatenate([np.asarray(x)[a:b] for a, b in spans]),
                      global_batch)
