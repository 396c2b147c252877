import jax
import pytest

import epljax as epl
from epljax.env import Env


def test_cluster_facts_on_one_process_with_8_devices():
  env = epl.init()
  assert env is epl.Env.get()
  cluster = env.cluster
  assert (cluster.worker_num, cluster.worker_index) == (1, 0)
  assert cluster.total_gpu_num == 8 and cluster.local_device_count == 8
  assert cluster.platform == "cpu"
  assert list(cluster.devices) == jax.devices()


def test_run_visible_devices_keeps_only_the_listed_devices():
  cluster = epl.init({"cluster.run_visible_devices": "0,1,2,3"}).cluster
  assert cluster.total_gpu_num == 4 and [d.id for d in cluster.devices] == [0, 1, 2, 3]
  with pytest.raises(ValueError, match=r"names device ids \[9\] but this host has"):
    epl.init({"cluster.run_visible_devices": "0,9"})
  with pytest.raises(ValueError, match="must be comma-separated device ids"):
    epl.init({"cluster.run_visible_devices": "gpu0"})


def test_reinit_replaces_config_and_forgets_the_default_strategy():
  epl.init({"pipeline.num_micro_batch": 4})
  epl.set_default_strategy(epl.replicate(1, name="old"))
  assert epl.strategy.default_strategy() is not None
  env = epl.init()
  assert env.config.pipeline.num_micro_batch == 1
  assert epl.strategy.default_strategy() is None


def test_get_before_init_says_how_to_start(monkeypatch):
  monkeypatch.setattr(Env, "_current", None)
  with pytest.raises(epl.StateError, match=r"epl.init\(\) has not been called"):
    epl.Env.get()
  with pytest.raises(RuntimeError):
    epl.Trainer(lambda r, b: {}, lambda v, b: 0.0, None)
