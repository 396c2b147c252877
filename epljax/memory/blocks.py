"""Where to cut a traced forward function into rematerialized segments.

- ``structural_cuts``: ``gradient_checkpoint.type="auto"``. Blocks are found by the program's
  structure, not by names or op histograms: at every position between two steps we know the
  bytes of activations live across it (what a cut there must keep), and every step's output
  bytes (what recomputing a segment holds again). Chen et al. 2016 ("Training deep nets with
  sublinear memory cost") choose cuts so that the kept bytes plus the largest segment are
  smallest; a dynamic program over the positions does that exactly for each budget of segment
  bytes. Transformer layers, layers built in a loop, alternating kinds of layers and plain
  JAX functions are all cut at their narrow points (the residual stream between layers).
- ``tagged_cuts``: ``gradient_checkpoint.type="collection"``: cut after each tensor tagged
  with ``epl.add_to_collection``.
- ``plan_segments``: turns chosen ranges into a cover of the program, keeping out of the
  rematerialized ranges the steps that must run exactly once (collectives, stateful random
  numbers, side effects), the steps of task graphs past ``end_taskgraph`` and loops whose body
  is rematerialized on its own (``scan_bodies``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import re
from collections.abc import Sequence

from jax.extend import core as jcore

from epljax import strategy as strategy_lib
from epljax.sharding.annotations import ModuleRule, module_rule_for
from epljax.sharding.capture import ANNOTATED
from epljax.sharding.program import MATMULS, Step, Steps, any_eqn, nbytes

# Never recomputed: a collective communicates again, a stateful generator draws new numbers.
# Counter-based random numbers (random_bits, threefry) are pure functions of their key, so
# recomputing them reproduces the same dropout mask bit for bit; saving them instead would
# keep 4 bytes per element per dropout, as much as the activation GC is trying to free.
COLLECTIVES = frozenset({
    "psum", "pmax", "pmin", "ppermute", "pbroadcast", "all_gather", "all_gather_invariant",
    "all_to_all", "ragged_all_to_all", "reduce_scatter", "psum_scatter", "psum_invariant",
})
STATEFUL = frozenset({"rng_uniform"})
# A cut plan that keeps more than this share of the activations is no plan: nothing to cut.
USEFUL = 0.8
BUDGETS = 32      # segment-byte budgets tried by the dynamic program


@dataclasses.dataclass(frozen=True)
class Segment:
  start: int
  stop: int
  remat: bool


@dataclasses.dataclass(frozen=True)
class Cuts:
  """``structural_cuts``' answer: ranges to rematerialize and the estimate behind them."""
  ranges: list[tuple[int, int]]
  kept_bytes: int        # activations live across the cuts (saved for the backward pass)
  segment_bytes: int     # the largest segment's activations (held again while recomputed)
  total_bytes: int       # every step's activations (what plain autodiff may keep)
  pattern: str           # module paths of the segments, for the plan


def has_heavy_loop(step: Step) -> bool:
  """A ``scan`` whose body holds a matmul or convolution (layers under ``nn.scan``)."""
  return step.primitive == "scan" and any_eqn(step.eqn, lambda e: e.primitive.name in MATMULS)


def scan_bodies(program: Steps) -> list[int]:
  """Indices of the steps that are loops over layers: each body is rematerialized per
  iteration (``jax.checkpoint`` of the body, see ``remat.run_segments``)."""
  return [s.index for s in program.steps if has_heavy_loop(s)]


def structural_cuts(program: Steps) -> Cuts:
  """Ranges that minimize kept bytes + largest segment (see the module docstring)."""
  steps = program.steps
  n = len(steps)
  out = [0 if has_heavy_loop(s) else sum(nbytes(v.aval) for v in s.eqn.outvars)
         for s in steps]
  prefix = [0]
  for w in out:
    prefix.append(prefix[-1] + w)
  total = prefix[-1]
  live = _live_bytes(program)
  if n < 2 or total == 0:
    return Cuts([], 0, total, total, "")
  biggest = max(out)
  best = None
  for k in range(BUDGETS + 1):
    budget = int(biggest * (total / max(biggest, 1)) ** (k / BUDGETS))
    found = _cheapest_cuts(prefix, live, budget)
    if found is None:
      continue
    kept, cuts = found
    bounds = [0, *cuts, n]
    seg = max(prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:]))
    if best is None or kept + seg < best[0] + best[1]:
      best = (kept, seg, bounds)
  kept, seg, bounds = best
  if len(bounds) < 3 or kept + seg > USEFUL * total:
    return Cuts([], kept, seg, total, "")
  ranges = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
  return Cuts(ranges, kept, seg, total, _pattern(program, ranges))


def _live_bytes(program: Steps) -> list[int]:
  """live[c]: bytes of values defined before step c and read at or after it (c = 0..n)."""
  steps = program.steps
  n = len(steps)
  defined: dict = {}
  for s in steps:
    for k, v in zip(s.outputs, s.eqn.outvars):
      if k is not None:
        defined[k] = (s.index, nbytes(v.aval))
  last: dict = {}
  for s in steps:
    for a in s.inputs:
      if not isinstance(a, jcore.Literal) and a in defined:
        last[a] = s.index
  for a in program.outputs:
    if not isinstance(a, jcore.Literal) and a in defined:
      last[a] = n
  delta = [0] * (n + 2)
  for k, use in last.items():
    d, size = defined[k]
    delta[d + 1] += size
    delta[use + 1] -= size
  live, acc = [], 0
  for c in range(n + 1):
    acc += delta[c]
    live.append(acc)
  live[n] = 0
  return live


