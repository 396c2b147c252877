"""Reruns the figures the README and the docs quote, on the machine at hand, and records them.

    python bench/run.py --list              # which records the pages quote, where, the command
                                            # that reruns each, what it needs, estimated cost
    python bench/run.py --only NAME         # rerun one (NAME from --list, or a unique part of it)
    python bench/run.py --headline          # rerun every one this machine can, then check

A quoted record is one that a page names in a ``record``, ``include`` or ``figures`` marker
(``docs/hooks/epljax_docs.py``); its heading says the command that wrote it and the devices it
compiled for. A rerun runs that command with ``--record`` in a fresh process (the bench
rewrites its section of ``bench/RESULTS.md`` through ``records.py``), then the README's record
blocks are rewritten from the new records and every figure the pages quote is checked against
them: a figure the code no longer gives is listed with its page and line, and the exit code is
1. Records on XLA:CPU run anywhere (8 simulated devices); those for compile-only H100s need
jax's CUDA plugin in this Python (``pip install -e ".[cuda12]"``; no GPU needed); those timed
on a real GPU need that GPU. What cannot run here is skipped, and said why.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import records  # noqa: E402

# Estimated minutes of one rerun on a 2-core CPU machine (measured where a date says so),
# by the first words of the bench's command: the longest prefix that matches.
MINUTES = {
    "comm.py": 1,                     # 2026-12-08: 1.0 min at load ~17 (7 others at work)
    "comm.py --zoo": 3,
    "overhead.py": 4,
    "overhead.py --sizes": 3,         # on the GPU
    "memory.py --zoo": 8,
    "shakespeare.py": 45,             # 2000 steps in each of 5 layouts, then 40 timed pairs
    "auto.py": 10,
    "auto.py --limit": 10,
    "auto.py --gpus": 15,
    "auto.py --models": 10,           # on the GPU
    "gpu_compile.py": 8,
    "calibrate.py": 40,               # its --cache of compiled programs makes a rerun minutes
    "auto_scale.py": 90,              # the same: bench/auto_scale.json
    "scale.py": 20,
    "long_context.py": 15,            # 2026-12-08: 2 cells 13-14 min at load ~13 (3 compiles each)
    "plan_cluster.py": 2,             # docs/planning.md: a 70B plan in 44 s
    "pipeline.py schedule": 12,
    "pipeline.py schedule --interleaved": 10,
    "pipeline.py schedule --interleaved-scan": 8,
    "pipeline.py schedule --memory": 2,
    "pipeline.py compile --depth": 8,
    "pipeline.py compile --split": 10,
    "pipeline.py compile --roll": 10,
    "pipeline.py compile --baseline": 12,
    "pipeline.py memory": 3,          # 2026-12-08: 12 min at load ~17 (7 others at work)
    "pipeline.py memory --gpu": 3,    # 2026-12-08: 24 min at load ~16 (7 others at work)
    "pipeline.py peak": 2,
    "pipeline.py roll": 4,
    "pipeline.py stash": 5,
}
KEY = re.compile(r"\((?P<command>bench/[\w/]+\.py(?: [^()]*)?)\) on (?P<devices>.+)$")
CUDA_ENV = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


@dataclasses.dataclass
class Bench:
  """One quoted record: its key, the pages that quote it, the command that rewrites it."""
  key: str
  pages: list[str]
  argv: list[str]         # the bench's command line, ``--record`` added
  devices: str

  @property
  def name(self) -> str:
    """``pipeline-memory-gpu``: the command's words; a timed GPU's name after them."""
    words = " ".join(self.argv[1:]).replace("--record", "").replace("bench/", "")
    words = words.replace(".py", "")
    if self.needs == "gpu":
      words += " " + self.devices.split()[-1 if "80GB" not in self.devices else -3]
    return re.sub(r"[^a-z0-9]+", "-", words.lower()).strip("-")

  @property
  def needs(self) -> str:
    if "compile-only" in self.devices:
      return "cuda-plugin"
    return "gpu" if self.devices.startswith("XLA:GPU") else "cpu"

  @property
  def minutes(self) -> float:
    words = " ".join(self.argv[1:]).replace("bench/", "")
    best = max((p for p in MINUTES if words == p or words.startswith(p + " ")), key=len,
               default=None)
    return MINUTES[best] if best else 10.0


def hooks():
  spec = importlib.util.spec_from_file_location(
      "epljax_docs_hooks", os.path.join(ROOT, "docs", "hooks", "epljax_docs.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def pages() -> list[str]:
  return sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [
      os.path.join(ROOT, "README.md")]


def command_of(key: str) -> tuple[list[str], str]:
  """The command line (``--record`` added, before a ``--``) and the devices of a key."""
  m = KEY.search(key)
  if not m:
    raise SystemExit(f"bench/run.py: the record '{key}' names no bench command "
                     "('... (bench/NAME.py ARGS) on DEVICES')")
  words = shlex.split(m.group("command"))
  cut = words.index("--") if "--" in words else len(words)
  return ["python", *words[:cut], "--record", *words[cut:]], m.group("devices")


def quoted() -> list[Bench]:
  """Every record a page quotes, in the order the pages quote them."""
  found: dict[str, Bench] = {}
  h = hooks()
  for path in pages():
    for key in h.quoted_keys(open(path).read()):
      if key not in found:
        argv, devices = command_of(key)
        found[key] = Bench(key, [], argv, devices)
      found[key].pages.append(os.path.relpath(path, ROOT))
  return list(found.values())


def cuda_plugin() -> bool:
  return any(importlib.util.find_spec(name) is not None
             for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def gpu_names() -> str:
  if shutil.which("nvidia-smi") is None:
    return ""
  done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
  return done.stdout if done.returncode == 0 else ""


def why_not(bench: Bench) -> str | None:
  """Why this machine cannot rerun ``bench`` (None: it can)."""
  if bench.needs == "cuda-plugin" and not cuda_plugin():
    return ("compiles for H100s: needs jax's CUDA plugin in this Python "
            "(pip install -e \".[cuda12]\"; no GPU needed)")
  if bench.needs == "gpu":
    gpu = bench.devices.split(" x ", 1)[1]
    if gpu.split()[-1] not in gpu_names() and gpu not in gpu_names():
      return f"timed on a real GPU: needs {gpu} (nvidia-smi lists none)"
  return None


def rerun(bench: Bench) -> tuple[bool, float, str]:
  """Runs the bench's command; (it rewrote its record today, minutes, what went wrong)."""
  # An XLA:CPU record stays one on a machine with a GPU; compile-only H100s start no GPU.
  env = dict(os.environ, **(CUDA_ENV if bench.needs != "gpu" else {}))
  start = time.perf_counter()
  done = subprocess.run([sys.executable, *bench.argv[1:]], cwd=ROOT, env=env)
  minutes = (time.perf_counter() - start) / 60
  if done.returncode != 0:
    return False, minutes, f"exit code {done.returncode}"
  try:
    text = records.current(bench.key)
  except KeyError:
    return False, minutes, "it recorded under another heading: the pages' key is stale"
  today = datetime.date.today().isoformat()
  if f"Recorded {today}" not in text:
    return False, minutes, "its section of bench/RESULTS.md is not today's"
  return True, minutes, ""


