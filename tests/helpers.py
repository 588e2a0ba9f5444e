"""Shared test fixtures: tiny configs and a small text corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from maxpar.config import Config, load_config

TINY = ["emb_dim=64", "num_query_heads=4", "num_kv_heads=2", "head_dim=16", "mlp_dim=128",
        "num_decoder_layers=2", "vocab_size=264", "max_target_length=32", "dtype=float32",
        "weight_dtype=float32", "warmup_steps=2", "learning_rate=1e-2", "log_period=1", "eval_interval=-1",
        "enable_checkpointing=false"]


def tiny_config(*overrides: str, config_file: str = "configs/base.yml") -> Config:
    return load_config([config_file, *TINY, *overrides])


def write_corpus(directory: Path, num_files: int = 12, seed: int = 0) -> str:
    """Small English-like documents of varied length; returns a glob for dataset_path."""
    rng = np.random.default_rng(seed)
    words = "the model learns to predict the next byte of text while data flows across the mesh".split()
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(num_files):
        text = " ".join(rng.choice(words, size=int(rng.integers(5, 80))))
        (directory / f"doc_{i:02d}.txt").write_text(f"document {i}: {text}\n")
    return str(directory / "*.txt")


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
