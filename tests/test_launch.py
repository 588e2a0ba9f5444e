"""Launchers: the local N-process launcher (failures stop the job within a bound, nothing is left behind),
the `xpk workload create` command and the JobSet manifests.

The failure tests launch this file as each process's module (`python -m tests.test_launch CONFIG ...`,
see `collective_loop`): it joins the job through `maxpar.host.distributed` exactly like the trainer, then
runs cross-process collectives until stopped, so a failure costs seconds rather than a compile.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from launch import jobset, local, xpk
from launch.cluster import parse_tpu_type, torus_topology
from maxpar.core.config import ConfigError, load_config
from maxpar.host.distributed import distributed_spec

REPO = Path(__file__).resolve().parents[1]
BASE = "configs/base.yml"
HEARTBEAT_S = 10


def collective_loop(argv: list[str]) -> int:
    """One process of a job that never ends: join it per the config and environment, then all-gather
    a counter across the processes every 0.1 s."""
    import numpy as np
    from jax.experimental import multihost_utils

    from maxpar.host import distributed

    distributed.setup(load_config(argv))
    for tick in range(1, 10**9):
        multihost_utils.process_allgather(np.int32(tick))
        print(f"tick {tick}", flush=True)
        time.sleep(0.1)
    return 0


FAILURE_GAP_S = 0.5


def fail_in_order(argv: list[str]) -> int:
    """One process of a 2-process job whose ranks fail in a known order, well apart: rank 1 is killed (SIGKILL),
    and rank 0, once it sees rank 1's marker file in directory argv[0], exits FAILURE_GAP_S later with status 134
    (as JAX's runtime aborts a process that lost a peer), leaving a marker of its own."""
    directory, rank = Path(argv[0]), int(os.environ["MEGASCALE_SLICE_ID"])
    if rank == 1:
        (directory / "rank1").touch()
        os.kill(os.getpid(), signal.SIGKILL)
    while not (directory / "rank1").exists():
        time.sleep(0.01)
    time.sleep(FAILURE_GAP_S)
    (directory / "rank0").touch()
    os._exit(134)


# ---------------------------------------------------------------- local launcher

def test_launcher_arguments():
    args = local.parse_args(["--num_processes", "2", "--devices_per_process", "4", "--", BASE, "steps=3"])
    assert (args.num_processes, args.devices_per_process, args.module, args.args) == (2, 4, "maxpar.train",
                                                                                        (BASE, "steps=3"))
    for bad in (["--num_processes", "0"], ["--num_processes", "2", "--devices_per_process", "0"],
                ["--num_processes", "2", "--timeout_s", "-1"]):
        with pytest.raises(SystemExit) as info:
            local.parse_args(bad)
        assert info.value.code == 2


def test_free_port_is_bindable():
    import socket
    port = local.free_port()
    with socket.socket() as sock:
        sock.bind((local.LOCALHOST, port))


def test_only_gloos_all_connected_lines_are_dropped_unless_log_level_is_debug():
    connected = "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
    assert local.is_gloo_all_connected(connected)
    assert not local.is_gloo_all_connected(connected.replace("connected to 3", "connected to 2"))  # a real problem
    assert not local.is_gloo_all_connected("maxpar: run /tmp/run")
    # Gloo's threads print at once: pieces of two messages on one line, the rest of one on the next.
    assert local.is_gloo_all_connected(f"[Gloo] Rank 0 is connected to {connected}")
    assert local.is_gloo_all_connected("7 peer ranks. Expected number of connected peer ranks is : 7")
    assert local.is_gloo_all_connected("[Gloo] Rank 54[Gloo] Rank 7 is connected to  is connected to 77 peer ranks.  "
                                       "peer ranks. Expected number of connected peer ranks is : 7 peer ranks. "
                                       "Expected number of connected peer ranks is : ")  # ends mid-message
    assert not local.shows_library_logs([BASE])
    assert local.shows_library_logs([BASE, "log_level=debug"])
    assert not local.shows_library_logs(["spec.json"])  # not a config: another --module's arguments


class Launched:
    """The launcher in the background, its output collected line by line."""

    def __init__(self, *launcher_args: str):
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "launch.local", *launcher_args], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None and not any(re.search(pattern, l) for l in self.lines):
                break
            time.sleep(0.1)
        self.proc.kill()
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.lines[-40:]))

    def pid(self, rank: int) -> int:
        return int(self.wait_for(rf"rank {rank} pid (\d+)", 30).group(1))

    def output(self) -> str:
        return "\n".join(self.lines)

    def last_line(self) -> str:
        """The launcher's last output line, once it has exited and all its output is read."""
        self.reader.join(timeout=10)
        return self.lines[-1]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _stop_one_rank(rank: int, how: str) -> tuple[Launched, int, float, list[int]]:
    """A 2-process collective loop with `rank` SIGKILLed or SIGSTOPped (hung) after the other's tick 3:
    the launcher, its exit status, seconds from the signal to its exit, and the ranks' pids."""
    job = Launched("--num_processes", "2", "--module", "tests.test_launch", "--grace_s", "3", "--timeout_s", "300",
                   "--", BASE, f"distributed_heartbeat_timeout_s={HEARTBEAT_S}")
    pids = [job.pid(0), job.pid(1)]
    job.wait_for(rf"^\[rank {1 - rank}\] tick 3$", 120)
    start = time.monotonic()
    os.kill(pids[rank], signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    code = job.proc.wait(timeout=HEARTBEAT_S + 60)
    return job, code, time.monotonic() - start, pids


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_failed_process_stops_the_job_within_the_bound(how):
    """SIGKILL: the launcher sees the exit and stops the rest. SIGSTOP (a hang): the live process's
    distributed runtime misses the heartbeats and fails by itself, then the launcher stops the rest."""
    job, code, elapsed, pids = _stop_one_rank(1, how)
    assert code != 0
    assert elapsed < HEARTBEAT_S + 3 + 15, elapsed  # heartbeat bound + grace + slack for a loaded machine
    assert "[Gloo]" not in job.output()  # its all-connected lines, dropped (log_level=info)
    if how == "killed":
        assert "maxpar: rank 1 was killed by signal 9; stopping the other processes" in job.output()
    else:
        assert re.search(r"maxpar: rank 0 \(the coordinator\) (exited with status|was killed by signal)", job.output())
        assert "stopped sending heartbeats" in job.output()
    assert job.last_line().startswith("maxpar: the job failed because rank ")
    assert all(_gone(pid) for pid in pids), "a process outlived the launcher"
    print(f"\n{how}: launcher exited with {code} {elapsed:.1f} s after rank 1 was {how}")


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_coordinator_stops_the_job_with_a_clear_last_word(how):
    """Rank 0 hosts the coordinator: when it dies or hangs, JAX's runtime aborts the peer from C++ (signal 6,
    a stack dump maxpar cannot intercept), so the launcher's last line must name the lost coordinator."""
    job, code, elapsed, pids = _stop_one_rank(0, how)
    assert code == (137 if how == "killed" else 134)
    # heartbeat bound (hung only) + the launcher's wait for a live coordinator to fail too + grace + slack
    assert elapsed < HEARTBEAT_S + local.COORDINATOR_GRACE_S + 3 + 15, elapsed
    if how == "killed":
        assert "maxpar: rank 0 (the coordinator) was killed by signal 9; stopping the other processes" in job.output()
        assert job.last_line().startswith("maxpar: the job failed because rank 0, the coordinator, was killed by "
                                          "signal 9: the other ranks lost it")
    else:
        assert re.search(r"maxpar: rank 1 was killed by signal 6; rank 0 \(the coordinator\) is still running .* so it "
                         r"has hung", job.output())
        assert job.last_line().startswith("maxpar: the job failed because rank 0, the coordinator, stopped answering "
                                          "(hung or frozen)")
    assert all(_gone(pid) for pid in pids), "a process outlived the launcher"
    print(f"\n{how}: launcher exited with {code} {elapsed:.1f} s after rank 0 was {how}")


def test_the_launcher_blames_the_rank_that_failed_first(tmp_path, monkeypatch):
    """Rank 1 is killed and rank 0 aborts FAILURE_GAP_S later, and the launcher looks only once both are gone (as a
    busy launcher may, within one look): it blames rank 1, whose exit came first, not the lower-numbered rank."""
    monkeypatch.chdir(REPO)
    args = local.parse_args(["--num_processes", "2", "--module", "tests.test_launch", "--grace_s", "3", "--",
                             "fail_in_order", str(tmp_path)])
    job = local.Job(args, out=io.StringIO(), err=io.StringIO())
    try:
        job.start()
        end = time.monotonic() + 120
        while not (tmp_path / "rank0").exists() and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(FAILURE_GAP_S)  # rank 0 exits right after its marker
        code = job.wait()
    finally:
        job.stop()
    assert job.verdict == "the job failed because rank 1 was killed by signal 9", job.err.getvalue()
    assert code == 137


def test_launcher_exits_with_the_failing_status():
    job = Launched("--num_processes", "2", "--", "configs/base.yml", "no_such_key=1")
    assert job.proc.wait(timeout=120) == 2
    # Whichever rank fails first stops the other, so only one rank's message is certain.
    assert re.search(r"\[rank [01]\] maxpar: config error: unknown config key 'no_such_key'", job.output())
    assert re.search(r"maxpar: rank [01]( \(the coordinator\))? exited with status 2", job.output())


# ---------------------------------------------------------------- TPU types, XPK and JobSet

def test_tpu_types():
    assert parse_tpu_type("v5p-128") == jobset.TpuSlice("v5p-128", "tpu-v5p-slice", "4x4x4", 64, 16)
    assert parse_tpu_type("v5litepod-16").topology == "4x4" and parse_tpu_type("v5litepod-16").hosts == 4
    assert parse_tpu_type("v6e-256").chips_per_host == 4
    assert parse_tpu_type("v5p-8").topology == "2x2x1" and parse_tpu_type("v5p-8").hosts == 1
    assert [torus_topology(c, 3) for c in (8, 16, 32)] == ["2x2x2", "2x2x4", "2x4x4"]
    for bad in ("v5p-12", "v7-8", "tpu"):
        with pytest.raises(ConfigError, match="--tpu_type"):
            parse_tpu_type(bad)


CONFIG_ARGS = [BASE, "model_name=llama2-7b", "dcn_data_parallelism=2", "ici_fsdp_parallelism=-1", "steps=1000"]


def test_xpk_command_dry_run(capsys):
    code = xpk.main(["--cluster", "c1", "--workload", "llama-run", "--tpu_type", "v5p-128", "--num_slices", "2",
                     "--docker_image", "gcr.io/p/maxpar:1", "--priority", "high", "--max_restarts", "3",
                     "--project", "p", "--zone", "us-east5-a", "--dry-run", "--", *CONFIG_ARGS])
    assert code == 0
    argv = shlex.split(capsys.readouterr().out)
    assert argv[:3] == ["xpk", "workload", "create"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags == {"--cluster": "c1", "--workload": "llama-run", "--tpu-type": "v5p-128", "--num-slices": "2",
                     "--docker-image": "gcr.io/p/maxpar:1", "--priority": "high", "--max-restarts": "3",
                     "--command": flags["--command"], "--project": "p", "--zone": "us-east5-a"}
    command = shlex.split(flags["--command"])
    assert command[:3] == ["python3", "-m", "maxpar.train"]
    # No run_name given: the workload's name, so that XPK's restarts resume instead of starting over.
    assert load_config(command[3:]) == load_config([*CONFIG_ARGS, "run_name=llama-run"])


def test_an_explicit_run_name_is_kept():
    command = xpk.xpk_command(cluster="c", workload="w", tpu_type="v5p-128", num_slices=2, docker_image="i",
                              config_args=[*CONFIG_ARGS, "run_name=mine"])
    assert load_config(shlex.split(command[command.index("--command") + 1])[3:]).run_name == "mine"


def test_xpk_rejects_bad_input_and_needs_xpk(monkeypatch, capsys):
    common = ["--cluster", "c", "--tpu_type", "v5p-128", "--docker_image", "i", "--num_slices", "2"]
    assert xpk.main([*common, "--workload", "Bad_Name", "--dry-run", "--", *CONFIG_ARGS]) == 2
    assert xpk.main([*common, "--workload", "ok", "--priority", "urgent", "--dry-run", "--", *CONFIG_ARGS]) == 2
    assert xpk.main([*common, "--workload", "ok", "--num_slices", "4", "--dry-run", "--", *CONFIG_ARGS]) == 2
    err = capsys.readouterr().err
    assert "--workload='Bad_Name'" in err and "--priority='urgent'" in err
    assert "dcn degrees (dcn_data_parallelism=2) multiply to 2 but there are 4 slices" in err
    monkeypatch.setattr(xpk.shutil, "which", lambda name: None)
    assert xpk.main([*common, "--workload", "ok", "--", *CONFIG_ARGS]) == 1
    assert "xpk is not installed" in capsys.readouterr().err


def _pod_env(container: dict, slice_id: int, worker_id: int, gke_tpu_hosts: int | None) -> dict[str, str]:
    """The environment Kubernetes (and, on TPU, GKE) gives one pod of the manifest."""
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == jobset.JOB_INDEX
            env[var["name"]] = str(slice_id)
    env["JOB_COMPLETION_INDEX"] = str(worker_id)
    if gke_tpu_hosts is not None:
        env["TPU_WORKER_HOSTNAMES"] = ",".join(f"host{i}" for i in range(gke_tpu_hosts))
        env["TPU_WORKER_ID"] = str(worker_id)
    return env


def _check_jobset(manifest: dict, replicas: int, hosts: int, gke_tpu: bool) -> dict:
    assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and manifest["kind"] == "JobSet"
    assert re.fullmatch(r"[a-z][-a-z0-9]*", manifest["metadata"]["name"])
    (rjob,) = manifest["spec"]["replicatedJobs"]
    assert rjob["replicas"] == replicas
    job = rjob["template"]["spec"]
    assert job["parallelism"] == job["completions"] == hosts and job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["command"][:3] == ["python3", "-m", "maxpar.train"]
    name = manifest["metadata"]["name"]
    assert load_config(container["command"][3:]) == load_config([*CONFIG_ARGS, f"run_name={name}"])
    # Every pod joins the same job as a distinct process: ids 0 .. replicas x hosts - 1.
    config = load_config(container["command"][3:])
    specs = [distributed_spec(config, _pod_env(container, s, w, hosts if gke_tpu else None))
             for s in range(replicas) for w in range(hosts)]
    assert {(sp.coordinator_address, sp.num_processes) for sp in specs} == {(f"{name}-slice-0-0.{name}:8482",
                                                                            replicas * hosts)}
    assert sorted(sp.process_id for sp in specs) == list(range(replicas * hosts))
    return pod


def test_tpu_jobset_manifest(tmp_path):
    out = tmp_path / "jobset.yaml"
    assert jobset.main(["--name", "llama-run", "--image", "gcr.io/p/maxpar:1", "--tpu_type", "v5p-128",
                        "--num_slices", "2", "--max_restarts", "4", "--priority_class", "high",
                        "--output", str(out), "--", *CONFIG_ARGS]) == 0
    (manifest,) = list(yaml.safe_load_all(out.read_text()))
    pod = _check_jobset(manifest, replicas=2, hosts=16, gke_tpu=True)
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 4
    assert manifest["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == \
        "cloud.google.com/gke-nodepool"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "4x4x4"}
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": 4}
    assert pod["priorityClassName"] == "high" and pod["hostNetwork"] is True


def test_gpu_jobset_manifest(capsys):
    assert jobset.main(["--name", "gpu-run", "--image", "img", "--gpu_type", "nvidia-h100-80gb",
                        "--num_nodes", "2", "--gpus_per_node", "8", "--", *CONFIG_ARGS]) == 0
    manifest = yaml.safe_load(capsys.readouterr().out)
    pod = _check_jobset(manifest, replicas=2, hosts=1, gke_tpu=False)
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8}


def test_jobset_rejects_bad_input(capsys):
    common = ["--image", "i", "--tpu_type", "v5p-128", "--num_slices", "2"]
    assert jobset.main(["--name", "x" * 41, *common, "--", *CONFIG_ARGS]) == 2
    assert jobset.main(["--name", "ok", *common, "--", BASE, "dcn_data_parallelism=3"]) == 2
    assert jobset.main(["--name", "ok", *common, "--", BASE, "no_such_key=1"]) == 2
    err = capsys.readouterr().err
    assert "at most 40 characters" in err and "dcn_data_parallelism=3" in err and "unknown config key" in err


if __name__ == "__main__":
    if sys.argv[1:2] == ["fail_in_order"]:
        sys.exit(fail_in_order(sys.argv[2:]))
    sys.exit(collective_loop(sys.argv[1:]))


def test_cluster_launchers_warn_about_a_local_output_directory(tmp_path, capsys):
    """A rescheduled pod loses a local directory; a bucket needs no warning."""
    xpk_args = ["--cluster", "c", "--workload", "w", "--tpu_type", "v5p-128", "--num_slices", "2", "--docker_image", "i",
                "--dry-run", "--"]
    jobset_args = ["--name", "w", "--image", "i", "--tpu_type", "v5p-128", "--num_slices", "2",
                   "--output", str(tmp_path / "j.yaml"), "--"]
    for main, args in ((xpk.main, xpk_args), (jobset.main, jobset_args)):
        assert main([*args, *CONFIG_ARGS]) == 0
        assert "base_output_directory=outputs is a local path" in capsys.readouterr().err
        assert main([*args, *CONFIG_ARGS, "base_output_directory=gs://bucket/runs"]) == 0
        assert "warning" not in capsys.readouterr().err


def test_the_container_image_is_installed_by_install_sh_where_the_launchers_run_the_trainer():
    """No Docker engine here: the Dockerfile is checked for what the launchers rely on (issue 43)."""
    from launch.cluster import TRAINER
    root = REPO
    lines = [line.strip() for line in (root / "Dockerfile").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    instructions = {line.split()[0]: line.split(None, 1)[1] for line in lines}
    assert instructions["FROM"].startswith("python:3.12")
    assert instructions["RUN"].startswith('bash install.sh "${EXTRAS}"') and instructions["ARG"] == 'EXTRAS=""'
    workdir = instructions["WORKDIR"]
    assert instructions["COPY"] == ". ." and (root / "configs" / "base.yml").is_file()  # configs/base.yml in WORKDIR
    assert instructions["ENV"] == f"PATH={workdir}/.venv/bin:$PATH" and TRAINER[0] == "python3"  # install.sh's venv
    ignored = set((root / ".dockerignore").read_text().split())
    assert {".git", ".venv", "outputs"} <= ignored
    guide = (root / "docs" / "multi-host.md").read_text()
    image = re.search(r"--docker_image (\S+)", guide)[1]
    assert f"docker build -t {image} ." in guide and f"docker push {image}" in guide and f"--image {image}" in guide
