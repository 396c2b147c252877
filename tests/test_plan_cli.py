"""``python -m epljax.plan`` and the plan's verdict on this machine's CPU devices (no plugin:
``--topology cpu:8``): the verdict first, a stack of layers as one row, the changes a plan that
does not fit names (one compiled: it fits), and the exit codes 0 to 4. The same command on
compile-only GPUs is tested in test_aot.py where jax's CUDA plugin is installed."""

import contextlib
import io
import math
import os
import re
import runpy

import flax.linen as nn
import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

import epljax as epl
from epljax.plan import Leaf, cli, rows
from helpers import classification_batch, cross_entropy

SCRIPT = os.path.join(os.path.dirname(__file__), "plan_scripts", "scanned_mlp.py")


def _plan_cli(*args):
  """(exit code, stdout, stderr) of ``python -m epljax.plan SCRIPT --topology cpu:8 ARGS``,
  run in this process."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      code = cli.main([SCRIPT, "--topology", "cpu:8", *args])
    except SystemExit as e:   # (argparse)
      code = e.code
  return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def fits():
  return _plan_cli()


def test_the_verdict_comes_first(fits):
  code, out, _ = fits
  assert code == 0, out + fits[2]
  lines = out.splitlines()
  assert re.fullmatch(r"epljax plan: fits, [\d.]+ KiB per device of 16\.0 GiB", lines[0])
  verdict = lines[1:lines.index("")]
  assert len(verdict) <= 15, verdict
  labels = [line.split()[0] for line in verdict]
  assert labels[:3] == ["mesh", "replicas", "batch"] and "step" in labels, verdict
  assert "mesh      data=8 x stage=1 x model=1 over 8 cpu devices" in verdict[0]
  step = next(line for line in verdict if line.split()[0] == "step")
  assert re.search(r"predicted on cpu .*: compute .* ms, communication .* ms not hidden; "
                   r"MFU [\d.]+%", step), step
  assert "  hosts     1: no collective crosses hosts" in verdict
  assert lines[len(verdict) + 2] == "task graphs"   # then the details
  assert out.rstrip().endswith("fits (" + out.rstrip().split("fits (")[-1])
  assert "8 x cpu in 1 host: fits" in out


def test_a_stack_of_scanned_layers_is_one_row(fits):
  _, out, _ = fits
  assert re.search(r"params/ScanLayer_0/Dense_0/\*\s+4 layers x 2 leaves\s+float32\s+P\(\)\s+"
                   r"65\.0 KiB", out), out
  assert "params/ScanLayer_0/Dense_0/kernel" not in out and "params/Dense_0/kernel" in out
  code, full, _ = _plan_cli("--full")
  assert code == 0
  assert re.search(r"params/ScanLayer_0/Dense_0/kernel\s+\(4, 64, 64\)\s+float32\s+P\(\)\s+"
                   r"64\.0 KiB", full), full


def _leaf(path, shape, spec=P(), rule=""):
  return Leaf(path, shape, "float32", spec, 4 * math.prod(shape),
              "taskgraph_0", True, rule)


def test_numbered_blocks_alike_are_one_row_and_others_keep_theirs():
  leaves = [_leaf(f"params/h_{i}/{name}", shape, P(None, "model") if name == "fc" else P())
            for i in range(3) for name, shape in (("fc", (8, 16)), ("ln", (8,)))]
  leaves += [_leaf("params/head_0/kernel", (8, 4)), _leaf("params/head_1/kernel", (8, 5))]
  table = rows.variable_rows(leaves, {})
  assert table[0][:5] == ["params/h_{0..2}/*", "3 blocks x 2 leaves", "float32",
                          "(per leaf)", "1.6 KiB"]
  assert [r[0] for r in table[1:]] == ["params/head_0/kernel", "params/head_1/kernel"]
  assert len(rows.variable_rows(leaves, {}, full=True)) == len(leaves)


@pytest.fixture(scope="module")
def over_the_limit(fits):
  """The script's plan under 90% of the bytes it needs (``--memory-limit``)."""
  needed = float(re.match(r"epljax plan: fits, ([\d.]+) KiB", fits[1]).group(1)) * 1024
  return int(0.9 * needed)