def _cheapest_cuts(prefix: list[int], live: list[int], budget: int):
  """The cuts with the fewest kept bytes such that no segment holds more than ``budget``
  bytes of activations: (kept bytes, cut positions), or None when no cover fits.

  f[c] = live[c] + min f[a] over a < c with prefix[c] - prefix[a] <= budget; the valid a form a
  window that only moves right, so a monotone queue gives each minimum in O(1).
  """
  n = len(prefix) - 1
  cost = [0] + [None] * n
  back = [0] * (n + 1)
  window: collections.deque[int] = collections.deque([0])
  lo = 0
  for c in range(1, n + 1):
    while prefix[c] - prefix[lo] > budget:
      lo += 1
    while window and window[0] < lo:
      window.popleft()
    if not window:
      return None
    a = window[0]
    cost[c] = cost[a] + live[c]
    back[c] = a
    while window and cost[window[-1]] >= cost[c]:
      window.pop()
    window.append(c)
  cuts, c = [], back[n]
  while c > 0:
    cuts.append(c)
    c = back[c]
  return cost[n], sorted(cuts)


def _pattern(program: Steps, ranges: Sequence[tuple[int, int]]) -> str:
  """The module paths of the segments, digits folded (``Deep/layers_*``), most common first."""
  names = collections.Counter()
  for a, b in ranges:
    frames = [s.frames for s in program.steps[a:b] if s.frames and any_eqn(
        s.eqn, lambda e: e.primitive.name in MATMULS)]
    if not frames:
      continue
    common = os.path.commonprefix(frames)   # element-wise: the shared leading frames
    if common:
      names[re.sub(r"\d+", "*", "/".join(common))] += 1
  return ", ".join(name for name, _ in names.most_common(3)) or "no module names"


def tagged_cuts(program: Steps, tag: str) -> tuple[list[tuple[int, int]], int]:
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
  return any_eqn(step.eqn, lambda e: e.primitive.name in COLLECTIVES | STATEFUL
                  or bool(_real_effects(e)))


def _real_effects(eqn) -> list:
  return [e for e in eqn.effects if type(e).__name__ not in (
      "NamedAxisEffect", "InternalMutableArrayEffect")]


def step_taskgraphs(program: Steps, taskgraphs: Sequence,
                    module_rules: Sequence[ModuleRule] = ()) -> list[int | None]:
  """The task graph of every step, read as the capture reads it (``sharding.capture``).

  A step inside a scope belongs to that scope's task graph; in a module an ``epl.annotate``
  rule names, to that rule's; after a ``set_default_strategy`` marker, to that default's;
  otherwise to the task graph of the step before it (the first one's for leading steps), as
  the capture assigns unannotated code by data flow.
  """
  by_label, by_rule = {}, []
  top = None
  for tg in taskgraphs:
    frame = strategy_lib.parse_frame(tg.scope) if tg.scope else None
    if tg.scope.startswith(ANNOTATED):
      by_rule.append(tg)
    elif frame is None:
      top = tg.index if tg.scope else top
    else:
      by_label[frame.label] = tg.index
  current = top
  found: list[int | None] = []
  for s in program.steps:
    frame = next((f for f in map(strategy_lib.parse_frame, reversed(s.frames)) if f), None)
    if frame is not None and not frame.default:
      found.append(by_label.get(frame.label, current))
      continue
    if frame is not None:
      current = by_label.get(frame.label, current)
    rule = module_rule_for(s.module_frames, module_rules)
    found.append(current if rule is None else _rule_taskgraph(rule, by_rule, current))
  last = None
  for i, tg in enumerate(found):
    found[i] = last = tg if tg is not None else last
  first = next((tg for tg in found if tg is not None), None)
  return [first if tg is None else tg for tg in found]


def _rule_taskgraph(rule: ModuleRule, annotated: Sequence, default: int | None) -> int | None:
  """The task graph the capture made for ``rule``: rules with one strategy share one."""
  s = rule.strategy
  for tg in annotated:
    if (tg.name == s.name if s.name else
        (tg.strategy, tg.device_count) == (s.kind, s.device_count)):
      return tg.index
  return default


def plan_segments(program: Steps, ranges: Sequence[tuple[int, int]],
                  keep: Sequence[bool]) -> list[Segment]:
  """A cover of all steps: ``ranges`` rematerialized except steps where ``keep`` is False or
  that must run once, everything else plain."""
  steps = program.steps
  remat, block_of = [False] * len(steps), [None] * len(steps)
  for block, (a, b) in enumerate(ranges):
    for i in range(a, b):
      remat[i] = keep[i] and not must_run_once(steps[i]) and not has_heavy_loop(steps[i])
      block_of[i] = block
  segments = []
  for (flag, _), run in itertools.groupby(range(len(steps)),
                                          key=lambda i: (remat[i], remat[i] and block_of[i])):
    run = list(run)
    segments.append(Segment(run[0], run[-1] + 1, flag))
  return segments