def check() -> list[str]:
  """Rewrites the record blocks from the records; every quoted figure no record holds."""
  h = hooks()
  h.sync_files()
  return [f"{os.path.relpath(p, ROOT)}: {e}" for p in pages()
          for e in h.figure_errors(open(p).read())]


def show(benches: list[Bench]) -> None:
  print(f"{'name':44} {'needs':12} {'est. min':>8}  here  quoted in")
  for b in benches:
    reason = why_not(b)
    print(f"{b.name:44} {b.needs:12} {b.minutes:8.0f}  {'no' if reason else 'yes':4}  "
          f"{', '.join(sorted(set(b.pages)))}")
    print(f"    {' '.join(b.argv)}")
    print(f"    -> ## {b.key}")
    if reason:
      print(f"    skipped here: {reason}")
  here = [b for b in benches if not why_not(b)]
  print(f"\n{len(benches)} quoted records; {len(here)} can rerun here, estimated "
        f"{sum(b.minutes for b in here):.0f} min (all: {sum(b.minutes for b in benches):.0f} "
        "min on a 2-core CPU machine)")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--list", action="store_true", help="the map and the estimated cost")
  group.add_argument("--only", metavar="NAME", help="rerun one quoted record")
  group.add_argument("--headline", action="store_true", help="rerun every quoted record")
  args = parser.parse_args(argv)
  benches = quoted()
  if args.list:
    show(benches)
    return 0
  if args.only:
    chosen = [b for b in benches if b.name == args.only] or [
        b for b in benches if args.only in b.name]
    if len(chosen) != 1:
      names = "\n  ".join(b.name for b in (chosen or benches))
      print(f"--only {args.only}: {'several' if chosen else 'none'} of\n  {names}")
      return 2
    benches = chosen
  failed, skipped = [], []
  for b in benches:
    reason = why_not(b)
    if reason:
      skipped.append(f"{b.name}: {reason}")
      continue
    print(f"\n== {b.name} (est. {b.minutes:.0f} min): {' '.join(b.argv)}", flush=True)
    ok, minutes, wrong = rerun(b)
    print(f"== {b.name}: {'recorded' if ok else 'FAILED: ' + wrong} in {minutes:.1f} min",
          flush=True)
    if not ok:
      failed.append(f"{b.name}: {wrong}")
  stale = check()
  for title, lines in (("skipped", skipped), ("failed", failed),
                       ("quoted figures the records no longer hold", stale)):
    if lines:
      print(f"\n{title}:\n  " + "\n  ".join(lines))
  return 1 if failed or stale else 0


if __name__ == "__main__":
  sys.exit(main())