def test_a_plan_that_does_not_fit_exits_1_and_names_the_changes_that_would(over_the_limit):
  code, out, _ = _plan_cli("--memory-limit", str(over_the_limit / (1 << 30)))
  assert code == 1, out
  lines = out.splitlines()
  assert lines[0].startswith("epljax plan: DOES NOT FIT, ")
  changes = [line for line in lines[:lines.index("")] if line.startswith("  change    ")]
  assert 1 <= len(changes) <= 3, out
  for line in changes:
    got = re.search(r"([\d.]+) KiB per device \(estimated\), step [\d.e+-]+ ms predicted$", line)
    assert got and float(got.group(1)) * 1024 <= over_the_limit, line
  assert "zero.level=v1: " in out   # Adam's moments sharded over the 8 replicas


def test_the_cheapest_change_compiled_fits(over_the_limit):
  """From Python: ``plan.suggestions(compile=True)`` builds and compiles the change; its
  compiled bytes are within the limit. The HTML keeps the text's order (verdict first)."""
  script = runpy.run_path(SCRIPT)
  model = script["ScannedMLP"]()
  epl.init({"auto.memory_limit": over_the_limit})
  trainer = epl.Trainer(lambda rng, b: model.init(rng, b["x"]),
                        lambda v, b: cross_entropy(model.apply(v, b["x"]), b["y"]),
                        optax.adamw(1e-3))
  with nn.logical_axis_rules(script["RULES"]):   # (ended before the changes are built)
    plan = trainer.compile(classification_batch(8 * jax.device_count()))
  assert not plan.fits
  (change,) = plan.suggestions(compile=True, count=1).changes
  assert change.compiled_bytes <= over_the_limit < plan.bytes_per_device, change
  assert f"change    {change.line(over_the_limit)}" in str(plan)   # the compiled answer
  html = plan._repr_html_()
  assert html.index("<h4>epljax plan: DOES NOT FIT") < html.index("<h4>task graphs</h4>")
  assert "compiled (estimated" in html


@pytest.mark.parametrize("fail, code", [("end", 2), ("exit", 2), ("raise", 3), ("init", 3)])
def test_a_script_that_never_plans_exits_2_one_that_raises_3(fail, code):
  got, out, err = _plan_cli("--", "--fail", fail)
  assert got == code and out == "", (out, err)
  if fail == "raise":   # the script's traceback, from its own frames
    assert re.search(r"scanned_mlp\.py\", line \d+, in main\n.*\nValueError: no data", err), err
    assert "runpy" not in err and "raised ValueError before its plan was made" in err
  elif fail == "init":  # an EPLError from trainer.init itself: the script raised, not the tool
    assert "init_fn returned None" in err and "raised PlanError before its plan" in err, err
  else:
    assert "nothing to plan" in err and ("sys.exit(5)" in err) == (fail == "exit")


def test_failures_of_the_tool_exit_4_and_help_lists_the_codes(capsys):
  for topology in ("cpu:2x4", "cpu:many", "k80:8"):
    code, _, err = _plan_cli("--topology", topology)
    assert code == 4 and ("--topology" in err or "unknown kind" in err), (topology, err)
  assert _plan_cli("--no-such-flag")[0] != 4   # (unknown flags go to the script ...)
  with pytest.raises(SystemExit) as done:     # (... a missing argument is the tool's)
    cli.main([SCRIPT])
  assert done.value.code == 4
  with pytest.raises(SystemExit) as done:
    cli.main(["--help"])
  assert done.value.code == 0
  text = capsys.readouterr().out
  for line in ("0  the plan fits", "1  it does not fit", "2  the script ended",
               "3  the script raised", "4  epljax.plan itself failed"):
    assert line in text, text
