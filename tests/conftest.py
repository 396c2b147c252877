"""Tests run on 8 simulated CPU devices; the flag must be set before JAX is imported."""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

try:
  import jax  # noqa: E402

  import epljax as epl  # noqa: E402
except ImportError as missing:   # pytest run from an interpreter without the project installed
  pytest.exit(f"{missing}. The tests need epljax and its dependencies installed in this "
              "interpreter: python3 -m pip install -e \".[test]\" (the README's test command "
              "does both).", returncode=4)


def pytest_collection_modifyitems(config, items):
  if jax.device_count() < 8:
    skip = pytest.mark.skip(reason="needs 8 devices (XLA_FLAGS was set before conftest ran)")
    for item in items:
      item.add_marker(skip)


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
