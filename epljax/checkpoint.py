"""``epl.Checkpointer``: save and resume a ``TrainState``, on Orbax's ``CheckpointManager``.

    ckpt = epl.Checkpointer("/tmp/run1", max_to_keep=3)
    state = trainer.init(rng, batch)
    if ckpt.latest_step() is not None:
      state = ckpt.restore(trainer)            # the latest step, in the trainer's shardings
    while ...:
      state, metrics = trainer.train_step(state, batch)
      step = int(state.step)
      if step % 100 == 0 or ckpt.reached_preemption(step):
        ckpt.save(step, state)                 # every process calls it
      if ckpt.reached_preemption(step):
        ckpt.wait(); sys.exit(0)
    ckpt.wait()

- **Asynchronous and sharded**: ``save`` returns once the arrays are copied off the devices;
  each process writes the shards it holds while training goes on. ``wait`` blocks until every
  pending save is committed.
- **Atomic**: a step's directory is written under a temporary name and renamed when complete,
  so a job killed mid-save (``kill -9``) leaves the previous checkpoint as the latest.
- **The user's structure**: a checkpoint holds the parameters as ``init_fn`` returned them, the
  optimizer state as ``optimizer.init`` makes it for them, the model state, the step and the
  features' state (loss scale), never the trainer's internal (packed pipeline) layout
  (``epljax.user_state``). So ``restore`` works whatever mesh, number of processes, pipeline
  stages or ZeRO level the checkpoint was saved with: Orbax reads each array straight into the
  trainer's current shardings. A checkpoint of another model is refused, naming the first
  parameter whose path or shape differs. Feature state is restored for the features both
  runs have; a feature the checkpoint lacks starts from its initial state.
- **The data too**: ``save(step, state, data=iterator)`` also stores a Grain
  ``DatasetIterator``'s position (each process its own, ``process_<i>-of-<n>.json`` beside the
  arrays, taken when ``save`` is called), and ``restore(trainer, data=iterator)`` moves a fresh
  iterator of the same pipeline there: the resumed run reads the batches the uninterrupted run
  would have read, no batch repeated and none skipped.
- **Preemption**: ``reached_preemption(step)`` is True on every process at the same step once
  any process got SIGTERM (``epljax.launch.stop_requested``: JAX's preemption sync service
  across processes, started by ``jax.distributed.initialize``; a SIGTERM flag in a single
  process, set up by the first call, after which SIGTERM no longer ends the process by
  itself). Save at that step and exit; ``python -m epljax.launch`` forwards SIGTERM to its
  workers and gives them ``--grace_period`` seconds.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from epljax.errors import CheckpointError
from epljax.launch import worker as launch_worker
from epljax.step import TrainState


class Checkpointer:
  """Saves and restores training states in ``directory`` (module doc).

  Args:
    directory: where the checkpoints go (one subdirectory per step); a local path or any
      path Orbax accepts (``gs://...``). Every process must pass the same one.
    max_to_keep: keep only the newest ``max_to_keep`` checkpoints (None: keep all).
  """

  def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = None):
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
      raise CheckpointError(f"max_to_keep={max_to_keep!r}: use a positive int, or None to "
                            "keep every checkpoint.")
    path = str(directory)
    self.directory = path if "://" in path else os.path.abspath(path)
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                           enable_async_checkpointing=True)
    # The state is Orbax's single item "default" (checkpoints without data read as before);
    # a data iterator's position is the item "data", in Grain's own handler.
    handlers = {"default": ocp.StandardCheckpointHandler()}
    grain_checkpoint = _grain_checkpoint()
    if grain_checkpoint is not None:
      handlers["data"] = grain_checkpoint.CheckpointHandler()
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_handlers=handlers)
    self._watching = False

  # -- saving ------------------------------------------------------------------------------
  def save(self, step: int, state: TrainState, trainer: Any = None, data: Any = None) -> None:
    """Starts saving ``state`` as step ``step``; returns once the arrays are off the devices.

    ``trainer``: the Trainer ``state`` belongs to; found by itself when omitted. ``data``: a
    Grain ``DatasetIterator`` whose position is saved with the state (taken now: the
    iterator may go on while the save completes).
    """
    step = int(step)
    tree = _built_for(state, trainer).user_state.to_user(state)
    if step in self._manager.all_steps():
      raise CheckpointError(f"Step {step} is already saved in {self.directory}; save each "
                            "step once (or remove that step's directory).")
    items = {"default": ocp.args.StandardSave(tree)}
    if data is not None:
      items["data"] = _grain_checkpoint(required=True).CheckpointSave(
          _Position(_iterator_state(data, "save")))
    self._manager.save(step, args=ocp.args.Composite(**items))

  def wait(self) -> None:
    """Blocks until every pending save is committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's threads; the Checkpointer is not
    used after it (a program that exits without it may leave its last save uncommitted)."""
    self._manager.close()

  # -- restoring ---------------------------------------------------------------------------
  def latest_step(self) -> int | None:
    """The newest committed step, or None when the directory holds no checkpoint."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def restore(self, trainer: Any, step: int | None = None, data: Any = None) -> TrainState:
    """Step ``step`` (default: the latest) as a state of ``trainer`` (after ``trainer.init``),
    in the trainer's current shardings. ``data``: a Grain ``DatasetIterator`` of the same
    pipeline, moved to the position saved with the step."""
    built = trainer._require()
    if step is None:
      step = self.latest_step()
      if step is None:
        raise CheckpointError(f"No checkpoint in {self.directory}: nothing to restore. Check "
                              "latest_step() is not None before restoring.")
    elif int(step) not in self._manager.all_steps():
      raise CheckpointError(f"No checkpoint of step {step} in {self.directory}; it holds "
                            f"steps {self.all_steps()}.")
    step = int(step)
    items = self._manager.item_metadata(step)
    saved = items["default"] if "default" in items else None
    saved = getattr(saved, "tree", saved)
    if not isinstance(saved, dict) or "params" not in saved:
      raise CheckpointError(f"Step {step} in {self.directory} is not an epl.Checkpointer "
                            "checkpoint (no 'params' in it); restore it with Orbax directly.")
    user = built.user_state
    target = dict(user.abstract())
    _check_same_model(saved, target, self.directory, step)
    # Feature state: read as saved (small, replicated), then matched by feature name.
    replicated = jax.sharding.NamedSharding(built.layout.mesh, jax.sharding.PartitionSpec())
    target["feature_state"] = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=replicated),
        saved.get("feature_state", {}))
    args = {"default": ocp.args.StandardRestore(target)}
    if data is not None:
      _iterator_state(data, "restore")
      if not os.path.isdir(os.path.join(self.directory, str(step), "data")):
        raise CheckpointError(
            f"Step {step} in {self.directory} holds no data iterator: it was saved with "
            f"ckpt.save(step, state), not ckpt.save(step, state, data=iterator). Restore it "
            "without data=, and position the iterator yourself.")
      args["data"] = _grain_checkpoint(required=True).CheckpointRestore(data)
    tree = dict(self._manager.restore(step, args=ocp.args.Composite(**args))["default"])
    tree["feature_state"] = _match_features(tree["feature_state"], user.feature_state)
    return user.from_user(tree)

  # -- preemption --------------------------------------------------------------------------
  def reached_preemption(self, step: int) -> bool:
    """True when a preemption notice (SIGTERM) arrived and ``step`` is the step at which
    every process saves; call it at every step on every process (module doc)."""
    if not self._watching:
      self._watching = True
      # One process: SIGTERM sets stop_requested's flag, unless a handler is there already
      # (the launcher's, set by epl.init, or the user's own).
      if jax.process_count() == 1 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        launch_worker.watch_stop_signals()
    return bool(launch_worker.stop_requested(int(step)))


