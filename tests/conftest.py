"""Tests run on 8 simulated CPU devices; the flag must be set before JAX is imported."""

import os
import shutil
import tempfile

# --xla_backend_optimization_level=1: LLVM optimizes the CPU code less (XLA's default is 2).
# XLA's HLO passes still run, so the optimized HLO, memory_analysis() and cost_analysis() that
# the cost and memory tests read are the same to the byte (checked on the zoo's Gemma step, jax
# 0.10 and 0.11: same HLO text hash, temp, bytes accessed and FLOPs), and so are the numbers
# (the AMP cells' distances to their bfloat16 tolerance are level 2's). Compiling is what the
# suite spends its time on: the Gemma and ViT zoo cells took 128.4 s at level 2, 112.4 s at
# level 1 (2026-11-25, 2-core VM, jax 0.10.2). Level 0 took 94 s but rounds differently (no
# fused multiply-adds): a ViT AMP cell at 0.98 of its tolerance went to 1.06. Tests only: a
# user's programs are compiled with XLA's defaults.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=1").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

try:
  import jax  # noqa: E402

  import epljax as epl  # noqa: E402
except ImportError as missing:   # pytest run from an interpreter without the project installed
  pytest.exit(f"{missing}. The tests need epljax and its dependencies installed in this "
              "interpreter: python3 -m pip install -e \".[test]\" (the README's test command "
              "does both).", returncode=4)


# Run first: the largest file (a third of the suite), so that with pytest-xdist's file-by-file
# scheduling the other worker takes the rest meanwhile instead of waiting for it at the end.
FIRST = "test_zoo.py"


def pytest_collection_modifyitems(config, items):
  items.sort(key=lambda item: item.path.name != FIRST)   # stable: the rest keep their order
  if jax.device_count() < 8:
    skip = pytest.mark.skip(reason="needs 8 devices (XLA_FLAGS was set before conftest ran)")
    for item in items:
      item.add_marker(skip)


# CI's Python 3.12 run installs jax's CUDA plugin (".[test,cuda12]") and sets this: there, a
# test that skips for want of the plugin (the compile-only GPU tests, tests/test_aot.py's
# needs_plugin) fails instead, so a plugin that did not install cannot pass unnoticed.
REQUIRE_CUDA_PLUGIN = os.environ.get("EPLJAX_REQUIRE_CUDA_PLUGIN") == "1"
PLUGIN_SKIP = "compile-only GPUs need jax's CUDA plugin"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if REQUIRE_CUDA_PLUGIN and report.skipped and PLUGIN_SKIP in str(report.longrepr):
    report.outcome = "failed"
    report.longrepr = (f"EPLJAX_REQUIRE_CUDA_PLUGIN=1, but {item.nodeid} skipped: "
                       f"{report.longrepr[-1] if isinstance(report.longrepr, tuple) else ''}. "
                       "Install the plugin (pip install -e \".[test,cuda12]\") or unset the "
                       "variable.")


@pytest.fixture(autouse=True)
def fresh_epl():
  """Every test starts from epl.init() with the defaults and no scopes or default strategy."""
  for var in [v for v in os.environ if v.startswith("EPL_")]:
    del os.environ[var]
  epl.init()
  yield
  epl.init()


def pytest_configure(config):
  # Many tests compile the same small programs (references, shared models): a compilation
  # cache of this session alone saves the repeats. Not shared: entries written by another
  # process (a run beside this one, an earlier run) have aborted a pipeline test in-process.
  cache = tempfile.mkdtemp(prefix="jax_compilation_cache-")
  config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
