"""A traced program flattened into one list of equations, with data flow across call boundaries.

JAX nests equations inside ``jit``, ``custom_jvp_call``, ``checkpoint``, ``scan``, ``cond`` and
``while``. Strategy tagging and split rules need to see through those boundaries: which
innermost equations use a parameter, which equation produced a value. ``Program`` walks the
nesting once, in trace order, and gives every innermost equation (a ``Node``) its full name
stack and its inputs resolved to *base values*: program inputs, constants and the outputs of
other nodes.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Any

from jax.extend import core as jcore

# A Flax method other than __call__ runs in the named scope "<module>.<method>".
_METHOD = re.compile(r"(?<=[A-Za-z0-9_])\.[A-Za-z_]\w*$")

Base = Any  # a jcore.Var that is a program input, a constant or the output of a Node


@dataclasses.dataclass(eq=False)
class Node:
  """One innermost equation of the program."""
  index: int
  eqn: jcore.JaxprEqn
  frames: tuple[str, ...]                  # name-stack entries, outermost first
  inputs: tuple[tuple[Base, ...], ...]     # per operand: the base values it may carry
  enclosing: tuple[str, ...]               # primitives this node sits inside, outermost first
  enclosing_ids: tuple[int, ...] = ()      # and which equations those are (ids)
  module_frames: tuple[str, ...] = ()      # the name-stack scopes alone: no transform entries
                                           # (``vmap``, ``jvp``), method suffixes dropped

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name

  def __repr__(self) -> str:
    return f"Node({self.index}, {self.primitive}, {'/'.join(self.frames)})"


class Program:
  """The nodes of ``closed_jaxpr`` in trace order, with producers and consumers."""

  def __init__(self, closed_jaxpr: jcore.ClosedJaxpr):
    self.closed_jaxpr = closed_jaxpr
    jaxpr = closed_jaxpr.jaxpr
    self.invars: tuple[jcore.Var, ...] = tuple(jaxpr.invars)
    self.nodes: list[Node] = []
    self._alias: dict[jcore.Var, tuple[Base, ...]] = {}
    self._walk(jaxpr, (), (), (), ())
    self.outputs = tuple(self._resolve(v) for v in jaxpr.outvars)
    self.producer: dict[Base, Node] = {}
    self.consumers: dict[Base, list[tuple[Node, int]]] = defaultdict(list)
    for node in self.nodes:
      for out in node.eqn.outvars:
        self.producer[out] = node
      for pos, bases in enumerate(node.inputs):
        for b in bases:
          self.consumers[b].append((node, pos))

  def uses_of_input(self, i: int) -> list[tuple[Node, int]]:
    """The nodes (and operand positions) that read program input ``i``."""
    return list(self.consumers.get(self.invars[i], ()))

  def node_consumers(self, node: Node) -> list[Node]:
    return [c for out in node.eqn.outvars for c, _ in self.consumers.get(out, ())]

  def node_producers(self, node: Node) -> list[Node]:
    return [self.producer[b] for bases in node.inputs for b in bases if b in self.producer]

  # -- walking -----------------------------------------------------------------------------

  def _resolve(self, v: Any) -> tuple[Base, ...]:
    if isinstance(v, jcore.Literal):
      return ()
    return self._alias.get(v, (v,))

  def _walk(self, jaxpr: jcore.Jaxpr, frames: tuple[str, ...], enclosing: tuple[str, ...],
            enclosing_ids: tuple[int, ...] = (), module_frames: tuple[str, ...] = ()):
    for eqn in jaxpr.eqns:
      stack = eqn.source_info.name_stack.stack
      eqn_frames = frames + tuple(getattr(s, "name", str(s)) for s in stack)
      eqn_modules = module_frames + tuple(
          s.name if s.name.startswith("epl.") else _METHOD.sub("", s.name)
          for s in stack if type(s).__name__ == "Scope")
      calls = _sub_calls(eqn)
      if calls is None:
        self.nodes.append(Node(len(self.nodes), eqn, eqn_frames,
                               tuple(self._resolve(v) for v in eqn.invars), enclosing,
                               enclosing_ids, eqn_modules))
        continue
      outer_outs: dict[jcore.Var, list[Base]] = defaultdict(list)
      for inner, in_map, out_map in calls:
        for inner_v, outer_v in in_map:
          self._alias[inner_v] = self._resolve(outer_v)
        self._walk(inner, eqn_frames, enclosing + (eqn.primitive.name,),
                   enclosing_ids + (id(eqn),), eqn_modules)
        for outer_o, inner_o in out_map:
          outer_outs[outer_o].extend(self._resolve(inner_o))
      for outer_o, bases in outer_outs.items():
        self._alias[outer_o] = tuple(dict.fromkeys(bases))


def _jaxpr(v: Any) -> jcore.Jaxpr | None:
  if isinstance(v, jcore.ClosedJaxpr):
    return v.jaxpr
  return v if isinstance(v, jcore.Jaxpr) else None


def _sub_calls(eqn: jcore.JaxprEqn):
  """[(inner jaxpr, [(inner invar, outer var)], [(outer outvar, inner outvar)])], or None
  when the equation is innermost (or a higher-order primitive we do not see into)."""
  params = eqn.params
  name = eqn.primitive.name
  outs = [o for o in eqn.outvars]
  if name == "while":
    cond, body = _jaxpr(params["cond_jaxpr"]), _jaxpr(params["body_jaxpr"])
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    ops = list(eqn.invars)
    carry = ops[nc + nb:]
    return [
        (cond, list(zip(cond.invars, ops[:nc] + carry)), []),
        (body, list(zip(body.invars, ops[nc:nc + nb] + carry)), list(zip(outs, body.outvars))),
    ]
  if name == "cond":
    branches = [_jaxpr(b) for b in params["branches"]]
    ops = list(eqn.invars[1:])
    return [(b, list(zip(b.invars, ops)), list(zip(outs, b.outvars))) for b in branches]
  inner = [j for j in (_jaxpr(v) for v in params.values()) if j is not None]
  if len(inner) != 1:
    return None
  (j,) = inner
  if len(j.invars) != len(eqn.invars) or len(j.outvars) != len(outs):
    return None
  return [(j, list(zip(j.invars, eqn.invars)), list(zip(outs, j.outvars)))]
