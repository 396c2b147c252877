"""The package: ``python -m build`` makes a wheel and an sdist that ``twine check --strict``
accepts, and the wheel, installed into a fresh virtual environment, runs the quick start.

The build runs without isolation (setuptools from the test extra: no download) on a copy of
the checkout, so the checkout gets no ``build/`` or ``*.egg-info``. The fresh environment takes
its dependencies from the running one (``site.addsitedir`` in a ``.pth``: no download either)
and epljax only from the wheel, which the quick start proves by printing its path.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

import epljax as epl

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
LEFT_OUT = shutil.ignore_patterns(".git", ".ci-venv*", ".venv*", "__pycache__", "*.egg-info",
                                  "build", "dist", "site", ".pytest_cache")


def run(*args, **kwargs) -> str:
  done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=300,
                        **kwargs)
  assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
  return done.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
  """``python -m build`` of a copy of this checkout: the sdist, then the wheel built from it."""
  tmp = tmp_path_factory.mktemp("package")
  shutil.copytree(ROOT, tmp / "src", ignore=LEFT_OUT)
  run(sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "dist", tmp / "src")
  return tmp / "dist"


def test_the_version_is_the_package_metadata():
  assert epl.__version__ == VERSION, (epl.__version__, VERSION)


def test_build_makes_a_wheel_and_an_sdist_that_twine_accepts(dist):
  wheel, sdist = (dist / f"epljax-{VERSION}-py3-none-any.whl",
                  dist / f"epljax-{VERSION}.tar.gz")
  assert sorted(dist.iterdir()) == sorted([wheel, sdist]), list(dist.iterdir())
  run(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist)
  packed = zipfile.ZipFile(wheel).namelist()
  assert "epljax/__init__.py" in packed and "epljax/pipeline/runtime.py" in packed
  assert not [n for n in packed if n.startswith(("tests/", "bench/", "examples/"))]
  metadata = zipfile.ZipFile(wheel).read(f"epljax-{VERSION}.dist-info/METADATA").decode()
  assert re.search(r"^Requires-Dist: jax<0\.13,>=0\.10$", metadata, re.M), metadata[:2000]
  assert "Description-Content-Type: text/markdown" in metadata
  names = tarfile.open(sdist).getnames()
  assert f"epljax-{VERSION}/pyproject.toml" in names and f"epljax-{VERSION}/README.md" in names


def test_the_wheel_installed_alone_runs_the_quick_start(dist, tmp_path):
  env_dir = tmp_path / "venv"
  venv.create(env_dir, with_pip=False)
  python = env_dir / "bin" / "python"
  site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
  running = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
  Path(site, "_running_env.pth").write_text(
      "".join(f"import site; site.addsitedir({p!r})\n" for p in sorted(running)))
  run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
      "--no-index", dist / f"epljax-{VERSION}-py3-none-any.whl")
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                       "--xla_backend_optimization_level=1")
  quickstart = ROOT / "examples" / "quickstart.py"
  out = run(python, "-c",
            "import runpy, sys, epljax; print('epljax', epljax.__version__, epljax.__file__); "
            f"sys.argv = [{str(quickstart)!r}, '--steps', '3']; "
            f"runpy.run_path({str(quickstart)!r}, run_name='__main__')",
            env=env, cwd=tmp_path)
  first = out.splitlines()[0].split()
  assert first[:2] == ["epljax", VERSION], out
  assert Path(first[2]).is_relative_to(env_dir), f"epljax imported from {first[2]}, not the wheel"
  losses = [float(x) for x in re.findall(r"Iteration \d+ , Loss: (\S+) \.", out)]
  assert len(losses) == 3 and losses[-1] < losses[0], out
  assert "Train Finished." in out
