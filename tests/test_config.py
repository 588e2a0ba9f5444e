"""Tests for maxpar.core.config: schema vs base.yml, typed overrides, presets, error messages, the CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from maxpar.core.config import FIELDS, PHYSICAL_AXES, ConfigError, describe_keys, load_config, to_yaml

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
BASE = str(CONFIGS / "base.yml")
# The micro model (configs/models/micro.yml) with 64 tokens and rows of 16.
SHORT = ["model_name=micro", "vocab_size=64", "max_target_length=16"]


def load(*overrides: str, config_file: str = BASE):
    return load_config([config_file, *overrides])


def config_error(*overrides: str, config_file: str = BASE) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, config_file=config_file)
    return str(info.value)


# ---------------------------------------------------------------- base.yml documents the schema

TOP_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*:")


def _base_lines() -> list[str]:
    return (CONFIGS / "base.yml").read_text().splitlines()


def test_base_yml_keys_equal_schema():
    keys = yaml.safe_load((CONFIGS / "base.yml").read_text()).keys()
    line_keys = [m.group(1) for line in _base_lines() if (m := TOP_KEY.match(line))]
    assert sorted(line_keys) == sorted(keys), "line scan and YAML parser disagree on the top-level keys"
    assert len(line_keys) == len(set(line_keys)), "a key is set twice in base.yml"
    assert set(FIELDS) - set(keys) == set(), "schema keys without a default in base.yml"
    assert set(keys) - set(FIELDS) == set(), "base.yml keys outside the schema"


def _undocumented_keys(lines: list[str]) -> list[str]:
    """Top-level keys with neither an inline `#` comment nor a comment above them in the same paragraph
    that names their group (the key's first word, e.g. 'ici' for ici_data_parallelism)."""
    undocumented = []
    for i, line in enumerate(lines):
        m = TOP_KEY.match(line)
        if not m:
            continue
        key = m.group(1)
        if re.search(r"\s#\s*\S", line[m.end():]):
            continue
        above = []
        j = i - 1
        while j >= 0 and lines[j].strip():
            if lines[j].lstrip().startswith("#"):
                above.append(lines[j].lower())
            j -= 1
        group = key.split("_")[0].lower()
        if not any(group in comment for comment in above):
            undocumented.append(key)
    return undocumented


def test_every_base_yml_key_is_commented():
    assert _undocumented_keys(_base_lines()) == []


def test_comment_check_catches_undocumented_keys():
    lines = ["# --- Run", "steps: 3   # optimizer steps", "seed: 0", "", "# --- ici degrees", "ici_data_parallelism: 1",
             "", "dcn_data_parallelism: 1", "warmup_steps: 5 #", "run_name: '#x'"]
    assert _undocumented_keys(lines) == ["seed", "dcn_data_parallelism", "warmup_steps", "run_name"]


def test_schema_docs_are_single_lines():
    described = describe_keys()
    assert [name for name, _, _ in described] == list(FIELDS)
    for name, type_name, doc in described:
        assert doc.strip() and "\n" not in doc, name
        assert type_name


# ---------------------------------------------------------------- loading and typed overrides

def test_base_loads_with_tiny_preset():
    config = load()
    assert config.model_name == "tiny"
    tiny = yaml.safe_load((CONFIGS / "models" / "tiny.yml").read_text())
    for key, value in tiny.items():
        assert getattr(config, key) == value, key
    assert config.mesh_axes == ("data", "stage", "fsdp", "context", "expert", "tensor")
    assert config.axis_rules == config.logical_axis_rules  # no extra rules in base
    assert config.extra_logical_axis_rules == ()
    assert ("embed", ("fsdp", "context", "expert")) in config.logical_axis_rules
    # The dump lists every key and round-trips through YAML.
    assert set(yaml.safe_load(to_yaml(config))) == set(FIELDS)


def test_overrides_are_yaml_typed():
    config = load("steps=7", "learning_rate=1e-3", "scan_layers=false", "logical_axis_rules=[[embed,[fsdp]]]",
                  "mesh_axes=[tensor,data,fsdp,expert,stage,context]", "run_name=abc", "per_device_batch_size=2")
    assert config.steps == 7 and type(config.steps) is int
    assert config.learning_rate == pytest.approx(1e-3) and type(config.learning_rate) is float
    assert config.scan_layers is False
    assert config.logical_axis_rules == (("embed", ("fsdp",)),)
    assert config.axis_rules == (("embed", ("fsdp",)),)
    assert config.mesh_axes == ("tensor", "data", "fsdp", "expert", "stage", "context")
    assert config.run_name == "abc"
    assert config.per_device_batch_size == 2.0 and type(config.per_device_batch_size) is float


def test_rule_with_single_axis_string_and_empty_axes():
    config = load("logical_axis_rules=[[embed,fsdp],[mlp,[]]]")
    assert config.logical_axis_rules == (("embed", ("fsdp",)), ("mlp", ()))


def test_later_override_wins():
    assert load("steps=3", "steps=9").steps == 9


LLAMA = {
    # name: emb_dim, num_query_heads, num_kv_heads, head_dim, mlp_dim, num_decoder_layers, vocab_size, rope_theta
    "llama2-7b": (4096, 32, 32, 128, 11008, 32, 32000, 10000.0),
    "llama2-13b": (5120, 40, 40, 128, 13824, 40, 32000, 10000.0),
    "llama3-8b": (4096, 32, 8, 128, 14336, 32, 128256, 500000.0),
    "llama3-70b": (8192, 64, 8, 128, 28672, 80, 128256, 500000.0),
}


@pytest.mark.parametrize("name", sorted(LLAMA))
def test_model_presets_have_published_llama_dims(name):
    config = load(f"model_name={name}")
    got = (config.emb_dim, config.num_query_heads, config.num_kv_heads, config.head_dim, config.mlp_dim,
           config.num_decoder_layers, config.vocab_size, config.rope_theta)
    assert got == LLAMA[name]
    assert config.num_query_heads * config.head_dim == config.emb_dim
    assert config.logits_via_embedding is False


def test_command_line_beats_model_preset():
    config = load("model_name=llama3-8b", "emb_dim=64", "num_decoder_layers=2")
    assert config.emb_dim == 64 and config.num_decoder_layers == 2
    assert config.mlp_dim == 14336 and config.num_kv_heads == 8  # the rest still from the preset


def test_extending_yaml_beats_model_preset_and_loses_to_command_line(tmp_path):
    child = tmp_path / "child.yml"
    child.write_text(f"base_config: {BASE}\nmodel_name: llama2-7b\nemb_dim: 128\nsteps: 11\n")
    config = load_config([str(child), "steps=12"])
    assert config.model_name == "llama2-7b"
    assert config.emb_dim == 128  # the extending file beats the preset
    assert config.num_query_heads == 32  # the preset beats base.yml
    assert config.steps == 12  # the command line beats the file


@pytest.mark.parametrize("preset, first_rule", [
    ("fsdp_transpose.yml", ("mlp", ("tensor", "fsdp"))),
    ("tp_sequence.yml", ("activation_length", ("tensor",))),
])
def test_strategy_presets_put_their_rule_first(preset, first_rule):
    base = load()
    config = load(config_file=str(CONFIGS / preset))
    assert config.axis_rules[0] == first_rule
    assert config.axis_rules[1:] == base.logical_axis_rules
    assert config.extra_logical_axis_rules == (first_rule,)
    # Everything else is inherited from base.yml.
    assert {k: v for k, v in config.to_dict().items() if k != "extra_logical_axis_rules"} == \
        {k: v for k, v in base.to_dict().items() if k != "extra_logical_axis_rules"}


def test_config_is_frozen():
    config = load()
    with pytest.raises(Exception):
        config.steps = 3  # type: ignore[misc]


# ---------------------------------------------------------------- error paths

def test_unknown_command_line_key_suggests_closest():
    message = config_error("stepz=3")
    assert "'stepz'" in message and "command line" in message and "steps" in message
    message = config_error("learning_rat=0.1")
    assert "learning_rat" in message and "learning_rate" in message


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(f"base_config: {BASE}\nwarmup_step: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config([str(bad)])
    message = str(info.value)
    assert "warmup_step" in message and "bad.yml" in message and "warmup_steps" in message


def test_unknown_key_in_model_preset_names_the_file(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "root.yml").write_text((CONFIGS / "base.yml").read_text().replace("model_name: tiny", "model_name: odd"))
    (tmp_path / "models" / "odd.yml").write_text("emb_dimm: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config([str(tmp_path / "root.yml")])
    assert "emb_dimm" in str(info.value) and "odd.yml" in str(info.value)


@pytest.mark.parametrize("override, expected", [
    ("steps=abc", ["steps", "abc", "int", "str"]),
    ("steps=7.5", ["steps", "7.5", "int", "float"]),
    ("steps=true", ["steps", "True", "int", "bool"]),
    ("scan_layers=1", ["scan_layers", "1", "bool", "int"]),
    ("learning_rate=fast", ["learning_rate", "fast", "float", "str"]),
    ("learning_rate=true", ["learning_rate", "True", "float", "bool"]),
    ("dtype=3", ["dtype", "3", "str", "int"]),
    ("mesh_axes=data", ["mesh_axes", "data", "list of strings"]),
])
def test_wrong_type_names_key_value_and_type(override, expected):
    message = config_error(override)
    for part in expected:
        assert part in message, (part, message)


@pytest.mark.parametrize("override", ["logical_axis_rules=[[activation_batch,[data,fsdp]],[embed,[fsdp]]",
                                      "steps=[1,2", "steps={a", "run_name=@x", "run_name=a\x01b"])
def test_override_that_is_not_yaml_names_key_and_value(override):
    message = config_error(override)
    key = override.split("=")[0]
    assert f"override {override!r}" in message and f"the value of {key} is not valid YAML" in message, message


def test_yaml_file_that_does_not_parse_names_the_file(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text(f"base_config: {BASE}\nsteps: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot parse .*bad.yml"):
        load_config([str(bad)])


@pytest.mark.parametrize("override, bound", [
    ("steps=-1", ">= 0"),
    ("adam_b1=1.5", "<= 1"),
    ("eval_fraction=0.9", "<= 0.5"),
    ("max_target_length=0", ">= 1"),
    ("gradient_accumulation_steps=0", ">= 1"),
    ("ici_fsdp_parallelism=-2", ">= -1"),
    ("eval_interval=-2", ">= -1"),
    ("local_checkpoint_period=0", ">= 1"),
])
def test_out_of_range(override, bound):
    key, value = override.split("=")
    message = config_error(override)
    assert key in message and value in message and bound in message


def test_local_checkpoint_directory_must_be_node_local():
    message = config_error("local_checkpoint_directory=gs://bucket/local")
    assert "local_checkpoint_directory='gs://bucket/local'" in message and "node-local" in message


def test_zero_degree_rejected():
    message = config_error("ici_tensor_parallelism=0")
    assert "ici_tensor_parallelism=0" in message and "-1" in message


def test_zero_slices_rejected_at_parse_time():
    config_error("num_slices=0")


def test_empty_override_is_empty_string():
    assert load("tokenizer_path=").tokenizer_path == ""


@pytest.mark.parametrize("override, allowed", [
    ("dtype=float64", ["float32", "bfloat16", "float16"]),
    ("remat_policy=some", ["none", "minimal", "full"]),
    ("dataset_type=images", ["synthetic", "text"]),
])
def test_bad_choice_lists_allowed_values(override, allowed):
    key, value = override.split("=")
    message = config_error(override)
    assert key in message and value in message
    for choice in allowed:
        assert choice in message


@pytest.mark.parametrize("overrides, named", [
    (["ici_data_parallelism=-1"], ["ici_data_parallelism", "ici_fsdp_parallelism"]),
    (["dcn_fsdp_parallelism=-1"], ["dcn_data_parallelism", "dcn_fsdp_parallelism"]),
])
def test_two_fills_at_one_level(overrides, named):
    message = config_error(*overrides)
    assert "-1" in message
    for name in named:
        assert name in message


def test_one_fill_per_level_is_fine():
    config = load("ici_fsdp_parallelism=-1", "dcn_data_parallelism=-1")
    assert config.ici_fsdp_parallelism == -1 and config.dcn_data_parallelism == -1


@pytest.mark.parametrize("overrides, expected", [
    (["per_device_batch_size=.nan"], ["per_device_batch_size=nan", "finite"]),
    (["learning_rate=.inf"], ["learning_rate=inf", "finite"]),
    (["head_dim=15"], ["head_dim=15", "even"]),
    (["dataset_type=synthetic", "vocab_size=2"], ["vocab_size=2", "synthetic", "> 3"]),
    (["logical_axis_rules=[[activation_batch,[fsdp,fsdp]]]"], ["logical_axis_rules", "fsdp", "twice"]),
])
def test_values_the_model_or_data_cannot_use(overrides, expected):
    message = config_error(*overrides)
    for part in expected:
        assert part in message, (part, message)


def test_query_heads_must_be_multiple_of_kv_heads():
    message = config_error("num_query_heads=6", "num_kv_heads=4")
    assert "num_query_heads=6" in message and "num_kv_heads=4" in message and "multiple" in message
    assert load("num_query_heads=8", "num_kv_heads=4").query_groups == 2


@pytest.mark.parametrize("axes", ["[data,fsdp,tensor]", "[data,fsdp,tensor,expert,pipeline]",
                                  "[data,data,fsdp,tensor,expert]"])
def test_bad_mesh_axes(axes):
    message = config_error(f"mesh_axes={axes}")
    assert "mesh_axes" in message and "permutation" in message
    for axis in PHYSICAL_AXES:
        assert axis in message


def test_rule_naming_unknown_mesh_axis():
    message = config_error("logical_axis_rules=[[embed,[fsdp,model]]]")
    assert "logical_axis_rules" in message and "'model'" in message
    for axis in PHYSICAL_AXES:
        assert axis in message
    message = config_error("extra_logical_axis_rules=[[mlp,[tensr]]]")
    assert "extra_logical_axis_rules" in message and "'tensr'" in message


@pytest.mark.parametrize("rules", ["[embed]", "[[embed,[fsdp],x]]", "[[1,[fsdp]]]", "embed"])
def test_malformed_rules(rules):
    message = config_error(f"logical_axis_rules={rules}")
    assert "logical_axis_rules" in message


def test_unknown_model_name_lists_available():
    message = config_error("model_name=llama9")
    assert "llama9" in message
    for name in ("llama2-7b", "llama2-13b", "llama3-8b", "llama3-70b", "tiny"):
        assert name in message


def test_missing_yaml_file(tmp_path):
    missing = tmp_path / "nope.yml"
    with pytest.raises(ConfigError) as info:
        load_config([str(missing)])
    assert "not found" in str(info.value) and "nope.yml" in str(info.value)


def test_a_run_config_saved_before_a_key_existed_still_loads(tmp_path):
    """A run's config.yml lists the keys of its day; a key added since takes base.yml's default, the rest stay."""
    saved = yaml.safe_load(to_yaml(load("steps=7", "learning_rate=0.002")))
    saved.pop("max_new_tokens")
    (tmp_path / "config.yml").write_text(yaml.safe_dump(saved))
    config = load_config([str(tmp_path / "config.yml"), "model_name="])
    assert (config.steps, config.learning_rate) == (7, 0.002)
    assert config.max_new_tokens == load().max_new_tokens


def test_missing_base_config_parent(tmp_path):
    child = tmp_path / "child.yml"
    child.write_text("base_config: parent_missing.yml\n")
    with pytest.raises(ConfigError) as info:
        load_config([str(child)])
    assert "parent_missing.yml" in str(info.value)


def test_base_config_cycle(tmp_path):
    (tmp_path / "a.yml").write_text("base_config: b.yml\n")
    (tmp_path / "b.yml").write_text("base_config: a.yml\n")
    with pytest.raises(ConfigError) as info:
        load_config([str(tmp_path / "a.yml")])
    assert "cycle" in str(info.value)


def test_override_without_equals():
    message = config_error("steps")
    assert "'steps'" in message and "key=value" in message
    message = config_error("=3")
    assert "key=value" in message


def test_first_argument_must_be_yaml():
    with pytest.raises(ConfigError, match="YAML"):
        load_config(["steps=3"])
    with pytest.raises(ConfigError, match="YAML"):
        load_config([])


def test_dotted_key_rejected_with_suggestion():
    message = config_error("model.emb_dim=3")
    assert "model.emb_dim" in message and "flat" in message and "emb_dim" in message.split("did you mean")[-1]


def test_text_dataset_needs_path():
    message = config_error("dataset_type=text", "dataset_path=''")
    assert "dataset_path" in message


# ---------------------------------------------------------------- CLI: clean errors, exit status 2

def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-m", "maxpar.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def assert_config_error(status: int, stdout: str, stderr: str, expected: list[str]) -> None:
    assert status == 2, stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout
    assert "config error" in stderr
    for part in expected:
        assert part in stderr, (part, stderr)


# Each a command whose config the trainer refuses: (arguments, what its one line must name).
CLI_ERRORS = [
    (["configs/base.yml", "stepz=3"], ["stepz", "steps"]),
    (["configs/base.yml", "steps=abc"], ["steps", "abc", "int"]),
    # Valid as a config; 4 rows per microbatch cannot split over fsdp=8.
    (["configs/base.yml", *SHORT, "per_device_batch_size=0.5", "dataset_type=synthetic", "steps=0"],
     ["per_device_batch_size=0.5", "4 rows", "degree 8"]),
    # Valid as a config; the sequence-parallel preset cannot split 33 tokens over tensor=2.
    (["configs/tp_sequence.yml", *SHORT, "ici_tensor_parallelism=2", "max_target_length=33",
      "dataset_type=synthetic", "steps=0"], ["max_target_length=33", "degree 2"]),
    # Not valid YAML: one bracket missing.
    (["configs/base.yml", "logical_axis_rules=[[activation_batch,[data,fsdp]],[embed,[fsdp]]"],
     ["logical_axis_rules", "not valid YAML"]),
    # An output directory that cannot be created (its parent is a file): refused before any device work.
    (["configs/base.yml", "base_output_directory=configs/base.yml/runs"], ["base_output_directory", "base.yml/runs"]),
    # A tokenizer file that cannot be read as one.
    (["configs/base.yml", *SHORT, "dataset_type=text", "dataset_path=README.md", "tokenizer_path=tests/goldens/shardings.json",
      "steps=0"], ["tokenizer_path", "shardings.json", "could not load"]),
]


@pytest.mark.parametrize("args, expected", CLI_ERRORS)
def test_cli_config_errors_exit_2_without_traceback(args, expected, tmp_path, monkeypatch, capsys):
    """The trainer's `main` (what `python -m maxpar.train` exits with) on this process's 8 simulated devices; a
    traceback would escape it and fail the test. The process itself: `test_a_config_error_ends_the_process_...`."""
    from maxpar.train import main

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))  # as the child had: environ unchanged
    if not any(arg.startswith("base_output_directory=") for arg in args):
        args = [*args, f"base_output_directory={tmp_path}"]  # what a run that gets far enough writes: not in REPO
    status = main(args)
    out = capsys.readouterr()
    assert_config_error(status, out.out, out.err, expected)


@pytest.mark.slow
def test_a_config_error_ends_the_process_with_status_2_and_one_line():
    """`python -m maxpar.train` as a user runs it: valid as a config, only the mesh (8 devices, after JAX started)
    rejects it; exit status 2, the line on stderr, no traceback."""
    result = _cli("configs/base.yml", *SHORT, "ici_tensor_parallelism=3", "ici_fsdp_parallelism=1",
                  "dataset_type=synthetic", "enable_checkpointing=false")
    assert_config_error(result.returncode, result.stdout, result.stderr, ["ici_tensor_parallelism=3", "8"])


# ---------------------------------------------------------------- parsing is pure

@pytest.mark.slow
def test_loading_does_not_import_jax_or_touch_environ():
    script = textwrap.dedent(f"""
        import os, sys
        before = dict(os.environ)
        from maxpar.core.config import load_config, ConfigError
        c = load_config([{BASE!r}, "model_name=llama3-70b", "ici_tensor_parallelism=8", "num_slices=2"])
        try:
            load_config([{BASE!r}, "stepz=1"])
        except ConfigError:
            pass
        assert dict(os.environ) == before, "environment changed"
        bad = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib", "flax")))
        assert not bad, bad
        print("PURE", c.emb_dim)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "PURE 8192" in result.stdout


def test_loading_in_process_leaves_environ_unchanged():
    before = dict(os.environ)
    load("model_name=llama2-13b", "seed=3")
    assert dict(os.environ) == before


# ---------------------------------------------------------------- batch_shape

def _batch_shape(*overrides: str, devices: int):
    from maxpar.core.layout import batch_shape
    return batch_shape(load(*overrides), devices)


@pytest.mark.parametrize("per_device, devices, accumulation, rows, micro", [
    (4, 8, 1, 32, 32),
    (4, 8, 3, 96, 32),
    (1, 1, 1, 1, 1),
    (2, 256, 2, 1024, 512),
    (0.5, 8, 1, 4, 4),
    (0.5, 8, 4, 16, 4),
    (0.25, 16, 1, 4, 4),
    (0.3, 10, 1, 3, 3),
    (0.125, 24, 2, 6, 3),
])
def test_batch_shape(per_device, devices, accumulation, rows, micro):
    shape = _batch_shape(f"per_device_batch_size={per_device}", f"gradient_accumulation_steps={accumulation}",
                         "max_target_length=16", devices=devices)
    assert (shape.global_rows, shape.microbatch_rows, shape.tokens_per_step) == (rows, micro, rows * 16)
    assert type(shape.global_rows) is int and type(shape.microbatch_rows) is int


@pytest.mark.parametrize("per_device, devices", [(0.3, 8), (0.1, 8), (0.5, 1), (0, 8)])
def test_batch_shape_rejects_fractional_rows(per_device, devices):
    with pytest.raises(ConfigError) as info:
        _batch_shape(f"per_device_batch_size={per_device}", devices=devices)
    assert "per_device_batch_size" in str(info.value) and str(devices) in str(info.value)


def test_the_llama3_2_3b_preset_has_the_published_shape():
    """configs/models/llama3.2-3b.yml (the GPU fp8 benchmark's ~3B model): Llama 3.2 3B's config.json dims, its
    input embedding tied to the output, llama3 RoPE scaling."""
    config = load("model_name=llama3.2-3b")
    got = (config.emb_dim, config.num_query_heads, config.num_kv_heads, config.head_dim, config.mlp_dim,
           config.num_decoder_layers, config.vocab_size, config.rope_theta)
    assert got == (3072, 24, 8, 128, 8192, 28, 128256, 500000.0)
    assert config.logits_via_embedding and config.rope_scaling_type == "llama3" and config.rope_scaling_factor == 32


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONFIGS / "models").glob("*.yml")))
def test_every_preset_reads_the_default_data(preset):
    """Every preset trains on the defaults' corpus and tokenizer: its vocabulary holds the tokenizer's (deepseek-tiny
    once had 256 < 259). Opening the data is where a run checks it; no batch is read."""
    from maxpar.io.data.pipeline import open_datasets

    data = open_datasets(load(f"model_name={preset}"), global_rows=1, eval_rows=1, shard_index=0, shard_count=1)
    assert "tokenizer byte-level" in data.description
