"""Training on a dataset_mixture: exact resume (every source's position comes back with the checkpoint), per-source
figures in metrics.jsonl and the summary, new phases. A kill -9 of a real process resumes from its newest complete
checkpoint whatever the data (tests/test_checkpoint_preemption.py, tests/test_records.py), and the checkpoint keeps
the mixture's state as the JSON of its get_state(): the exact resume here shows that state complete."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from helpers import read_metrics, micro_config
from maxpar.train import train
from test_mixture import mixture

COMMON = ("eval_fraction=0.2", "enable_checkpointing=true", "checkpoint_period=4", "learning_rate_final_fraction=1.0",
          "per_device_batch_size=2")


def test_a_mixture_resumes_exactly_logs_per_source_and_starts_a_phase_on_new_weights(tmp_path, capsys):
    """8 steps in one go equal 4 steps, a checkpoint and 4 more: losses, eval losses and tokens per source. Then a
    resume with other weights says so and counts on from where every source stopped (the new shares themselves,
    which show over more tokens than this, are test_mixture.py's)."""
    config = micro_config(mixture(tmp_path), "steps=8", "eval_interval=4", "eval_steps=1", *COMMON)
    train(config, devices=jax.devices()[:2], run_dir=tmp_path / "whole")
    train(dataclasses.replace(config, steps=4), devices=jax.devices()[:2], run_dir=tmp_path / "halves")
    train(config, devices=jax.devices()[:2], run_dir=tmp_path / "halves")
    whole, halves = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "halves")
    assert [r["step"] for r in halves] == list(range(1, 9))
    for key in ("loss", "eval_loss", "tokens/short", "tokens/long", "eval_loss/short", "eval_loss/long"):
        assert [r.get(key) for r in halves] == [r.get(key) for r in whole], key
    last = whole[-1]
    assert 0.95 <= (last["tokens/short"] + last["tokens/long"]) / (8 * 4 * config.max_target_length) <= 1
    assert [r["tokens/long"] for r in whole] == sorted(r["tokens/long"] for r in whole)
    evals = [r for r in whole if r["eval_loss"] is not None]
    assert [r["step"] for r in evals] == [4, 8]
    for r in evals:
        assert r["eval_loss"] == pytest.approx(0.7 * r["eval_loss/short"] + 0.3 * r["eval_loss/long"])
    events = b"".join(path.read_bytes() for path in (tmp_path / "whole" / "tensorboard").glob("events.*"))
    assert all(tag in events for tag in (b"tokens/short", b"tokens/long", b"eval_loss/short", b"eval_loss/long"))
    out = capsys.readouterr().out
    assert "data mixture by tokens of 2 sources: short (weight 0.7)" in out
    assert f"per source: short {last['tokens/short']:,} tokens" in out and "eval loss" in out.split("per source:")[-1]

    train(micro_config(mixture(tmp_path, short=0.9, long=0.1), "steps=16", "eval_interval=-1", *COMMON),
          devices=jax.devices()[:2], run_dir=tmp_path / "whole")
    out = capsys.readouterr().out
    assert "resumed from checkpoint at step 8" in out
    assert "data mixture: new phase, weights short 0.7, long 0.3 -> short 0.9, long 0.1" in out
    later = read_metrics(tmp_path / "whole")[-1]
    gained = [later[f"tokens/{name}"] - last[f"tokens/{name}"] for name in ("short", "long")]
    assert min(gained) >= 0 and sum(gained) >= 0.95 * 8 * 4 * config.max_target_length  # counted on, not afresh
