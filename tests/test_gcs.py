"""Runs on the object store (docs/storage.md): base_output_directory=gs://… against a GCS API server on loopback.

The training runs are real processes that reach the server through STORAGE_EMULATOR_HOST alone, as a user sets it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gcs, helpers

import pytest  # noqa: E402

from gcs import DERIVED, emulator, filesystem, process_env  # noqa: E402
from helpers import REPO, compilation_cache_env, train_command  # noqa: E402
from maxpar.core import storage  # noqa: E402
from maxpar.train import main as train_main  # noqa: E402

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


@pytest.mark.slow
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


@pytest.mark.slow
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


def first_batches(config, count: int = 3) -> tuple[list[dict], dict]:
    """The first `count` training batches of `config`'s data, one eval batch, and the iterator's state after them
    (what a checkpoint saves)."""
    from maxpar.io.data.pipeline import open_datasets

    datasets = open_datasets(config, global_rows=4, eval_rows=4, shard_index=0, shard_count=1)
    iterator = iter(datasets.train)
    batches = [next(iterator) for _ in range(count)]
    if datasets.eval is not None:
        batches.append(next(iter(datasets.eval())))
    return batches, iterator.get_state()


def assert_same_batches(remote: tuple[list[dict], dict], here: tuple[list[dict], dict]) -> None:
    import numpy as np

    assert remote[1] == here[1]
    for a, b in zip(remote[0], here[0], strict=True):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_text_dataset_and_its_tokenizer_read_from_the_bucket_give_the_same_batches(gcs, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")

    from helpers import micro_config, write_corpus

    local = tmp_path / "data"
    write_corpus(local / "corpus")
    hf = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    hf.train_from_iterator([(local / "corpus" / "doc_00.txt").read_text()] * 4,
                           tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    hf.save(str(local / "tokenizer.json"))
    filesystem(gcs).put(str(local), f"{BUCKET}/data", recursive=True)

    def batches(root: str) -> tuple[list[dict], dict]:
        return first_batches(micro_config("dataset_type=text", f"dataset_path={root}/corpus/*.txt",
                                         f"tokenizer_path={root}/tokenizer.json", "eval_fraction=0.25"))

    assert_same_batches(batches(f"gs://{BUCKET}/data"), batches(str(local)))


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrayrecord", "hf-json", "hf-saved"])
def test_record_shards_and_hf_data_read_from_the_bucket_give_the_same_batches(gcs, tmp_path, monkeypatch, kind):
    """Grain's record shards (a gs:// glob), hf_data_files (a gs:// glob) and a save_to_disk hf_path on gs://:
    the same batches, eval batch and data position as from a local copy of the same files."""
    from test_records import record_texts, source_config

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the node-local cache of ArrayRecord shards
    local = tmp_path / kind
    config = source_config(kind, local, record_texts(30), "eval_fraction=0.2")
    filesystem(gcs).put(str(local), f"{BUCKET}/records/{kind}", recursive=True)
    paths = {"dataset_path": config.dataset_path, "hf_path": config.hf_path, "hf_data_files": config.hf_data_files}
    remote = dataclasses.replace(config, **{key: value.replace(str(local), f"gs://{BUCKET}/records/{kind}")
                                            for key, value in paths.items() if value.startswith(str(local))})
    assert remote != config
    assert_same_batches(first_batches(remote), first_batches(config))
    copies = sorted(path.name for path in (tmp_path / f"maxpar-{os.getuid()}").rglob("*") if path.is_file())
    assert copies == ([f"part-00{s}.arrayrecord" for s in range(3)] if kind == "arrayrecord" else [])


def test_a_local_copy_is_fetched_once_per_version_of_the_object(gcs, tmp_path):
    """What ArrayRecord reads from: a copy kept while the object is unchanged, fetched again once it is replaced."""
    fs = filesystem(gcs)
    url = f"gs://{BUCKET}/copies/shard.bin"
    fs.pipe(url.removeprefix("gs://"), b"first")
    copy = storage.local_copy(url, cache=tmp_path)
    assert open(copy, "rb").read() == b"first" and storage.local_copy(url, cache=tmp_path) == copy
    fs.pipe(url.removeprefix("gs://"), b"second")
    assert open(storage.local_copy(url, cache=tmp_path), "rb").read() == b"second"
    assert storage.local_copy(str(tmp_path / "x"), cache=tmp_path) == str(tmp_path / "x")


@pytest.mark.slow
def test_convert_reads_and_writes_the_bucket(trained, gcs, tmp_path):
    """to_hf from the trained run's gs:// checkpoint into gs://, from_hf back from gs:// into gs://, and to_hf of
    that with the first export as a gs:// template: the same tensors and config.json, bit for bit."""
    from maxpar.convert.__main__ import main as convert_main
    from maxpar.convert.safetensors_io import HFTensors

    root = f"gs://{BUCKET}/convert"
    assert convert_main(["to_hf", "--checkpoint", f"{RUN}/checkpoints/6", "--out", f"{root}/hf"]) == 0
    assert convert_main(["from_hf", "--hf_path", f"{root}/hf", "--out", f"{root}/back"]) == 0
    assert convert_main(["to_hf", "--checkpoint", f"{root}/back", "--out", str(tmp_path / "again"),
                         "--hf_template", f"{root}/hf"]) == 0  # keeps max_position_embeddings, which from_hf drops
    fs = filesystem(gcs)
    fs.get(f"{BUCKET}/convert/hf", str(tmp_path / "first"), recursive=True)
    assert sorted(p.name for p in (tmp_path / "first").iterdir()) == ["config.json", "model.safetensors",
                                                                      "tokenizer.json", "tokenizer_config.json"]
    assert f"load_parameters_path={root}/back" in fs.cat(f"{BUCKET}/convert/back/overrides.txt").decode()
    first, again = HFTensors(tmp_path / "first"), HFTensors(tmp_path / "again")
    with first, again:
        assert first.names == again.names
        for name in first.names:
            a, b = first.read(name, ()), again.read(name, ())
            assert a.dtype == b.dtype and (a == b).all(), name
    assert (tmp_path / "first" / "config.json").read_text() == (tmp_path / "again" / "config.json").read_text()
    assert not (REPO / "gs:").exists() and not (tmp_path / "gs:").exists()


