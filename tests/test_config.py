import os

import pytest

import epljax as epl
from epljax.config import all_keys, describe

# Every key of EPL's configuration page with its documented default.
EPL_DEFAULTS = {
    "pipeline.num_micro_batch": 1,
    "pipeline.num_stages": None,
    "pipeline.strategy": "PreferBackward",
    "pipeline.num_virtual_stages": 1,                    # beyond EPL
    "pipeline.roll_layers": True,                        # beyond EPL
    "pipeline.param_layout": "user",                     # beyond EPL
    "gradient_checkpoint.type": "",
    "gradient_checkpoint.end_taskgraph": -1,
    "gradient_checkpoint.check_gradients": False,
    "gradient_checkpoint.offload_activations": False,   # beyond EPL
    "zero.level": "",
    "zero.shard_size": "all",                            # beyond EPL
    "offload.level": "",
    "amp.level": "",
    "amp.debug_log": False,
    "amp.loss_scale": "dynamic",
    "optimizer.num_apply_group": 1,
    "cluster.device_place_prefer_intra_node": True,
    "cluster.run_visible_devices": "",
    "cluster.colocate_split_and_replicate": False,
    "communication.num_communicators": 2,
    "communication.sparse_as_dense": False,
    "communication.max_splits": 5,
    "communication.fp16": False,
    "communication.fp16_scale": 128,
    "communication.clip_after_allreduce": False,
    "communication.gradients_reduce_method": "mean",
    "io.slicing": False,
    "io.unbalanced_io_slicing": False,
    "io.drop_last_files": False,
    "auto.auto_parallel": False,
    "auto.memory_limit": 0,                              # beyond EPL
    "auto.max_compiles": 5,                              # beyond EPL
    "auto.peak_flops": 0.0,                              # beyond EPL
    "auto.efficiency": 0.0,                              # beyond EPL
    "auto.intra_host_bandwidth": 0.0,                    # beyond EPL
    "auto.inter_host_bandwidth": 0.0,                    # beyond EPL
    "context.parallel_degree": 1,                        # beyond EPL
}


def test_every_epl_key_has_its_documented_default():
  config = epl.Config()
  assert config.to_dict() == EPL_DEFAULTS
  assert all_keys() == list(EPL_DEFAULTS)
  assert config.pipeline.num_micro_batch == 1
  assert config.gradient_checkpoint.end_taskgraph == -1
  assert config.communication.gradients_reduce_method == "mean"


def test_dict_sets_keys_flat_or_nested():
  config = epl.Config({"pipeline.num_micro_batch": 4, "amp": {"level": "O1", "loss_scale": 128}})
  assert config.pipeline.num_micro_batch == 4
  assert config.amp.level == "O1" and config.amp.loss_scale == 128
  assert config.changed() == {"pipeline.num_micro_batch": 4, "amp.level": "O1",
                              "amp.loss_scale": 128}


def test_env_overrides_defaults_and_dict_beats_env(monkeypatch):
  monkeypatch.setenv("EPL_PIPELINE_NUM_MICRO_BATCH", "4")
  monkeypatch.setenv("EPL_COMMUNICATION_FP16", "true")
  monkeypatch.setenv("EPL_CLUSTER_DEVICE_PLACE_PREFER_INTRA_NODE", "False")
  monkeypatch.setenv("EPL_GRADIENT_CHECKPOINT_TYPE", "auto")
  monkeypatch.setenv("EPL_AMP_LOSS_SCALE", "256")
  monkeypatch.setenv("EPL_PIPELINE_NUM_STAGES", "none")
  config = epl.Config()
  assert config.pipeline.num_micro_batch == 4
  assert config.communication.fp16 is True
  assert config.cluster.device_place_prefer_intra_node is False
  assert config.gradient_checkpoint.type == "auto"
  assert config.amp.loss_scale == 256
  assert config.pipeline.num_stages is None
  assert epl.Config({"pipeline.num_micro_batch": 2}).pipeline.num_micro_batch == 2


def test_env_is_read_by_init(monkeypatch):
  monkeypatch.setenv("EPL_PIPELINE_STRATEGY", "PreferForward")
  assert epl.init().config.pipeline.strategy == "PreferForward"


def test_variables_of_other_prefixes_are_ignored(monkeypatch):
  monkeypatch.setenv("EPL_LAUNCH_COORDINATOR", "127.0.0.1:1234")
  assert epl.Config() == epl.Config({})


