"""Runs on the object store (docs/storage.md): base_output_directory=gs://… against a GCS API server on loopback.

The training runs are real processes that reach the server through STORAGE_EMULATOR_HOST alone, as a user sets it.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from gcs import DERIVED, emulator, filesystem, process_env
from helpers import REPO, compilation_cache_env, train_command
from maxpar.core import storage
from maxpar.train import main as train_main

BUCKET = "maxpar-test"
RUN = f"gs://{BUCKET}/runs/r"
STEPS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with emulator(BUCKET, tmp_path_factory.mktemp("emulator") / "emulator.log") as url:
        yield url


@pytest.fixture
def gcs(server, monkeypatch):
    """This test's process on the emulator: STORAGE_EMULATOR_HOST, and the variables maxpar derives from it set here
    by the test (so that they never outlive it)."""
    environ = {storage.EMULATOR: server}
    for key, value in {**environ, **storage.emulator_environment(environ)}.items():
        monkeypatch.setenv(key, value)
    return server


def run(command: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def rows(fs, path: str) -> list[dict]:
    return [json.loads(line) for line in fs.cat(path).decode().splitlines()]


def test_the_emulator_variable_drives_tensorstore_and_gcsfs():
    derived = storage.emulator_environment({storage.EMULATOR: "http://127.0.0.1:1"})
    assert set(derived) == set(DERIVED) and derived["TENSORSTORE_GCS_HTTP_URL"] == "http://127.0.0.1:1"
    assert storage.emulator_environment({storage.EMULATOR: "u", "GOOGLE_AUTH_TOKEN_FOR_TESTING": "t"}).keys() == {
        "TENSORSTORE_GCS_HTTP_URL", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    assert storage.emulator_environment({}) == {}


@pytest.fixture(scope="module")
def trained(server, tmp_path_factory):
    """A run trained on gs:// with checkpoints at steps 3 and 6: (its output, the environment of its processes)."""
    env = process_env(server, compilation_cache_env(tmp_path_factory.mktemp("jax_cache")))
    command = train_command("dataset_type=synthetic", "per_device_batch_size=1", f"steps={STEPS}",
                            "enable_checkpointing=true", "checkpoint_period=3",
                            f"base_output_directory=gs://{BUCKET}/runs", "run_name=r")
    done = run(command, env)
    assert done.returncode == 0, done.stdout + done.stderr
    return command, done.stdout + done.stderr, env


def test_a_run_writes_everything_into_the_bucket(trained, gcs, tmp_path):
    _, output, _ = trained
    fs = filesystem(gcs)
    names = {path.removeprefix(f"{BUCKET}/runs/r/") for path in fs.find(f"{BUCKET}/runs/r")}
    for name in ("config.yml", "metrics.jsonl", "loss_curve.png", "libraries.log", "checkpoints/3/meta/metadata",
                 "checkpoints/6/params/_METADATA"):
        assert name in names or any(n.startswith(name) for n in names), (name, sorted(names))
    assert any(n.startswith("tensorboard/events.out.tfevents.") for n in names), sorted(names)
    assert [r["step"] for r in rows(fs, f"{BUCKET}/runs/r/metrics.jsonl")] == list(range(1, STEPS + 1))
    assert f"checkpoint: {RUN}/checkpoints/6" in output
    assert not (REPO / "gs:").exists() and not (tmp_path / "gs:").exists()