def _grain_checkpoint(required: bool = False):
  """``grain.checkpoint``, or None (``required``: an error) when Grain is not installed."""
  try:
    import grain
  except ImportError:
    if required:
      raise CheckpointError("data=: saving a data iterator needs Grain (pip install -e "
                            "'.[grain]' in epljax's repository, or pip install grain).") from None
    return None
  return grain.checkpoint


def _iterator_state(data: Any, what: str) -> Any:
  """The position of a Grain ``DatasetIterator``; other objects are refused."""
  if not (hasattr(data, "get_state") and hasattr(data, "set_state")):
    raise CheckpointError(
        f"ckpt.{what}(..., data={type(data).__name__}): data must be a Grain DatasetIterator "
        "(iter(dataset) of a grain.MapDataset / IterDataset), whose get_state() / "
        "set_state() give and take its position.")
  return data.get_state()


class _Position:
  """A position taken at ``save``, written by Grain's handler (as a non-dataset iterator's
  bytes) whenever the asynchronous save gets to it."""

  def __init__(self, state: Any):
    self._json = json.dumps(state, indent=4).encode()

  def get_state(self) -> bytes:
    return self._json


def _built_for(state: Any, trainer: Any):
  if trainer is not None:
    return trainer._require()
  from epljax.train import trainer_of
  built = trainer_of(state)
  if built is None:
    raise CheckpointError("No live Trainer made this TrainState (its structure and shardings "
                          "match none): pass it, ckpt.save(step, state, trainer=trainer).")
  return built


def _keystr(path) -> str:
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _flat(tree: Any) -> dict[str, tuple]:
  return {_keystr(p): _stored_shape(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _stored_shape(x: Any) -> tuple:
  """The shape as stored: typed PRNG keys (NNX RNG state) are stored as their key data."""
  dtype = getattr(x, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, x).shape)
  return tuple(x.shape)


def _check_same_model(saved: Any, target: dict, directory: str, step: int) -> None:
  """The checkpoint's params, optimizer and model state have the target's paths and shapes."""
  for part in ("params", "opt_state", "model_state"):
    have, want = _flat(saved.get(part, {})), _flat(target[part])
    for path in sorted(set(have) | set(want), key=lambda p: (p not in want, p)):
      if have.get(path) != want.get(path):
        where = f"{part}/{path}" if path else part
        raise CheckpointError(
            f"The checkpoint of step {step} in {directory} is not of this model: at "
            f"'{where}' it holds {_shape(have.get(path))}, the trainer has "
            f"{_shape(want.get(path))}. Restore it with the model (and optimizer) it was "
            "saved from, or use another directory.")


def _shape(shape) -> str:
  return "nothing" if shape is None else f"shape {shape}"


def _match_features(saved: dict, initial: dict) -> dict:
  """The trainer's feature state: saved values where the checkpoint has that feature with the
  same structure and shapes, the initial state otherwise."""
  out = {}
  for name, init in initial.items():
    got = saved.get(name) if isinstance(saved, dict) else None
    same = got is not None and jax.tree.structure(got) == jax.tree.structure(init) and all(
        np.shape(a) == np.shape(b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(init)))
    out[name] = jax.tree.map(lambda g, i: g.astype(np.asarray(i).dtype), got, init) \
        if same else init
  return out
