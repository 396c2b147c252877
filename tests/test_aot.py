"""Planning ahead of time: ``epl.init(devices=...)``, ``trainer.compile``, the plan's bytes,
fit, collectives per axis with host crossings, ``python -m epljax.plan``, and the facts many
hosts must agree on. Compile-only GPUs (``epl.topology``) need jax's CUDA plugin: those tests
are skipped without it (``pip install -e ".[cuda12]"``); the host logic is tested on device
grids that stand for 1x2x8 and 1x8x8 clusters."""

import os
import re
import subprocess
import sys
import types

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import epljax as epl
from epljax import estimate, hlo
from epljax.mesh import hosts
from helpers import MLP, classification_batch, linen_fns

HERE = os.path.dirname(__file__)


def _grid(shape, per_host, order=None):
  """A mesh stand-in: devices numbered row-major over ``shape`` (after ``order``, the axes'
  order in the device numbering), ``per_host`` consecutive ids per host."""
  n = int(np.prod(shape))
  devices = np.array([types.SimpleNamespace(id=i, process_index=i // per_host)
                      for i in range(n)], dtype=object)
  names = ("data", "stage", "model")
  if order is None:
    grid = devices.reshape(shape)
  else:   # numbered over the axes in `order`, laid out as (data, stage, model)
    grid = devices.reshape([shape[names.index(a)] for a in order]).transpose(
        [order.index(a) for a in names])
  return types.SimpleNamespace(devices=grid, axis_names=names,
                               shape=dict(zip(names, grid.shape)), size=n)


@pytest.mark.parametrize("shape, per_host, crossing", [
    ((8, 1, 8), 32, {"data": True, "stage": False, "model": False}),    # 64 GPUs, 2 hosts
    ((4, 4, 4), 32, {"data": True, "stage": False, "model": False}),
    ((2, 1, 8), 8, {"data": True, "stage": False, "model": False}),     # 1x2x8
    ((8, 1, 8), 8, {"data": True, "stage": False, "model": False}),     # 1x8x8
    ((1, 8, 8), 8, {"data": False, "stage": True, "model": False}),     # stages across hosts
    ((8, 8, 1), 8, {"data": True, "stage": False, "model": False}),     # stages in a host
])
def test_which_axes_cross_hosts_is_read_from_the_devices_of_each_axis(shape, per_host,
                                                                      crossing):
  """Every axis, leading or not (the estimate read the wrong devices for non-leading axes:
  64 GPUs in 2 hosts as 8x1x8 priced 'model' at the network's bandwidth)."""
  mesh = _grid(shape, per_host)
  assert {a: hosts.crosses_hosts(mesh, a) for a in mesh.axis_names} == crossing
  assert hosts.crosses_hosts(mesh, ("data", "model")) == crossing["data"]


def test_an_axis_laid_across_hosts_in_any_order_is_found():
  """Devices numbered model-first (each host holds a slice of data x stage for every model
  index): 'model' crosses hosts although it is the mesh's last axis."""
  mesh = _grid((2, 1, 8), per_host=2, order=("model", "stage", "data"))
  assert hosts.crosses_hosts(mesh, "model") and not hosts.crosses_hosts(mesh, "data")


def test_the_estimate_and_the_compiled_cost_agree_on_the_axes_and_the_hosts():
  """One answer: the groups of a compiled collective over 'model' (and over 'data') in a
  2-host 8x1x8 mesh are read by ``cost.collective_axis`` as the estimate prices those axes."""
  from epljax import cost
  mesh = _grid((8, 1, 8), per_host=32)
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  for axis in ("model", "data"):
    groups = hosts.axis_groups(ids, mesh.axis_names, [axis]).tolist()
    text = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"
    c = hlo.Collective("all-reduce", ("f32[8]",), 32, text)
    assert cost.collective_axis(c, mesh) == (axis, 8, hosts.crosses_hosts(mesh, axis))
  assert estimate.hosts is hosts   # (the estimate prices axes with this module)


@pytest.fixture(scope="module")
def compiled_for_four():
  """The MLP planned for 4 of the 8 CPU devices and compiled from shapes alone."""
  epl.init({"zero.level": "v1"}, devices=jax.devices()[:4])
  init_fn, loss_fn = linen_fns(MLP())
  trainer = epl.Trainer(init_fn, loss_fn, optax.adamw(1e-3))
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                       classification_batch(16))
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *_, **__: compiles.append(name) if name.endswith("backend_compile_duration")
      else None)
  before = {id(x) for x in jax.live_arrays()}
  plan = trainer.compile(batch)
  made = [x for x in jax.live_arrays() if id(x) not in before]
  text, html = str(plan), plan._repr_html_()
  return trainer, plan, made, text, html, list(compiles)


