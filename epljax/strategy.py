"""Strategy scopes: ``replicate``, ``split`` and ``set_default_strategy``.

A scope tags the operations traced inside it with a ``jax.named_scope`` frame such as
``epl.split(8)[name=classifier]``. The frame travels with every equation of the jaxpr (and
into the backward pass), so the traced program itself says which task graph each operation
belongs to; ``epljax.sharding.capture`` reads it back. Nothing is recorded on the side, which
keeps the tagging correct under JAX's tracing caches.

A scope without a ``name`` is identified by where it is written (``model.py:42``); entering the
same line again in one trace (a loop, or a model called twice) makes a new task graph, as each
annotation does in EPL. Give scopes a ``name`` to make several entries one task graph.

``set_default_strategy`` called outside any trace sets the strategy of everything outside
scopes. Called while the model is being traced (inside ``__call__``, as in EPL's BERT pipeline
example) it starts a new task graph for the operations traced after it; it leaves a marker
equation in the program so the capture can tell where.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import threading
from collections.abc import Iterator

import warnings

import jax
import jax.numpy as jnp
from jax._src import core as jax_core   # trace_state_clean: is any trace in progress?

from epljax.errors import ScopeError

REPLICATE = "replicate"
SPLIT = "split"


@dataclasses.dataclass(frozen=True)
class TaskGraph:
  """A part of the model with one parallel strategy.

  ``index`` orders task graphs by where their first operation appears in the traced program
  (pipeline stages run in this order). ``name`` is the scope's ``name`` or ``taskgraph_<i>``.
  ``scope`` is the frame text that tags its operations.
  """
  index: int
  name: str
  strategy: str
  device_count: int
  scope: str = dataclasses.field(default="", compare=False, repr=False)


class Strategy:
  """A parallel strategy: a context manager, or the argument of ``set_default_strategy``."""

  kind: str = ""

  def __init__(self, device_count: int | None = None, name: str | None = None):
    if device_count is not None and (
        isinstance(device_count, bool) or not isinstance(device_count, int) or device_count < 1):
      raise ScopeError(f"epl.{self.kind}(device_count={device_count!r}): device_count must be a "
                       "positive integer (the devices one model replica of this part uses).")
    if name is not None and (not isinstance(name, str) or not re.fullmatch(r"[\w.\-]+", name)):
      raise ScopeError(f"epl.{self.kind}(name={name!r}): a name is letters, digits, '_', '.' "
                       "or '-', for example name='stage_0'.")
    self.device_count = device_count
    self.name = name
    self._frames: list[contextlib.AbstractContextManager] = []

  def __repr__(self) -> str:
    args = [repr(self.device_count)] if self.device_count is not None else []
    if self.name is not None:
      args.append(f"name={self.name!r}")
    return f"epl.{self.kind}({', '.join(args)})"

  def __enter__(self) -> Strategy:
    state = _state()
    if state.active is not None:
      raise ScopeError(_NESTED.format(inner=self, outer=state.active[0]))
    where = _caller()
    if _outside_trace():
      _GLOBAL.untraced.append(f"{self!r} at {_site(where)}")
      del _GLOBAL.untraced[:-8]
    frame = _frame_text(self, where, default=False)
    ctx = jax.named_scope(frame)
    ctx.__enter__()
    state.active = (self, ctx)
    return self

  def __exit__(self, *exc) -> None:
    state = _state()
    active, state.active = state.active, None
    if active is not None:
      active[1].__exit__(*exc)


class Replicate(Strategy):
  kind = REPLICATE


class Split(Strategy):
  kind = SPLIT


def replicate(device_count: int | None = None, name: str | None = None) -> Replicate:
  """Data parallelism for what is inside: each replica of it uses ``device_count`` devices
  (default 1) and sees its own part of the batch; the number of replicas is inferred from the
  devices. With ``device_count=k > 1`` each replica's micro batch is split over its k devices.

  >>> with epl.replicate(1):       # doctest: +SKIP
  ...   y = model(x)
  """
  return Replicate(device_count, name)


def split(device_count: int | None = None, name: str | None = None) -> Split:
  """Tensor or expert parallelism: the parameters used inside are split over ``device_count``
  devices (default: every device)."""
  return Split(device_count, name)


def set_default_strategy(strategy: Strategy) -> None:
  """The strategy of operations outside any scope.

  Outside a trace this sets the default for every model traced later. Inside a trace (in a
  model's ``__call__``) it starts a new task graph for what is traced after it.
  """
  if not isinstance(strategy, Strategy):
    raise ScopeError(f"set_default_strategy expects epl.replicate(...) or epl.split(...), got "
                     f"{strategy!r}.")
  state = _state()
  if state.active is not None:
    raise ScopeError(f"set_default_strategy({strategy!r}) was called inside the scope "
                     f"{state.active[0]!r}; strategy scopes cannot be nested. Call it outside "
                     "the `with` block.")
  where = _caller()
  frame = _frame_text(strategy, where, default=True)
  with jax.named_scope(frame):
    marker = jax.lax.iota(jnp.int32, 1)
  if not isinstance(marker, jax.core.Tracer):
    # Outside a trace: the default for later traces. Model code run eagerly (a Linen
    # model.init in a notebook) lands here too; the capture ignores a default set from a call
    # site that also cuts the traced program (see Frame.site).
    _GLOBAL.default = strategy
    _GLOBAL.default_site = _site(where)


@dataclasses.dataclass(frozen=True)
class Defaults:
  """The default strategy a trace starts from, and where it was set (``file.py:line``): the
  user's ``set_default_strategy`` (``current``), or a plan search's candidate."""
  strategy: Strategy | None = None
  site: str | None = None

  @classmethod
  def current(cls) -> Defaults:
    return cls(_GLOBAL.default, _GLOBAL.default_site)


def default_strategy() -> Strategy | None:
  """The strategy set by ``set_default_strategy`` outside any trace, if any."""
  return _GLOBAL.default


def default_strategy_site() -> str | None:
  """Where that default was set (``file.py:line``)."""
  return _GLOBAL.default_site


def reset() -> None:
  """Forget the default strategy and any scope state (``epl.init`` calls this)."""
  _GLOBAL.default = None
  _GLOBAL.default_site = None
  _GLOBAL.untraced = []
  _LOCAL.__dict__.clear()


def warn_scopes_outside_trace(found_scope: bool) -> None:
  """After a capture: scopes entered outside any trace since the last one (around module
  construction, ``trainer.init`` or an eager call) act on nothing; when the traced loss holds
  no scope at all, say so and where scopes go (else the run is silently pure data parallel)."""
  untraced, _GLOBAL.untraced = _GLOBAL.untraced, []
  if untraced and not found_scope:
    warnings.warn(_OUTSIDE_TRACE.format(scopes="; ".join(dict.fromkeys(untraced))),
                  stacklevel=_caller_outside_epljax())


def _caller_outside_epljax() -> int:
  """The ``stacklevel`` of the first caller outside epljax (the user's ``trainer.init``)."""
  root = os.path.dirname(os.path.abspath(__file__))
  frame, level = sys._getframe(2), 2
  while frame is not None and frame.f_code.co_filename.startswith(root):
    frame, level = frame.f_back, level + 1
  return level


def _outside_trace() -> bool:
  clean = getattr(jax_core, "trace_state_clean", None)
  return clean is not None and clean()


@contextlib.contextmanager
def trace_session() -> Iterator[None]:
  """Wraps each trace epljax makes, so unnamed scopes are numbered the same in every trace."""
  state = _state()
  saved = state.occurrences
  state.occurrences = {}
  try:
    yield
  finally:
    state.occurrences = saved


# -- frames: the text a scope leaves in the name stack, and reading it back -------------------

_FRAME = re.compile(r"^epl\.(?P<default>default\.)?(?P<kind>replicate|split)\((?P<count>\d*)\)"
                    r"\[(?P<label>[^\]]+)\](?:@(?P<site>.+))?$")


@dataclasses.dataclass(frozen=True)
class Frame:
  kind: str
  device_count: int | None
  label: str          # 'name=stage_0' or 'at=model.py:42' (+ '#2' for a second entry)
  default: bool       # a set_default_strategy marker rather than a `with` scope
  text: str
  site: str = ""      # markers: the call site, file.py:line

  @property
  def user_name(self) -> str | None:
    return self.label[len("name="):] if self.label.startswith("name=") else None


def parse_frame(text: str) -> Frame | None:
  m = _FRAME.match(text)
  if m is None:
    return None
  count = int(m["count"]) if m["count"] else None
  return Frame(m["kind"], count, m["label"], bool(m["default"]), text, m["site"] or "")


def _frame_text(strategy: Strategy, where: tuple[str, int], default: bool) -> str:
  if strategy.name is not None:
    label = f"name={strategy.name}"
  else:
    path, line = where
    label = f"at={os.path.basename(path)}:{line}"
    seen = _state().occurrences
    owner = seen.setdefault(("path", label), path)
    if owner != path:  # two files with the same basename and line: keep them apart
      label = f"at={path}:{line}"
    seen[label] = seen.get(label, 0) + 1
    if seen[label] > 1:
      label += f"#{seen[label]}"
  count = "" if strategy.device_count is None else str(strategy.device_count)
  if default:
    return f"epl.default.{strategy.kind}({count})[{label}]@{_site(where)}"
  return f"epl.{strategy.kind}({count})[{label}]"


def _caller() -> tuple[str, int]:
  frame = sys._getframe(2)
  return frame.f_code.co_filename, frame.f_lineno


def _site(where: tuple[str, int]) -> str:
  return f"{os.path.basename(where[0])}:{where[1]}"


# -- state -------------------------------------------------------------------------------------

class _Global:
  default: Strategy | None = None
  default_site: str | None = None
  untraced: list[str] = []     # scopes entered outside any trace (warn_scopes_outside_trace)


_GLOBAL = _Global()
_LOCAL = threading.local()


class _ScopeState:
  def __init__(self):
    self.active: tuple[Strategy, contextlib.AbstractContextManager] | None = None
    self.occurrences: dict = {}


def _state() -> _ScopeState:
  if not hasattr(_LOCAL, "state"):
    _LOCAL.state = _ScopeState()
  return _LOCAL.state


_NESTED = """\
{inner!r} was entered inside {outer!r}: strategy scopes cannot be nested (EPL's rule).
Close the outer scope first and give each part its own scope, one after the other:

    with epl.replicate(1):      # not: with epl.replicate(1):
      features = body(x)        #        with epl.split(8):
    with epl.split(8):          #          ...
      logits = head(features)
"""

_OUTSIDE_TRACE = """\
The strategy scope(s) {scopes} were entered outside the traced computation (around module
construction, trainer.init or an eager call), so they act on nothing: the traced loss holds
no scope and this model trains as plain data parallelism. A scope applies to the operations
traced inside it; put it where the forward pass runs, in the model's __call__ or in loss_fn:

    class Model(nn.Module):             # not: with epl.split(8):
      def __call__(self, x):            #        model = Model()
        with epl.replicate(1):          # nor: with epl.split(8):
          h = self.body(x)              #        state = trainer.init(rng, batch)
        with epl.split(8):
          return self.head(h)
"""
