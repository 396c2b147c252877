"""The launcher's rules, without starting processes: flags -> workers, worker env -> runtime."""

import sys

import jax
import pytest

from epljax.launch import cli, jobs, runtime
from epljax.launch.runtime import LaunchError, WorkerEnv


def test_one_host_cpu_workers_get_a_local_coordinator_and_their_cpu_devices():
  job = jobs.Job("train.py", ("--lr", "0.1"), num_workers=2, gpu_per_worker=3)
  environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/x"}
  workers = jobs.plan_workers(job, environ, gpus=0, port=6001)
  assert [w.index for w in workers] == [0, 1]
  for i, w in enumerate(workers):
    assert w.argv == (sys.executable, jobs.RUN_SCRIPT, "train.py", "--lr", "0.1")
    assert w.env[runtime.COORDINATOR] == "127.0.0.1:6001"
    assert w.env[runtime.BIND] == "127.0.0.1:6001"          # never listens beyond this host
    assert (w.env[runtime.NUM_WORKERS], w.env[runtime.WORKER_INDEX]) == ("2", str(i))
    assert w.env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=3"
    assert w.env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
    assert w.env["JAX_PLATFORMS"] == "cpu" and "CUDA_VISIBLE_DEVICES" not in w.env
    assert w.log_path is None


def test_gpu_workers_get_disjoint_gpus_within_the_inherited_visible_ones():
  job = jobs.Job("run.sh", num_workers=2, gpu_per_worker=2, log_dir="/logs")
  workers = jobs.plan_workers(job, {}, gpus=4, port=6001)
  assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0,1", "2,3"]
  assert workers[0].argv[1:] == ("run.sh",) and workers[0].argv[0].endswith("bash")
  assert [w.log_path for w in workers] == ["/logs/worker_0.log", "/logs/worker_1.log"]
  inherited = jobs.plan_workers(job, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, gpus=8, port=6001)
  assert [w.env["CUDA_VISIBLE_DEVICES"] for w in inherited] == ["4,5", "6,7"]
  with pytest.raises(LaunchError, match=r"need 6 GPUs on this host, but it has 4"):
    jobs.plan_workers(jobs.Job("run.sh", num_workers=2, gpu_per_worker=3), {}, gpus=4)


def test_multi_host_runs_one_worker_per_host_with_the_first_entry_as_coordinator():
  job = jobs.Job("train.py", num_workers=2, gpu_per_worker=8, machine_rank=1,
                 machine_list=("10.0.0.1:6000", "10.0.0.2:6000"))
  [worker] = jobs.plan_workers(job, {}, gpus=8)
  assert worker.index == 1 and worker.env[runtime.WORKER_INDEX] == "1"
  assert worker.env[runtime.COORDINATOR] == "10.0.0.1:6000"
  assert runtime.BIND not in worker.env                    # JAX's default: all interfaces
  assert worker.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_workers=3, machine_list=("a:1", "b:1")), r"names 2 workers .* --num_workers is 3"),
    (dict(num_workers=2, machine_rank=0), r"--machine_rank needs --machine_list"),
    (dict(num_workers=2, machine_rank=2, machine_list=("a:1", "b:1")), r"must be in 0\.\.1"),
    (dict(num_workers=1, machine_list=("a",)), r"entry 'a' must be host:port"),
    (dict(num_workers=1, machine_list=("a:99999",)), r"with a port from 1 to 65535"),
    (dict(num_workers=0), r"must be at least 1"),
    (dict(init_timeout=0), r"--init_timeout 0 must be a positive number"),
    (dict(grace_period=-1), r"--grace_period -1 must be 0 or more seconds"),
    (dict(hang_timeout=-5), r"--hang_timeout -5 must be 0 \(never\) or more seconds"),
])
def test_bad_flags_are_refused_with_the_fix(kwargs, message):
  with pytest.raises(LaunchError, match=message):
    jobs.Job("train.py", **kwargs)


def test_cli_reads_epl_flags_and_keeps_script_arguments_unchanged(tmp_path):
  script = tmp_path / "run.sh"
  script.write_text("echo hi\n")
  job = cli.job_from_args(["--num_workers", "2", "--gpu_per_worker", "1", "--debug", "True",
                           "--log_dir", "logs", "--grace_period", "12", "--hang_timeout", "0",
                           str(script), "--num_workers", "x y", "--debug"])
  assert (job.num_workers, job.gpu_per_worker, job.debug, job.log_dir) == (2, 1, True, "logs")
  assert (job.grace_period, job.hang_timeout) == (12, 0)
  defaults = cli.job_from_args(["--num_workers", "1", "--gpu_per_worker", "1", str(script)])
  assert (defaults.grace_period, defaults.hang_timeout) == (30, 600)
  assert job.args == ("--num_workers", "x y", "--debug")
  assert not cli.job_from_args(["--num_workers", "1", "--gpu_per_worker", "1", "--debug",
                                "false", str(script)]).debug
  with pytest.raises(LaunchError, match="is not a file"):
    cli.job_from_args(["--num_workers", "1", "--gpu_per_worker", "1", "missing.sh"])
  assert cli.main(["--num_workers", "1", "--gpu_per_worker", "1", "missing.sh"]) == 2


def test_worker_env_round_trip_and_bad_values():
  worker = WorkerEnv("127.0.0.1:5", 4, 3, 7.5, "127.0.0.1:5")
  assert WorkerEnv.from_environ(worker.to_environ()) == worker
  assert WorkerEnv.from_environ({}) is None
  with pytest.raises(LaunchError, match=r"\['EPL_WORKER_INDEX'\] are not"):
    WorkerEnv.from_environ({runtime.COORDINATOR: "h:1", runtime.NUM_WORKERS: "2"})
  with pytest.raises(LaunchError, match=r"EPL_WORKER_INDEX=2 must be in 0\.\.EPL_NUM_WORKERS-1"):
    WorkerEnv.from_environ({**worker.to_environ(), runtime.NUM_WORKERS: "2",
                            runtime.WORKER_INDEX: "2"})
  with pytest.raises(LaunchError, match="EPL_INIT_TIMEOUT='soon' must be a positive number"):
    runtime.init_timeout({runtime.INIT_TIMEOUT: "soon"})


def test_schedulers_jax_detects_count_their_processes():
  slurm = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "4",
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
  assert runtime.scheduler_processes(slurm) == 4
  assert runtime.scheduler_processes({k: v for k, v in slurm.items()
                                      if k != "SLURM_STEP_NODELIST"}) == 1   # sbatch, no srun
  assert runtime.scheduler_processes({"OMPI_MCA_orte_hnp_uri": "x",
                                      "OMPI_COMM_WORLD_SIZE": "2"}) == 2
  assert runtime.scheduler_processes({}) == 1


def test_a_single_process_initializes_nothing():
  runtime.initialize({})
  runtime.initialize(WorkerEnv("127.0.0.1:1", 1, 0).to_environ())   # a one-worker launch
  assert not jax.distributed.is_initialized()