def test_the_same_run_name_resumes_from_the_bucket_bitwise(trained, gcs):
    command, _, env = trained
    fs = filesystem(gcs)
    uninterrupted = rows(fs, f"{BUCKET}/runs/r/metrics.jsonl")
    fs.rm(f"{BUCKET}/runs/r/checkpoints/6", recursive=True)  # as if the run had stopped after step 3's checkpoint
    done = run(command, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dropped the rows after step 3" in done.stdout + done.stderr
    resumed = rows(fs, f"{BUCKET}/runs/r/metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted]  # bitwise: floats from JSON
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in uninterrupted]


def test_the_printed_sample_command_runs_from_the_bucket(trained, gcs):
    _, output, env = trained
    line = next(line for line in output.splitlines() if "sample from it:" in line)
    words = shlex.split(line.split("sample from it: ", 1)[1])
    assert words[:4] == ["python", "-m", "maxpar.generate", f"{RUN}/config.yml"]
    assert f"load_parameters_path={RUN}/checkpoints/6" in words or f"load_parameters_path={RUN}/checkpoints/3" in words
    done = run([sys.executable, *words[1:], "max_new_tokens=4"], env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--- prompt: 'def '" in done.stdout


@pytest.mark.parametrize("where", ["missing bucket", "unreachable server"])
def test_a_bucket_it_cannot_write_is_one_line_and_exit_2(gcs, monkeypatch, capsys, where):
    value = f"gs://{BUCKET}-missing/runs"
    if where == "unreachable server":
        from gcs import free_port
        monkeypatch.setenv(storage.EMULATOR, f"http://127.0.0.1:{free_port()}")
        value = f"gs://{BUCKET}/runs"
    status = train_main(["configs/base.yml", "dataset_type=synthetic", f"base_output_directory={value}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"maxpar: config error: base_output_directory={value!r}: cannot write there"), err
    assert ("no bucket" if where == "missing bucket" else "cannot connect to 127.0.0.1") in err[0]
    assert "server http://127.0.0.1:" in err[0]
    assert not filesystem(gcs).exists(f"{BUCKET}-missing"), "the check must never create the bucket"


def test_a_text_dataset_and_its_tokenizer_read_from_the_bucket_give_the_same_batches(gcs, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    import numpy as np

    from helpers import tiny_config, write_corpus
    from maxpar.io.data.pipeline import open_datasets

    local = tmp_path / "data"
    write_corpus(local / "corpus")
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    hf.train_from_iterator([(local / "corpus" / "doc_00.txt").read_text()] * 4,
                           tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    hf.save(str(local / "tokenizer.json"))
    filesystem(gcs).put(str(local), f"{BUCKET}/data", recursive=True)

    def batches(root: str) -> list[dict]:
        config = tiny_config("dataset_type=text", f"dataset_path={root}/corpus/*.txt",
                             f"tokenizer_path={root}/tokenizer.json", "eval_fraction=0.25")
        datasets = open_datasets(config, global_rows=4, eval_rows=4, shard_index=0, shard_count=1)
        iterator = iter(datasets.train)
        return [next(iterator) for _ in range(3)]

    remote, here = batches(f"gs://{BUCKET}/data"), batches(str(local))
    for a, b in zip(remote, here, strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_what_reads_only_local_files_refuses_gs_in_one_line(tmp_path, capsys):
    """Record shards, hf_data_files and the converter's directories are local only: a gs:// value is refused by
    name (never a local folder `gs:`), before anything is read."""
    from helpers import tiny_config
    from maxpar.core.config import ConfigError
    from maxpar.convert.__main__ import main as convert_main
    from maxpar.io.data.pipeline import corpus

    with pytest.raises(ConfigError, match=r"^dataset_path='gs://b/shards/\*': dataset_type=grain reads local"):
        corpus(tiny_config("dataset_type=grain", "dataset_path=gs://b/shards/*"))
    with pytest.raises(SystemExit) as exited:
        convert_main(["from_hf", "--hf_path", str(tmp_path), "--out", "gs://b/converted"])
    assert exited.value.code == 2
    assert "'gs://b/converted': maxpar.convert reads and writes local paths only" in capsys.readouterr().err
    assert not (REPO / "gs:").exists() and not (tmp_path / "gs:").exists()


def test_each_kind_of_refused_write_is_named():
    from gcsfs.retry import HttpError

    from maxpar.host.preflight import remote_problem

    def problem(error: Exception) -> str:
        return remote_problem("gs://b/runs", error)

    assert problem(FileNotFoundError("b/runs/x")) == "no bucket 'b'"
    assert problem(HttpError({"code": 401, "message": "Anonymous caller does not have storage.objects.create"})
                   ).startswith("no usable credentials: Anonymous caller")
    assert problem(OSError("Forbidden: b/runs/x\nx@y does not have storage.objects.create access")
                   ).startswith("permission denied: Forbidden: b/runs/x x@y does not have")
    assert problem(OSError("Forbidden: b/runs/x\nAnonymous caller does not have storage.objects.create access")
                   ).startswith("no usable credentials: Forbidden")