def test_compile_plans_from_shapes_and_creates_no_state(compiled_for_four):
  trainer, plan, made, text, _, _ = compiled_for_four
  assert made == []                              # init_fn traced, never run
  assert dict(plan.mesh.shape)["data"] == 4 and plan.mesh.size == 4
  mem = plan.memory
  assert plan.bytes_per_device == (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                   - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
  assert plan.fits and plan.memory_limit > plan.bytes_per_device
  assert f"per device {epl.errors.size(plan.bytes_per_device)} of" in text and "(fits)" in text
  rows = plan.collectives
  assert {(c.kind, c.axes, c.crosses_hosts) for c in rows} >= {("reduce-scatter", "data", False)}
  assert "crosses hosts" in text and plan.predicted_step_s > 0


def test_printing_the_plan_compiles_the_step_once(compiled_for_four):
  """print(plan) and its HTML read the one compiled step: no loss-and-gradients program."""
  _, _, _, _, html, compiles = compiled_for_four
  assert len(compiles) == 1, compiles
  assert "epljax-plan" in html


def test_a_plan_over_its_limit_says_it_does_not_fit():
  epl.init({"auto.memory_limit": 4096}, devices=jax.devices()[:2])
  epl.set_default_strategy(epl.replicate(1))
  init_fn, loss_fn = linen_fns(MLP())
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  plan = trainer.compile(classification_batch(8))
  assert not plan.fits and "(DOES NOT FIT)" in str(plan)
  state = trainer.init(jax.random.key(0), classification_batch(8))   # real devices: it runs
  assert trainer.train_step(state, classification_batch(8))[1]["finite"]


def test_devices_must_be_jax_devices_of_one_kind():
  with pytest.raises(epl.ConfigError, match=r"devices=\.\.\.\) takes a non-empty list"):
    epl.init(devices=[])
  with pytest.raises(epl.ConfigError, match="names a device twice"):
    epl.init(devices=jax.devices()[:1] * 2)


def _has_cuda_plugin() -> bool:
  try:
    import jax_plugins.xla_cuda12  # noqa: F401
  except ImportError:
    return False
  return True


needs_plugin = pytest.mark.skipif(not _has_cuda_plugin(), reason=(
    "compile-only GPUs need jax's CUDA plugin: pip install -e '.[cuda12]'"))


@pytest.mark.skipif(_has_cuda_plugin(), reason="the CUDA plugin is installed")
def test_topology_without_the_plugin_names_the_extra_to_install():
  with pytest.raises(epl.EPLError, match=r'pip install -e "\.\[cuda12\]"'):
    epl.topology("h100", hosts=2, per_host=8)
  with pytest.raises(epl.ConfigError, match="unknown kind; use one of a100, h100"):
    epl.topology("k80")


def _run_plan_cli(*args):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("EPL_", "XLA_FLAGS"))}
  return subprocess.run([sys.executable, "-m", "epljax.plan", *args], cwd=os.path.dirname(HERE),
                        env=env, capture_output=True, text=True, timeout=600)


def test_the_plan_cli_refuses_without_the_plugin_or_names_the_topology_syntax():
  """A topology the tool cannot make is its own failure, exit 4 (1 is "does not fit", 2 "the
  script never reached trainer.init")."""
  done = _run_plan_cli(os.path.join(HERE, "launch_scripts", "train_dp.py"),
                       "--topology", "h100:eight")
  assert done.returncode == 4 and "KIND:HOSTSxGPUS_PER_HOST" in done.stderr, done.stderr
  if not _has_cuda_plugin():
    done = _run_plan_cli(os.path.join(HERE, "launch_scripts", "train_dp.py"),
                         "--topology", "h100:2x8")
    assert done.returncode == 4 and "cuda12" in done.stderr, done.stderr


@needs_plugin
def test_the_plan_cli_plans_an_unchanged_script_for_two_hosts(tmp_path):
  """train_dp.py, as the launcher runs it, planned for 2 hosts of 8 H100s: the plan prints,
  data crosses hosts, and the exit code says it fits; a 1 KiB limit makes it exit 1."""
  script = os.path.join(HERE, "launch_scripts", "train_dp.py")
  done = _run_plan_cli(script, "--topology", "h100:2x8", "--", str(tmp_path / "out.json"))
  assert done.returncode == 0, done.stdout + done.stderr
  assert "over 16 gpu devices" in done.stdout and "H100" in done.stdout
  assert "16 x NVIDIA H100 80GB HBM3 in 2 hosts: fits" in done.stdout
  lines = done.stdout.splitlines()   # the verdict first: fits, what crosses the hosts
  assert lines[0].startswith("epljax plan: fits, ") and "over 16 gpu devices in 2 hosts" in lines[1]
  assert any(line.startswith("  hosts     2, crossed each step by all-reduce over data")
             for line in lines[:lines.index("")]), done.stdout
  assert not (tmp_path / "out.json").exists()   # the script stopped at trainer.init
  row = [line for line in done.stdout.splitlines() if line.strip().startswith("all-reduce")]
  assert row and row[0].split()[1] == "data" and row[0].split()[-1] == "yes"
  small = _run_plan_cli(script, "--topology", "h100:2x8", "--memory-limit", "0.000001",
                        "--suggest", "--", str(tmp_path / "out.json"))
  assert small.returncode == 1 and "DOES NOT FIT" in small.stdout
  # The change the estimates name, compiled: 1 KiB is below any step's fixed temporaries.
  assert re.search(r"\n  change    .*: [\d.]+ KiB per device compiled \(estimated [\d.]+ "
                   r"(KiB|B), DOES NOT FIT\)", small.stdout), small.stdout