@pytest.mark.parametrize("param_dict, message", [
    ({"pipeline.num_micro_batc": 2},
     r"Unknown config key 'pipeline.num_micro_batc' \(from param_dict\)\. Did you mean "
     r"'pipeline.num_micro_batch'\? Keys of section 'pipeline': 'pipeline.num_micro_batch', "
     r"'pipeline.num_stages', 'pipeline.strategy', 'pipeline.num_virtual_stages', "
     r"'pipeline.roll_layers', 'pipeline.param_layout'\."),
    ({"zero.lvl": "v1"}, r"Did you mean 'zero.level'\?"),
    ({"pipline.strategy": "PreferForward"}, r"Did you mean 'pipeline.strategy'\?"),
    ({"foo.bar": 1}, r"Unknown config key 'foo.bar'.*Sections: pipeline, gradient_checkpoint"),
    ({"zero": "v1"}, r"'zero' \(from param_dict\) is a section, not a key: set one of its keys, "
     r"for example \{'zero.level': \.\.\.\}"),
    ({"pipeline.num_micro_batch": "4"},
     r"Config key 'pipeline.num_micro_batch' \(from param_dict\) expects an integer, got '4' "
     r"\(str\)\."),
    ({"pipeline.num_micro_batch": 2.0}, r"expects an integer, got 2.0 \(float\)"),
    ({"communication.fp16": 1}, r"'communication.fp16' .* expects a bool \(True/False\)"),
    ({"pipeline.strategy": "GPipe"},
     r"Config key 'pipeline.strategy' \(from param_dict\) must be one of 'PreferBackward', "
     r"'PreferForward'; got 'GPipe'\."),
    ({"zero.level": "v4"}, r"must be one of '', 'v1', 'v2', 'v3'; got 'v4'"),
    ({"communication.gradients_reduce_method": "avg"}, r"must be one of 'mean', 'sum'"),
    ({"pipeline.num_micro_batch": 0}, r"'pipeline.num_micro_batch' .* must be >= 1; got 0"),
    ({"amp.loss_scale": "auto"}, r"'amp.loss_scale' .* must be 'dynamic' or a positive number"),
    ({"amp.loss_scale": -2}, r"'amp.loss_scale' .* must be 'dynamic' or a positive number"),
])
def test_bad_keys_types_and_values_name_the_key_and_what_is_allowed(param_dict, message):
  with pytest.raises(ValueError, match=message):
    epl.Config(param_dict)
  with pytest.raises(epl.EPLError):
    epl.Config(param_dict)


@pytest.mark.parametrize("var, value, message", [
    ("EPL_PIPELINE_NUM_MICRO_BATC", "2",
     r"Unknown config key 'pipeline.num_micro_batc' \(from environment variable "
     r"EPL_PIPELINE_NUM_MICRO_BATC\)\. Did you mean 'pipeline.num_micro_batch'\?"),
    ("EPL_COMMUNICATION_FP16", "yes",
     r"EPL_COMMUNICATION_FP16='yes' for 'communication.fp16' must be 'true' or 'false'"),
    ("EPL_PIPELINE_NUM_MICRO_BATCH", "four",
     r"EPL_PIPELINE_NUM_MICRO_BATCH='four' for 'pipeline.num_micro_batch' must be an integer"),
    ("EPL_ZERO_LEVEL", "v9",
     r"'zero.level' \(environment variable EPL_ZERO_LEVEL\) must be one of"),
])
def test_bad_environment_variables_name_the_variable(monkeypatch, var, value, message):
  monkeypatch.setenv(var, value)
  with pytest.raises(ValueError, match=message):
    epl.Config()


def test_config_is_immutable_and_replace_returns_a_copy():
  config = epl.Config({"pipeline.num_micro_batch": 2})
  with pytest.raises(AttributeError, match="immutable"):
    config.pipeline = None
  with pytest.raises(AttributeError):
    config.pipeline.num_micro_batch = 3
  other = config.replace({"pipeline.strategy": "PreferForward"})
  assert other.pipeline.num_micro_batch == 2 and other.pipeline.strategy == "PreferForward"
  assert config.pipeline.strategy == "PreferBackward"
  with pytest.raises(ValueError, match="Did you mean 'pipeline.strategy'"):
    config.replace({"pipeline.stratgy": "PreferForward"})


def test_init_accepts_config_dict_or_none_and_rejects_others():
  assert epl.init({"zero.level": "v1"}).config.zero.level == "v1"
  assert epl.init(epl.Config({"io.slicing": True})).config.io.slicing is True
  with pytest.raises(ValueError, match="expects an epl.Config, a dict or None"):
    epl.init(["pipeline.num_micro_batch"])


def test_describe_lists_every_key():
  text = describe()
  for key in EPL_DEFAULTS:
    assert key in text


def test_environment_is_clean_between_tests():
  assert not [v for v in os.environ if v.startswith("EPL_")]
