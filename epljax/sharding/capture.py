"""Capture: trace the loss, tag every equation with its task graph, and every input with the
task graph of the equations that consume it.

Rules, in order:
1. An equation inside a ``with epl.replicate/split`` scope belongs to that scope's task graph.
2. Else, inside a module matched by an ``epl.annotate`` module-path rule: that rule's.
3. Else, the default strategy in force when it was traced: the one set by
   ``set_default_strategy`` before tracing, or by the last call made during the trace.
4. Anything left (no default in force) joins a task graph by data flow: the latest task graph
   among the producers of its inputs; failing that, the earliest among its consumers. So code
   before the first scope (an embedding lookup) joins the first task graph and code after the
   last (the loss) joins the last.
5. A model with no annotation at all is one ``replicate(1)`` task graph: data parallelism.

A parameter belongs to the task graph of the equations that use it. A parameter used by two
named ``replicate`` task graphs belongs to the first (pipeline stages each hold it: tied
embeddings). Any other parameter used by two task graphs is an error: EPL places task graphs
on different devices, so the choice matters
and epljax will not guess. One exception is EPL's MoE pattern: a variable *defined* under a
``split`` scope (its initializer traced inside it) belongs to that split task graph even when
the code using it is outside the scope.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from epljax import strategy as strategy_lib
from epljax.errors import PlanError, ScopeError
from epljax.sharding.annotations import ModuleRule, module_rule_for, warn_unmatched
from epljax.sharding.program import Node, Program
from epljax.strategy import SPLIT, Frame, TaskGraph

_DEFAULT = "default"
_MARKER = "marker"


@dataclasses.dataclass(frozen=True)
class Capture:
  """The traced loss and what the annotations made of it."""
  program: Program
  taskgraphs: tuple[TaskGraph, ...]
  node_taskgraph: tuple[int, ...]                 # per program node (-1: a marker)
  node_explicit: tuple[bool, ...]                 # per node: tagged by rules 1-3, not data flow
  input_taskgraph: tuple[int | None, ...]         # per variable leaf; None when unused
  input_explicit: tuple[bool, ...]                # per variable leaf: used by a tagged node
  input_paths: tuple[str, ...]                    # per variable leaf
  module_rules: tuple[ModuleRule, ...] = ()       # the epl.annotate module rules it applied


ANNOTATED = "epl.annotate "   # the scope text of a task graph an annotate rule made


@dataclasses.dataclass(frozen=True)
class _Spec:
  kind: str
  device_count: int | None
  user_name: str | None
  scope: str


def capture(fn: Callable[..., Any], variables: Sequence[Any], extra: Sequence[Any], *,
            input_paths: Sequence[str], num_devices: int,
            module_rules: Sequence[ModuleRule] = (),
            defaults: strategy_lib.Defaults | None = None,
            definitions: Sequence[Frame | None] = (),
            stage_cuts: Sequence[int] | None = None,
            rewrite: Callable[[Any], Any] | None = None) -> Capture:
  """Traces ``fn(*variables, *extra)`` on abstract values and assigns task graphs.

  ``variables`` are flat leaves (parameters and model state) named by ``input_paths``;
  ``extra`` (the batch) is traced too but never checked for being shared. ``definitions``
  gives, per variable leaf, the scope frame its initializer was traced in (``defining_frames``).
  ``stage_cuts`` (``auto.auto_parallel``): the node indices where stages 1.. start; the nodes
  are cut into ``stage_<i>`` task graphs of the model's one strategy. ``rewrite``: applied to
  the traced program first (``pipeline.chunks.split_scan``: scanned layers in stage chunks).
  """
  with strategy_lib.trace_session():
    closed = jax.make_jaxpr(fn)(*variables, *extra)
    if rewrite is not None:
      closed = rewrite(closed)
  program = Program(closed)
  top_default = _top_default(program, defaults or strategy_lib.Defaults.current())
  specs: dict[str, _Spec] = {}
  labels, explicit, order = _assign_labels(program, top_default, module_rules, specs)
  if stage_cuts is not None:
    labels, explicit, order = _cut_into_stages(program, labels, order, specs, stage_cuts)
  defined = _definition_labels(definitions, len(variables), specs)
  for lab in defined:
    if lab is not None and lab not in order:
      order.append(lab)
  taskgraphs, by_label = _taskgraphs(order, specs, num_devices)
  strategy_lib.warn_scopes_outside_trace(
      any(d is not None for d in defined) or any(
          (f := _innermost_frame(n)) is not None and not f.default for n in program.nodes))
  node_tg = tuple(by_label[labels[n.index]] for n in program.nodes)
  input_tg, input_explicit = [], []
  for i, path in enumerate(input_paths):
    uses = program.uses_of_input(i)
    # The task graphs whose own code (a scope, an annotated module, a default) uses the
    # parameter; code that joined a task graph by data flow only counts when nothing does.
    used = {node_tg[n.index] for n, _ in uses if explicit[n.index]} - {-1} or {
        node_tg[n.index] for n, _ in uses} - {-1}
    tg = _input_taskgraph(used, by_label.get(defined[i]) if defined else None, taskgraphs,
                          path, variables[i])
    input_tg.append(tg)
    input_explicit.append(any(explicit[n.index] for n, _ in uses)
                          or (bool(defined) and defined[i] is not None))
  return Capture(program, taskgraphs, node_tg, tuple(explicit), tuple(input_tg),
                 tuple(input_explicit), tuple(input_paths), tuple(module_rules))


def defining_frames(closed_jaxpr) -> list[Frame | None]:
  """Per output of a traced ``init_fn``: the ``with`` scope its value was computed in."""
  program = Program(closed_jaxpr)
  out = []
  for bases in program.outputs:
    frame = None
    for b in bases:
      node = program.producer.get(b)
      found = _innermost_frame(node) if node is not None else None
      if found is not None and not found.default:
        frame = found
        break
    out.append(frame)
  return out


def _top_default(program: Program, defaults: strategy_lib.Defaults):
  """The default set before tracing, unless it came from a call that also cuts this very
  program (model code that once ran eagerly, e.g. a Linen ``model.init`` outside jit)."""
  top = defaults.strategy
  if top is None:
    return None
  site = defaults.site
  for node in program.nodes:
    frame = _innermost_frame(node)
    if frame is not None and frame.default and frame.site == site:
      return None
  return top


def _innermost_frame(node: Node) -> Frame | None:
  for text in reversed(node.frames):
    frame = strategy_lib.parse_frame(text)
    if frame is not None:
      return frame
  return None


def _frame_spec(frame: Frame) -> _Spec:
  return _Spec(frame.kind, frame.device_count, frame.user_name, frame.text)


def _assign_labels(program: Program, top_default, module_rules: Sequence[ModuleRule],
                   specs: dict[str, _Spec]) -> tuple[list, list[bool], list[str]]:
  """Rules 1-4: the label of every node, whether rules 1-3 gave it, and the labels in the
  order their first tagged equation was traced."""
  labels: list[str | None] = [None] * len(program.nodes)
  current = None
  if top_default is not None:
    current = (f"name={top_default.name}" if top_default.name else _DEFAULT)
    _register(specs, current, _Spec(top_default.kind, top_default.device_count,
                                    top_default.name, f"epl.default.{top_default!r}"))
  for node in program.nodes:
    frame = _innermost_frame(node)
    if frame is not None and frame.default:
      current = frame.label
      _register(specs, frame.label, _frame_spec(frame))
      if node.primitive == "iota":  # the marker itself does no work
        labels[node.index] = _MARKER
        continue
    if frame is not None and not frame.default:
      _register(specs, frame.label, _frame_spec(frame))
      labels[node.index] = frame.label
      continue
    rule = module_rule_for(node.module_frames, module_rules)
    if rule is not None:
      s = rule.strategy
      # Rules with equal strategies (or one strategy object) form one task graph: a rule is
      # not a scope entered anew, and splitting attention and MLP with two epl.split(2) rules
      # means one split(2) over the same devices.
      lab = f"name={s.name}" if s.name else f"rule={s.kind}({s.device_count})"
      _register(specs, lab, _Spec(s.kind, s.device_count, s.name, f"{ANNOTATED}{rule.pattern}"))
      labels[node.index] = lab
      continue
    labels[node.index] = current
  if module_rules:
    modules = set()
    for node in program.nodes:
      names = [f for f in node.module_frames if not f.startswith("epl.")]
      modules.update("/".join(names[:end]) for end in range(1, len(names) + 1))
    warn_unmatched("module", [r.pattern for r in module_rules], modules)
  explicit = [lab is not None for lab in labels]
  order: dict[str, int] = {}
  for lab in labels:
    if lab not in (None, _MARKER):
      order.setdefault(lab, len(order))
  if order:
    _data_flow(program, labels, order)
  else:
    specs[_DEFAULT] = _Spec(strategy_lib.REPLICATE, 1, None, "")
    order[_DEFAULT] = 0
    labels = [_DEFAULT if lab is None else lab for lab in labels]
  return labels, explicit, list(order)


def _cut_into_stages(program: Program, labels: list, order: list[str],
                     specs: dict[str, _Spec], cuts: Sequence[int]):
  """``auto.auto_parallel``: one task graph, cut by node position into stages of its kind."""
  only = specs[order[0]]
  bounds = [0, *cuts, len(program.nodes)]
  new_order = []
  for i in range(len(bounds) - 1):
    lab = f"auto={i}"
    specs[lab] = _Spec(only.kind, only.device_count, f"stage_{i}", "epl.auto_parallel")
    new_order.append(lab)
    for n in range(bounds[i], bounds[i + 1]):
      if labels[n] != _MARKER:
        labels[n] = lab
  return labels, [True] * len(labels), new_order


def _data_flow(program: Program, labels: list, order: dict[str, int]) -> None:
  """Rule 4, in place: forwards from producers (latest), then backwards from consumers
  (earliest), then the first task graph."""
  def tagged(nodes):
    return [labels[n.index] for n in nodes if labels[n.index] not in (None, _MARKER)]

  for node in program.nodes:
    if labels[node.index] is None:
      found = tagged(program.node_producers(node))
      if found:
        labels[node.index] = max(found, key=order.__getitem__)
  first = min(order, key=order.__getitem__)
  for node in reversed(program.nodes):
    if labels[node.index] is None:
      found = tagged(program.node_consumers(node))
      labels[node.index] = min(found, key=order.__getitem__) if found else first


def _definition_labels(definitions: Sequence[Frame | None], n: int,
                       specs: dict[str, _Spec]) -> list[str | None]:
  """Labels of the split scopes variables were defined in (EPL's MoE pattern)."""
  out: list[str | None] = []
  for frame in list(definitions)[:n]:
    if frame is None or frame.kind != SPLIT:
      out.append(None)
      continue
    _register(specs, frame.label, _frame_spec(frame))
    out.append(frame.label)
  return out


def _taskgraphs(order: list[str], specs: dict[str, _Spec],
                num_devices: int) -> tuple[tuple[TaskGraph, ...], dict[str | None, int]]:
  taskgraphs, by_label = [], {_MARKER: -1}
  for index, lab in enumerate(order):
    s = specs[lab]
    count = s.device_count
    if count is None:
      count = 1 if s.kind == strategy_lib.REPLICATE else num_devices
    taskgraphs.append(TaskGraph(index, s.user_name or f"taskgraph_{index}", s.kind, count,
                                s.scope))
    by_label[lab] = index
  return tuple(taskgraphs), by_label


def _register(specs: dict[str, _Spec], label: str, spec: _Spec) -> None:
  """Records the strategy of a label; one name used for two strategies is an error."""
  other = specs.setdefault(label, spec)
  if (other.kind, other.device_count) != (spec.kind, spec.device_count):
    raise ScopeError(f"The name '{spec.user_name}' is used by two different strategies: "
                     f"{_show(other)} and {_show(spec)}. One name is one task graph; give the "
                     "other scope its own name.")


def _show(s: _Spec) -> str:
  return f"epl.{s.kind}({'' if s.device_count is None else s.device_count})"


def _input_taskgraph(used: set[int], defined: int | None, taskgraphs: tuple[TaskGraph, ...],
                     path: str, value) -> int | None:
  if defined is not None:
    # EPL's MoE pattern: defined under split, used in one other task graph.
    others = used - {defined}
    if len(others) <= 1:
      return defined
    used = used | {defined}
  kinds = {(taskgraphs[t].strategy, taskgraphs[t].device_count) for t in used}
  if len(used) > 1 and not any(taskgraphs[t].name.startswith("taskgraph_") for t in used) and (
      {k for k, _ in kinds} == {strategy_lib.REPLICATE}
      or (len(kinds) == 1 and next(iter(kinds))[0] == SPLIT)):
    # Named task graphs of one kind (replicate, or split over equally many devices) may share
    # a parameter: on the same devices it is one parameter; as pipeline stages (tied
    # embeddings) every stage using it holds it and the pipeline sums its gradients. It is
    # listed under the first, whose split rules give its spec (a later use that contracts it
    # on another dimension is refused by the split rules).
    # (An unnamed scope entered twice is an error below: most likely one scope meant as one
    # task graph.)
    return min(used)
  if len(used) > 1:
    names = " and ".join(f"'{taskgraphs[t].name}' ({taskgraphs[t].strategy}"
                         f"({taskgraphs[t].device_count}))" for t in sorted(used))
    raise PlanError(_SHARED_PARAM.format(path=path, shape=tuple(value.shape), names=names))
  return next(iter(used)) if used else None


_SHARED_PARAM = """\
Parameter '{path}' (shape {shape}) is used by two task graphs: {names}.
A parameter belongs to the one task graph whose operations use it, and different task graphs
may live on different devices, so epljax will not pick one. Either
  - use the parameter inside one scope only, or only inside named scopes of one kind
    (`epl.replicate`, or `epl.split` over equally many devices; pipeline stages: a weight tied
    across stages, like input and output embeddings, is held by each stage and its gradients
    summed); or
  - if an unnamed scope was entered twice (a loop, or the model called twice in the loss),
    give it a name, e.g. `with epl.replicate(1, name="encoder"):`, so every entry is one task
    graph."""
