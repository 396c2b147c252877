import jax
import jax.numpy as jnp
import pytest

import epljax as epl
from epljax.strategy import parse_frame


def test_nesting_raises_at_entry_and_says_what_to_do():
  with epl.replicate(1, name="outer"):
    with pytest.raises(epl.ScopeError, match=r"epl.split\(8\) was entered inside "
                       r"epl.replicate\(1, name='outer'\): strategy scopes cannot be nested"):
      with epl.split(8):
        pass
    with pytest.raises(ValueError, match="Close the outer scope first"):
      with epl.replicate(2):
        pass


def test_set_default_strategy_inside_a_scope_is_nesting():
  with epl.split(2):
    with pytest.raises(epl.ScopeError, match="cannot be nested. Call it outside"):
      epl.set_default_strategy(epl.replicate(1))


def test_scope_state_is_restored_after_an_exception():
  with pytest.raises(ZeroDivisionError):
    with epl.replicate(1):
      _ = 1 / 0
  with epl.split(2):   # not refused as nested
    pass
  assert jax.extend.source_info_util.current_name_stack().stack == ()


@pytest.mark.parametrize("make, message", [
    (lambda: epl.replicate(0), r"epl.replicate\(device_count=0\): device_count must be a "
                               "positive integer"),
    (lambda: epl.split(2.5), r"epl.split\(device_count=2.5\)"),
    (lambda: epl.split(True), r"device_count=True"),
    (lambda: epl.replicate(1, name="a/b"), r"name='a/b'\): a name is letters, digits"),
    (lambda: epl.set_default_strategy("replicate"), "expects epl.replicate"),
])
def test_bad_arguments(make, message):
  with pytest.raises(epl.ScopeError, match=message):
    make()


def test_scope_tags_forward_and_backward_equations():
  def f(w, x):
    with epl.split(4, name="head"):
      return jnp.sum(jnp.tanh(x @ w))

  jaxpr = jax.make_jaxpr(jax.grad(f))(jnp.ones((3, 4)), jnp.ones((2, 3)))
  frames = {parse_frame(str(s.name)) for e in jaxpr.eqns for s in e.source_info.name_stack.stack}
  frames.discard(None)
  assert {(f.kind, f.device_count, f.user_name) for f in frames} == {("split", 4, "head")}
  transposed = [e for e in jaxpr.eqns if "transpose" in str(e.source_info.name_stack)]
  assert transposed and all("epl.split(4)[name=head]" in str(e.source_info.name_stack)
                            for e in transposed)


def test_top_level_default_strategy_is_remembered():
  s = epl.replicate(2, name="dp")
  epl.set_default_strategy(s)
  assert epl.strategy.default_strategy() is s
  assert repr(s) == "epl.replicate(2, name='dp')"