@needs_plugin
def test_tensor_parallel_on_a_two_host_topology_stays_inside_a_host():
  """epl.split(8) x data over 2 hosts of 8 H100s: the model axis' collectives stay in a host,
  the gradient reduction over data crosses; init refuses (nothing can run)."""
  devices = epl.topology("h100", hosts=2, per_host=8)
  assert [d.process_index for d in devices] == [0] * 8 + [1] * 8
  epl.init(devices=devices)
  epl.set_default_strategy(epl.split(8))
  init_fn, loss_fn = linen_fns(MLP(hidden=64))
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  plan = trainer.compile(classification_batch(16))
  axes = {(c.axes, c.crosses_hosts) for c in plan.collectives}
  assert ("model", False) in axes and ("data", True) in axes and ("model", True) not in axes
  with pytest.raises(epl.StateError, match="compile-only devices"):
    trainer.init(jax.random.key(0), classification_batch(16))


@pytest.mark.slow
def test_two_workers_whose_devices_differ_choose_one_plan():
  """auto.auto_parallel in 2 launcher workers whose devices report 3 and 5 GiB: both search
  under the smaller (agreed before searching) and choose the same plan."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("EPL_", "XLA_FLAGS"))}
  done = subprocess.run(
      [sys.executable, "-m", "epljax.launch", "--num_workers", "2", "--gpu_per_worker", "2",
       os.path.join(HERE, "launch_scripts", "plan_agree.py")],
      cwd=os.path.dirname(HERE), env=env, capture_output=True, text=True, timeout=400)
  assert done.returncode == 0, done.stdout + done.stderr
  plans = sorted(line.split("PLAN ", 1)[1].split(" ", 1) for line in done.stdout.splitlines()
                 if "PLAN " in line)
  assert [p[0] for p in plans] == ["0", "1"], done.stdout
  assert plans[0][1] == plans[1][1] and plans[0][1].startswith(str(3 << 30))


class _ThreeLayers(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = nn.relu(nn.Dense(256)(x))
    return nn.Dense(10)(x)


@needs_plugin
def test_zero3_under_mixed_precision_gathers_half_the_bytes_on_xla_gpu():
  """XLA:GPU keeps the bfloat16 all-gathers epljax asks for (XLA:CPU widens them): ZeRO v3
  with amp.level O1 gathers half the bytes of ZeRO v3 alone, every gather in bfloat16. And the
  compiled schedule hides part of the gathers behind compute (three layers: with two, the
  forward's gathers are one combined all-gather before any compute, and the last layer keeps
  its gathered kernel for its backward, memory/routes.py, so nothing is left to hide)."""
  devices = epl.topology("h100", hosts=1, per_host=8)
  found = {}
  for name, config in (("f32", {}), ("amp", {"amp.level": "O1"})):
    epl.init({"zero.level": "v3", **config}, devices=devices)
    init_fn, loss_fn = linen_fns(_ThreeLayers())
    plan = epl.Trainer(init_fn, loss_fn, optax.adamw(1e-3)).compile(classification_batch(64))
    gathers = [c for c in plan.collectives if c.kind == "all-gather"]
    found[name] = (sum(c.bytes for c in gathers),
                   {s.split("[")[0] for c in gathers for s in c.shapes})
    # XLA:GPU's latency-hiding scheduler runs gathers beside compute (async start/done pairs
    # around matmuls): the plan's step adds only what is exposed (``epljax.overlap``).
    step = plan.cost
    assert "all-gather-start" in plan.compiled.as_text()
    assert 0 < step.hidden_s <= step.communication_s
    assert step.step_s == pytest.approx(step.compute_s + step.communication_s - step.hidden_s)
    assert "of the communication runs beside compute" in str(plan)
  assert found["amp"][1] == {"bf16"} and found["f32"][1] == {"f32"}
  assert 2 * found["amp"][0] == found["f32"][0], found

