"""What a run says about itself, as pure functions of its config and state: the header's model line (the preset and
what was overridden, quantization), the data line of a single text file (its held-out tail), record shards given to
dataset_type=text, the summary's checkpoint line and a second Ctrl-C's line."""

from __future__ import annotations

import json

import pytest

from helpers import micro_config
from maxpar.core.config import ConfigError, load_config
from maxpar.io.data.pipeline import corpus, describe_documents, make_datasets
from maxpar.io.data.text import tail_start
from maxpar.train import describe_computation, describe_model
from maxpar.training.guards import second_interrupt_words
from maxpar.training.summary import no_checkpoint_words


def config(*overrides: str):
    return load_config(["configs/base.yml", *overrides])


def test_the_model_line_names_the_preset_and_what_was_overridden():
    assert describe_model(config()) == "tiny"
    assert describe_model(config("model_name=tiny", "vocab_size=512")) == "tiny"  # the preset's own value
    assert (describe_model(config("emb_dim=512", "num_decoder_layers=6"))
            == "tiny (overridden: emb_dim=512, num_decoder_layers=6)")
    assert (describe_model(config("model_name=qwen3-0.6b", "logits_via_embedding=false"))
            == "qwen3-0.6b (overridden: logits_via_embedding=false)")
    assert describe_model(config("model_name=")) == "custom, as tiny"  # a saved or imported config: every key given
    assert describe_model(config("model_name=", "emb_dim=100")) == "custom"


def test_the_model_line_shows_quantization_when_there_is_some():
    assert describe_computation(config()) == ""
    assert describe_computation(config("quantization=fp8")) == ", quantization=fp8, fp8_scaling=current"
    assert (describe_computation(config("quantization=fp8", "fp8_scaling=delayed"))
            == ", quantization=fp8, fp8_scaling=delayed")


def test_record_shards_under_dataset_type_text_are_refused_in_one_line(tmp_path):
    (tmp_path / "part-0.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ConfigError, match=r"matches jsonl record shards .* dataset_type=grain grain_file_type=jsonl"):
        corpus(micro_config("dataset_type=text", f"dataset_path={tmp_path}/*.jsonl"))


def test_a_single_text_file_holds_out_its_tail_for_eval(tmp_path):
    text = "".join(f"line {i}\n" for i in range(100))
    (tmp_path / "input.txt").write_text(text)
    run = micro_config("dataset_type=text", f"dataset_path={tmp_path}/input.txt", "eval_fraction=0.1")
    train, held_out = corpus(run)
    assert (len(train), len(held_out)) == (1, 1) and train[0] + held_out[0] == text
    assert held_out[0].startswith("line 9") and abs(len(held_out[0]) / len(text) - 0.1) < 0.02
    assert describe_documents(run, train, held_out) == (f"text file {tmp_path}/input.txt: its first 90% for "
                                                        f"training, its last 10% (from a line start) for eval")
    whole = micro_config("dataset_type=text", f"dataset_path={tmp_path}/input.txt", "eval_fraction=0")
    assert [len(part) for part in corpus(whole)] == [1, 0] and corpus(whole)[0][0] == text


def test_a_single_long_text_file_gives_each_row_of_a_batch_its_own_text(tmp_path):
    """A single file is read as chunks of whole lines: as one document every lane (row) read the same stream."""
    text = "".join(f"line {i}: {'abcdefghij' * (i % 7)}\n" for i in range(6000))
    (tmp_path / "input.txt").write_text(text)
    run = micro_config("dataset_type=text", f"dataset_path={tmp_path}/input.txt", "eval_fraction=0.1")
    train, held_out = corpus(run)
    assert len(train) > 8 and len(held_out) > 1 and "".join([*train, *held_out]) == text
    assert all(chunk.endswith("\n") for chunk in train)
    train_data, _ = make_datasets(run, global_rows=8, eval_rows=8, shard_index=0, shard_count=1)
    batch = next(iter(train_data))["inputs"]
    assert len({row.tobytes() for row in batch}) == len(batch)
    assert tail_start("no newline at all", 0.5) == 8


def test_the_summary_says_why_there_is_no_checkpoint():
    assert no_checkpoint_words(checkpointing=False, trained=5) == "none (enable_checkpointing=false)"
    assert no_checkpoint_words(checkpointing=True, trained=0) == "none (no step was trained, so none was saved)"


def test_a_second_ctrl_c_names_the_checkpoint_a_rerun_resumes_from_or_that_there_is_none():
    assert "checkpoint step 8 is intact" in second_interrupt_words(True, 8)
    none_yet = second_interrupt_words(True, None)
    assert "before any checkpoint was complete" in none_yet and "starts from the beginning" in none_yet
    assert "intact" not in none_yet
    assert "nothing was saved (enable_checkpointing=false)" in second_interrupt_words(False, None)
