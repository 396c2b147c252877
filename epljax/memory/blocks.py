"""Where to cut a traced forward function into rematerialized segments.

- ``repeated_blocks``: EPL's automatic choice. The name stack of every equation holds the
  module path (Flax: ``Model/layers_3/attention``). At the shallowest depth where 4 or more
  differently named consecutive runs of equations have the same histogram of primitives, those
  runs are the model's repeated blocks (transformer layers).
- ``balanced_segments``: no repetition found (a plain JAX function, distinct layers): about
  sqrt(L) segments of equal activation bytes, L the number of matmuls/convolutions
  (Chen et al. 2016, "Training deep nets with sublinear memory cost").
- ``tagged_cuts``: ``gradient_checkpoint.type="collection"``: cut after each tensor tagged
  with ``epl.add_to_collection``.
- ``plan_segments``: turns chosen ranges into a cover of the program, keeping out of the
  rematerialized ranges the steps that must run exactly once (collectives, stateful random
  numbers, side effects) and the steps of task graphs past ``end_taskgraph``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

from jax.extend import core as jcore

from epljax import strategy as strategy_lib
from epljax.memory.interpret import Program, Step, nbytes

MIN_REPEATS = 4

# Never recomputed: a collective communicates again, a stateful generator draws new numbers.
# Counter-based random numbers (random_bits, threefry) are pure functions of their key, so
# recomputing them reproduces the same dropout mask bit for bit; saving them instead would
# keep 4 bytes per element per dropout, as much as the activation GC is trying to free.
COLLECTIVES = frozenset({
    "psum", "pmax", "pmin", "ppermute", "pbroadcast", "all_gather", "all_gather_invariant",
    "all_to_all", "ragged_all_to_all", "reduce_scatter", "psum_scatter", "psum_invariant",
})
STATEFUL = frozenset({"rng_uniform"})
HEAVY = frozenset({"dot_general", "conv_general_dilated"})
# Dtype casts differ between otherwise identical blocks under mixed precision (the first
# block's input may arrive in another dtype): they do not count in a block's histogram.
IGNORED = frozenset({"convert_element_type"})


@dataclasses.dataclass(frozen=True)
class Segment:
  start: int
  stop: int
  remat: bool


def repeated_blocks(program: Program) -> tuple[list[tuple[int, int]], str]:
  """Ranges of the repeated blocks and their name pattern, or ``([], "")``."""
  steps = program.steps
  depth_max = max((len(s.frames) for s in steps), default=0)
  for depth in range(depth_max):
    by_histogram: dict[frozenset, list[tuple[tuple[str, ...], int, int]]] = {}
    for prefix, start, stop in _runs(steps, depth):
      hist = frozenset(collections.Counter(s.primitive for s in steps[start:stop]
                                           if s.primitive not in IGNORED).items())
      by_histogram.setdefault(hist, []).append((prefix, start, stop))
    candidates = [runs for runs in by_histogram.values()
                  if len({p for p, _, _ in runs}) >= MIN_REPEATS]
    if candidates:
      best = max(candidates, key=lambda runs: sum(b - a for _, a, b in runs))
      names = [p[-1] for p, _, _ in best]
      pattern = "/".join(best[0][0][:-1] + (_pattern(names),))
      return [(a, b) for _, a, b in best], pattern
  return [], ""


def _runs(steps: Sequence[Step], depth: int):
  """Maximal runs of consecutive steps sharing the name-stack prefix of length depth+1."""
  runs, current = [], None
  for s in steps:
    prefix = s.frames[:depth + 1] if len(s.frames) > depth else None
    if current is not None and prefix == current[0]:
      current[2] = s.index + 1
      continue
    if current is not None and current[0] is not None:
      runs.append(tuple(current))
    current = [prefix, s.index, s.index + 1]
  if current is not None and current[0] is not None:
    runs.append(tuple(current))
  return runs


def _pattern(names: Sequence[str]) -> str:
  common = _common_prefix(names)
  return f"{common}*" if common and len(set(names)) > 1 else names[0]


def _common_prefix(names: Sequence[str]) -> str:
  first, last = min(names), max(names)
  i = 0
  while i < min(len(first), len(last)) and first[i] == last[i]:
    i += 1
  return first[:i]


def balanced_segments(program: Program) -> list[tuple[int, int]]:
  """About sqrt(L) consecutive ranges holding equal bytes of outputs (activations)."""
  steps = program.steps
  layers = sum(s.primitive in HEAVY for s in steps)
  count = max(2, round(math.sqrt(max(layers, 1))))
  weights = [sum(nbytes(v.aval) for v in s.eqn.outvars) for s in steps]
  total = sum(weights)
  if total == 0 or len(steps) < 2:
    return [(0, len(steps))] if steps else []
  ranges, start, acc = [], 0, 0
  for s, w in zip(steps, weights):
    acc += w
    if acc >= total * (len(ranges) + 1) / count and len(ranges) < count - 1:
      ranges.append((start, s.index + 1))
      start = s.index + 1
  if start < len(steps):
    ranges.append((start, len(steps)))
  return ranges


def tagged_cuts(program: Program, tag: str) -> tuple[list[tuple[int, int]], int]:
  """Ranges that end right after each step producing a tensor tagged with ``tag``, and the
  number of tagged tensors found."""
  tagged: set = set()
  for s in program.steps:
    if s.primitive == "name" and s.eqn.params.get("name") == tag and not isinstance(
        s.inputs[0], jcore.Literal):
      tagged.add(s.inputs[0])
  cuts = sorted({s.index + 1 for s in program.steps
                 if any(k in tagged for k in s.outputs if k is not None)})
  bounds = [0, *[c for c in cuts if 0 < c < len(program.steps)], len(program.steps)]
  ranges = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
  return ranges, len(tagged)


def must_run_once(step: Step) -> bool:
  """Collectives, stateful random numbers and side effects, here or in a nested jaxpr."""
  return _any_eqn(step.eqn, lambda e: e.primitive.name in COLLECTIVES | STATEFUL
                  or bool(_real_effects(e)))


def _real_effects(eqn) -> list:
  return [e for e in eqn.effects if type(e).__name__ not in (
      "NamedAxisEffect", "InternalMutableArrayEffect")]


def _any_eqn(eqn, pred) -> bool:
  if pred(eqn):
    return True
  for sub in jcore.jaxprs_in_params(eqn.params):
    if any(_any_eqn(e, pred) for e in sub.eqns):
      return True
  return False


def step_taskgraphs(program: Program, taskgraphs: Sequence) -> list[int | None]:
  """The task graph of every step, read from the strategy frames of its name stack.

  A step inside a scope belongs to that scope's task graph; after a ``set_default_strategy``
  marker, to that default's; otherwise to the task graph of the step before it (the first
  one's for leading steps), as the capture assigns unannotated code by data flow.
  """
  by_label = {}
  top = None
  for tg in taskgraphs:
    frame = strategy_lib.parse_frame(tg.scope) if tg.scope else None
    if frame is None:
      top = tg.index if tg.scope else top
    else:
      by_label[frame.label] = tg.index
  current = top
  found: list[int | None] = []
  for s in program.steps:
    frame = next((f for f in map(strategy_lib.parse_frame, reversed(s.frames)) if f), None)
    if frame is not None and frame.default:
      current = by_label.get(frame.label, current)
      found.append(current)
    elif frame is not None:
      found.append(by_label.get(frame.label, current))
    else:
      found.append(current)
  last = None
  for i, tg in enumerate(found):
    found[i] = last = tg if tg is not None else last
  first = next((tg for tg in found if tg is not None), None)
  return [first if tg is None else tg for tg in found]


def plan_segments(program: Program, ranges: Sequence[tuple[int, int]],
                  keep: Sequence[bool]) -> list[Segment]:
  """A cover of all steps: ``ranges`` rematerialized except steps where ``keep`` is False or
  that must run once, everything else plain."""
  steps = program.steps
  remat = [False] * len(steps)
  for a, b in ranges:
    for i in range(a, b):
      remat[i] = keep[i] and not must_run_once(steps[i])
  block_of = [None] * len(steps)
  for n, (a, b) in enumerate(ranges):
    for i in range(a, b):
      block_of[i] = n
  segments: list[Segment] = []
  for i in range(len(steps)):
    key = (remat[i], block_of[i] if remat[i] else None)
    if segments and segments[-1].stop == i and (segments[-1].remat, _block(
        segments[-1], block_of)) == key:
      segments[-1] = Segment(segments[-1].start, i + 1, remat[i])
    else:
      segments.append(Segment(i, i + 1, remat[i]))
  return segments


def _block(segment: Segment, block_of) -> int | None:
  return block_of[segment.start] if segment.remat else None
