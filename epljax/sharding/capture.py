"""Capture: trace the loss, tag every equation with its task graph, and every input with the
task graph of the equations that consume it.

Rules, in order:
1. An equation inside a ``with epl.replicate/split`` scope belongs to that scope's task graph.
2. Outside scopes, it belongs to the default strategy in force when it was traced: the one set
   by ``set_default_strategy`` before tracing, or by the last call made during the trace.
3. Anything left (no default in force) joins a task graph by data flow: the latest task graph
   among the producers of its inputs; failing that, the earliest among its consumers. So code
   before the first scope (an embedding lookup) joins the first task graph and code after the
   last (the loss) joins the last.
4. A model with no annotation at all is one ``replicate(1)`` task graph: data parallelism.

A parameter belongs to the task graph of the equations that use it. A parameter used by two
task graphs is an error: EPL places task graphs on different devices, so the choice matters
and epljax will not guess.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from epljax import strategy as strategy_lib
from epljax.errors import PlanError, ScopeError
from epljax.sharding.program import Node, Program
from epljax.strategy import Frame, TaskGraph

_DEFAULT_LABEL = "default"


@dataclasses.dataclass(frozen=True)
class Capture:
  """The traced loss and what the annotations made of it."""
  program: Program
  taskgraphs: tuple[TaskGraph, ...]
  node_taskgraph: tuple[int, ...]                 # per program node
  input_taskgraph: tuple[int | None, ...]         # per variable leaf; None when unused
  input_paths: tuple[str, ...]                    # per variable leaf

  def nodes_of(self, taskgraph: int) -> list[Node]:
    return [n for n in self.program.nodes if self.node_taskgraph[n.index] == taskgraph]


def capture(fn: Callable[..., Any], variables: Sequence[Any], extra: Sequence[Any], *,
            input_paths: Sequence[str], num_devices: int) -> Capture:
  """Traces ``fn(*variables, *extra)`` on abstract values and assigns task graphs.

  ``variables`` are flat leaves (parameters and model state) named by ``input_paths``;
  ``extra`` (the batch) is traced too but never checked for being shared.
  """
  with strategy_lib.trace_session():
    closed = jax.make_jaxpr(fn)(*variables, *extra)
  program = Program(closed)
  top_default = _top_default(program)
  labels, order = _assign_labels(program, top_default)
  taskgraphs, by_label = _taskgraphs(program, labels, order, top_default, num_devices)
  node_tg = tuple(by_label[labels[n.index]] for n in program.nodes)
  input_tg = tuple(_input_taskgraph(program, node_tg, taskgraphs, i, path, variables[i])
                   for i, path in enumerate(input_paths))
  return Capture(program, taskgraphs, node_tg, input_tg, tuple(input_paths))


def _top_default(program: Program):
  """The default set before tracing, unless it came from a call that also cuts this very
  program (model code that once ran eagerly, e.g. a Linen ``model.init`` outside jit)."""
  top = strategy_lib.default_strategy()
  if top is None:
    return None
  site = strategy_lib.default_strategy_site()
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


def _assign_labels(program: Program, top_default) -> tuple[list[str | None], list[str]]:
  """Rules 1-3: the scope label of every node (None only where rule 4 applies), and the labels
  in the order their first annotated equation was traced."""
  labels: list[str | None] = [None] * len(program.nodes)
  current = _DEFAULT_LABEL if top_default is not None else None
  for node in program.nodes:
    frame = _innermost_frame(node)
    if frame is not None and frame.default:
      current = frame.label
      if node.primitive == "iota":  # the marker itself does no work
        labels[node.index] = "marker"
        continue
    labels[node.index] = frame.label if frame is not None and not frame.default else current
  # Rule 3, forwards: the latest task graph among producers. Scope order is first appearance.
  order = {}
  for lab in labels:
    if lab not in (None, "marker"):
      order.setdefault(lab, len(order))
  if not order:
    return labels, []
  for node in program.nodes:
    if labels[node.index] is None:
      found = [labels[p.index] for p in program.node_producers(node)
               if labels[p.index] not in (None, "marker")]
      if found:
        labels[node.index] = max(found, key=order.__getitem__)
  for node in reversed(program.nodes):
    if labels[node.index] is None:
      found = [labels[c.index] for c in program.node_consumers(node)
               if labels[c.index] not in (None, "marker")]
      labels[node.index] = (min(found, key=order.__getitem__) if found
                            else min(order, key=order.__getitem__))
  return labels, list(order)


def _taskgraphs(program: Program, labels: list[str | None], order: list[str], top_default,
                num_devices: int) -> tuple[tuple[TaskGraph, ...], dict[str | None, int]]:
  """Rule 4 and numbering: task graphs in the order their first annotated equation was traced
  (not counting equations that joined them by data flow)."""
  frames: dict[str, Frame] = {}
  every: dict[str, Frame] = {}
  for node in program.nodes:
    frame = _innermost_frame(node)
    if frame is not None:
      frames.setdefault(frame.label, frame)
      every.setdefault(frame.text.removeprefix("epl.default.").removeprefix("epl."), frame)
  specs: dict[str | None, tuple[str, int | None, str | None, str]] = {}
  for lab in order or [None]:
    if lab is None:  # no annotation anywhere
      specs[None] = (strategy_lib.REPLICATE, 1, None, "")
    elif lab == _DEFAULT_LABEL:
      specs[lab] = (top_default.kind, top_default.device_count, top_default.name,
                    f"epl.default.{top_default!r}")
    else:
      f = frames[lab]
      specs[lab] = (f.kind, f.device_count, f.user_name, f.text)
  _check_consistent_names(every.values(), top_default)
  taskgraphs, by_label = [], {"marker": -1}
  for index, (lab, (kind, count, user_name, scope)) in enumerate(specs.items()):
    if count is None:
      count = 1 if kind == strategy_lib.REPLICATE else num_devices
    taskgraphs.append(TaskGraph(index, user_name or f"taskgraph_{index}", kind, count, scope))
    by_label[lab] = index
  return tuple(taskgraphs), by_label


def _check_consistent_names(frames, top_default) -> None:
  seen: dict[str, Frame] = {}
  for f in frames:
    if f.user_name is None:
      continue
    other = seen.get(f.user_name)
    if other is not None and (other.kind, other.device_count) != (f.kind, f.device_count):
      raise ScopeError(f"The name '{f.user_name}' is used by two different strategies: "
                       f"{_show(other)} and {_show(f)}. One name is one task graph; give the "
                       "other scope its own name.")
    seen[f.user_name] = f
  if top_default is not None and top_default.name in seen:
    f = seen[top_default.name]
    if (f.kind, f.device_count) != (top_default.kind, top_default.device_count):
      raise ScopeError(f"The name '{top_default.name}' is used by the default strategy "
                       f"{top_default!r} and by {_show(f)}; use different names.")


def _show(f: Frame) -> str:
  count = "" if f.device_count is None else str(f.device_count)
  return f"epl.{f.kind}({count})"


def _input_taskgraph(program: Program, node_tg: tuple[int, ...],
                     taskgraphs: tuple[TaskGraph, ...], i: int, path: str, value) -> int | None:
  used = sorted({node_tg[node.index] for node, _ in program.uses_of_input(i)} - {-1})
  if len(used) > 1:
    names = " and ".join(f"'{taskgraphs[t].name}' ({taskgraphs[t].strategy}"
                         f"({taskgraphs[t].device_count}))" for t in used)
    raise PlanError(_SHARED_PARAM.format(path=path, shape=tuple(value.shape), names=names))
  return used[0] if used else None


_SHARED_PARAM = """\
Parameter '{path}' (shape {shape}) is used by two task graphs: {names}.
A parameter belongs to the one task graph whose operations use it, and different task graphs
may live on different devices, so epljax will not pick one. Either
  - use the parameter inside one scope only. Pipeline stages each hold and train their own
    parameters, so a weight tied across stages (input and output embeddings) must become two
    parameters, one per stage; or
  - if an unnamed scope was entered twice (a loop, or the model called twice in the loss),
    give it a name, e.g. `with epl.replicate(1, name="encoder"):`, so every entry is one task
    graph."""