@pytest.mark.slow
def test_the_bucket_checkpoint_loads_onto_another_mesh(trained, gcs):
    """load_full_state_path and load_parameters_path from gs:// onto FSDP(4)xTP(2), where the run trained on
    FSDP(8): the same values in the new shardings."""
    import jax
    import numpy as np

    from helpers import layout_on, micro_config
    from maxpar.io import checkpoint

    overrides = ("dataset_type=synthetic", "per_device_batch_size=1")
    trained_on = checkpoint.Target.of(*layout_on(micro_config(*overrides)))
    other = checkpoint.Target.of(*layout_on(micro_config(*overrides, "ici_fsdp_parallelism=4",
                                                        "ici_tensor_parallelism=2")))
    expected = checkpoint.load_full_state(f"{RUN}/checkpoints/6", trained_on)
    state = checkpoint.load_full_state(f"{RUN}/checkpoints/6", other)
    params = checkpoint.load_parameters(RUN, other)  # a run directory: its newest step
    assert int(state.step) == STEPS

    def shardings(tree) -> list:
        return [leaf.sharding for leaf in jax.tree.leaves(tree)]

    assert shardings(state.params) == shardings(params) == jax.tree.leaves(other.shardings.params)
    assert shardings(state.params) != shardings(expected.params)  # another mesh indeed
    assert shardings(state.opt_state) == jax.tree.leaves(other.shardings.opt_state)
    for restored, reference in ((state.params, expected.params), (params, expected.params),
                                (state.opt_state, expected.opt_state)):
        assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), restored, reference))


def test_metrics_reach_the_bucket_once_a_minute_at_each_save_and_at_the_end(gcs):
    """Not after every row (each upload copies the whole files): when 60 s have passed since the last upload, when
    the loop asks (a checkpoint save; the clock restarts there) and at close."""
    from maxpar.io.metrics import MetricsWriter

    now = [0.0]
    writer = MetricsWriter(storage.path(f"gs://{BUCKET}/metrics"), enabled=True,
                           upload_policy=storage.UploadPolicy(60.0, clock=lambda: now[0]))
    fs = filesystem(gcs)

    def uploaded() -> list[int]:
        path = f"{BUCKET}/metrics/metrics.jsonl"
        return [row["step"] for row in rows(fs, path)] if fs.exists(path) else []

    def write(step: int, at: float) -> list[int]:
        now[0] = at
        writer.write({"step": step, "loss": 1.0 / step})
        return uploaded()

    assert write(1, 0.0) == [] and write(2, 59.0) == []
    assert write(3, 60.0) == [1, 2, 3]
    assert write(4, 100.0) == [1, 2, 3]
    writer.upload()  # a checkpoint save
    assert uploaded() == [1, 2, 3, 4] and write(5, 150.0) == [1, 2, 3, 4]
    writer.close()  # the end of the run, also on an error
    assert uploaded() == [1, 2, 3, 4, 5]
    assert fs.glob(f"{BUCKET}/metrics/tensorboard/events.out.tfevents.*")


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


