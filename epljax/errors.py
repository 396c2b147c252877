"""One error base class for everything epljax refuses, so callers can catch it in one place,
and the warnings for what runs but not as it should.

Subclasses also derive from the builtin a Python user would expect (``ValueError`` for bad
values, ``RuntimeError`` for calls made in the wrong order), so ``except ValueError`` works too.
"""

from __future__ import annotations


class EPLError(Exception):
  """Base class of every error epljax raises on purpose."""


class ConfigError(EPLError, ValueError):
  """A configuration key, type or value that is not allowed."""


class ScopeError(EPLError, ValueError):
  """A strategy scope used in a way EPL does not allow (nesting, conflicting names)."""


class PlanError(EPLError, ValueError):
  """The model, its annotations, the batch and the devices do not fit together."""


class StateError(EPLError, RuntimeError):
  """A call made before what it needs exists (``epl.init``, ``Trainer.init``)."""


class CheckpointError(EPLError, ValueError):
  """A checkpoint that cannot be saved or restored as asked (missing, of another model)."""


class NonFiniteError(EPLError, FloatingPointError):
  """Training stopped: too many steps in a row had a non-finite loss or gradients."""


class PipelineWarning(UserWarning):
  """A pipeline that runs, but not the way it should (too few micro batches, scanned layers
  every stage holds whole)."""


def listing(names, limit: int = 3) -> str:
  """A few of ``names`` quoted for a message (``'a', 'b', 'c' ...``)."""
  names = list(names)
  return ", ".join(f"'{n}'" for n in names[:limit]) + (" ..." if len(names) > limit else "")


def size(n: float) -> str:
  """A byte count for a message or a table: ``512 B``, ``1.5 KiB``, ``3.0 MiB``, ``2.0 GiB``."""
  for unit in ("B", "KiB", "MiB"):
    if n < 1024:
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n:.1f} GiB"
