"""IO slicing (config.io) and process-local batch slices."""

import jax
import numpy as np
import optax
import pytest

import epljax as epl
from epljax import io
from epljax.config import IOConfig
from helpers import MLP, classification_batch, linen_fns

FILES = [f"part-{i:02d}" for i in range(10)]


def shares(files, workers, **options):
  config = IOConfig(slicing=True, **options)
  return [io.slice_files(files, config=config, num_workers=workers, worker_index=w)
          for w in range(workers)]


def test_even_split_gives_every_worker_the_same_number_of_disjoint_files():
  got = shares(FILES, 5)
  assert got == [["part-00", "part-05"], ["part-01", "part-06"], ["part-02", "part-07"],
                 ["part-03", "part-08"], ["part-04", "part-09"]]


def test_unbalanced_slicing_gives_the_first_workers_one_file_more():
  got = shares(FILES, 4, unbalanced_io_slicing=True)
  assert [len(s) for s in got] == [3, 3, 2, 2]
  assert sorted(sum(got, [])) == FILES


def test_drop_last_files_drops_the_remainder_then_splits_evenly():
  got = shares(FILES, 4, drop_last_files=True)
  assert [len(s) for s in got] == [2, 2, 2, 2]
  assert sorted(sum(got, [])) == FILES[:8]


def test_uneven_files_without_an_option_are_refused_with_the_sizes():
  with pytest.raises(io.IOSlicingError, match=r"10 files do not divide evenly over 4 workers "
                     r"\(10 = 4 x 2 \+ 2\)\. Set io.unbalanced_io_slicing=True .* or "
                     r"io.drop_last_files=True to drop the last 2 file"):
    shares(FILES, 4)


def test_fewer_files_than_workers_and_conflicting_options_are_refused():
  with pytest.raises(io.IOSlicingError, match="3 files cannot be shared by 4 workers"):
    shares(FILES[:3], 4, unbalanced_io_slicing=True)
  with pytest.raises(io.IOSlicingError, match="both set, but they disagree"):
    shares(FILES, 4, unbalanced_io_slicing=True, drop_last_files=True)
  with pytest.raises(ValueError):     # IOSlicingError is a ValueError, like every config error
    shares(FILES[:1], 2)


def test_without_slicing_every_worker_reads_every_file():
  config = IOConfig()
  assert io.slice_files(FILES, config=config, num_workers=4, worker_index=3) == FILES


def test_defaults_come_from_the_environment_and_plain_readers_work():
  epl.init({"io.slicing": True})           # one process: worker 0 of 1 gets everything
  assert io.slice_files(FILES) == FILES
  records = list(io.iter_records(FILES[:4], lambda f: [f + "/a", f + "/b"], num_workers=2,
                                 worker_index=1))
  assert records == ["part-01/a", "part-01/b", "part-03/a", "part-03/b"]


def test_grain_dataset_of_this_workers_files():
  pytest.importorskip("grain")
  ds = io.grain_files(FILES, config=IOConfig(slicing=True), num_workers=5, worker_index=2)
  assert list(ds.map(str.upper)) == ["PART-02", "PART-07"]


def test_process_slice_is_this_process_block_of_rows(monkeypatch):
  batch = {"x": np.arange(12).reshape(12, 1), "y": np.arange(12)}
  assert io.process_slice(batch)["y"].tolist() == list(range(12))   # one process: all rows
  monkeypatch.setattr(jax, "process_count", lambda: 3)
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  assert io.process_slice(batch)["y"].tolist() == [4, 5, 6, 7]
  monkeypatch.setattr(jax, "process_count", lambda: 5)
  with pytest.raises(epl.PlanError, match="12 rows does not divide over 5 processes"):
    io.process_slice(batch)


def test_process_slice_with_a_plan_keeps_the_rows_of_this_process():
  epl.init({"cluster.device_place_prefer_intra_node": False})
  init_fn, loss_fn = linen_fns(MLP())
  batch = classification_batch(16)
  trainer = epl.Trainer(init_fn, loss_fn, optax.sgd(0.1))
  trainer.init(jax.random.key(0), batch)
  mine = io.process_slice(batch, trainer.plan)          # one process owns every row
  np.testing.assert_array_equal(mine["x"], batch["x"])