# ---------------------------------------------------------------- damage, resume
# A 2-process job on gs:// killed mid-run resumes bitwise from the bucket: tests/test_checkpoint_local.py, whose
# 2-process job keeps its run outputs and persistent tier on this emulator.

@pytest.mark.slow
def test_a_damaged_newest_checkpoint_in_the_bucket_falls_back_and_is_set_aside(trained, gcs, capsys):
    """A copy of the trained run whose step-6 params lost an array object's tail (as a bad copy leaves it): the
    same command resumes from step 3 with the warning a local run prints, sets step 6 aside as STEP.unusable in
    the bucket, drops the bucket's metrics rows after step 3 and logs the uninterrupted losses again, bit for bit."""
    fs = filesystem(gcs)
    run_dir = f"{BUCKET}/runs/damaged"
    fs.copy(f"{BUCKET}/runs/r/checkpoints", f"{run_dir}/checkpoints", recursive=True)
    fs.copy(f"{BUCKET}/runs/r/metrics.jsonl", f"{run_dir}/metrics.jsonl")
    arrays = sorted((p for p in fs.find(f"{run_dir}/checkpoints/6/params") if "/d/" in p), key=fs.size)
    data = fs.cat(arrays[-1])
    fs.pipe(arrays[-1], data[: len(data) // 2])
    command, _, _ = trained
    argv = [word.replace("run_name=r", "run_name=damaged") for word in command[3:]]
    assert "run_name=damaged" in argv
    status = train_main(argv)
    out, err = capsys.readouterr()
    assert status == 0, err[-4000:]
    assert "dropped the rows after step 3" in out, out[-4000:]
    assert (f"checkpoint step 6 in gs://{run_dir}/checkpoints is unusable (" in err
            and "falling back to step 3" in err), err[-4000:]
    assert f"moved unusable checkpoint step 6 aside to gs://{run_dir}/checkpoints/6.unusable" in err, err[-4000:]
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{run_dir}/checkpoints"))
    assert names == ["3", "6", "6.unusable"], names
    assert fs.cat(arrays[-1].replace("/checkpoints/6/", "/checkpoints/6.unusable/")) == data[: len(data) // 2]
    again, uninterrupted = rows(fs, f"{run_dir}/metrics.jsonl"), rows(fs, f"{BUCKET}/runs/r/metrics.jsonl")
    assert [r["step"] for r in again] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in again] == [r["loss"] for r in uninterrupted]  # bitwise: floats from JSON
    assert [r["grad_norm"] for r in again] == [r["grad_norm"] for r in uninterrupted]


def test_tensorstores_credentials_line_goes_to_the_library_log(trained, gcs):
    """TensorStore's C++ 'Using GOOGLE_AUTH_TOKEN_FOR_TESTING' (or its credentials file) is the run's library log's,
    not a line among maxpar's (issue 43)."""
    _, output, _ = trained
    assert "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in output
    assert "Using GOOGLE_AUTH_TOKEN_FOR_TESTING" in filesystem(gcs).cat(f"{BUCKET}/runs/r/libraries.log").decode()



@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_the_emulator_command_serves_generations_until_stopped(stop, tmp_path):
    """`python -m maxpar.tools.emulator` (docs/storage.md): it prints the variable to export, its downloads carry
    the object generation TensorStore's OCDBT reads, and Ctrl-C (or kill) stops it and its server (issue 43)."""
    import urllib.request
    command = [sys.executable, "-m", "maxpar.tools.emulator", "--port", "0", "--bucket", "cli"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = [process.stdout.readline() for _ in range(3)]
        url = next(line.split("=", 1)[1].strip() for line in lines if "export STORAGE_EMULATOR_HOST=" in line)
        upload = urllib.request.Request(f"{url}/upload/storage/v1/b/cli/o?uploadType=media&name=some/object",
                                        data=b"payload", method="POST")
        urllib.request.urlopen(upload).close()
        with urllib.request.urlopen(f"{url}/download/storage/v1/b/cli/o/some%2Fobject?alt=media") as answer:
            assert answer.read() == b"payload" and answer.headers["x-goog-generation"]
        process.send_signal(stop)
        assert process.wait(timeout=30) == 0
    finally:  # a server that outlived the signal must not hold the test (or the worker) forever
        process.kill()
        process.communicate()
    assert storage.check_reachable(url, timeout_s=1) is not None  # the server went with it
