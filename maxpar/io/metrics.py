"""Throughput and MFU (the model's FLOPs per token: `maxpar.model.arithmetic`), and the metrics writers (JSONL,
TensorBoard, terminal)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from etils import epath

from maxpar.core import storage
from maxpar.core.config import Config
from maxpar.model.arithmetic import training_flops_per_token

# Peak dense bf16 FLOP/s per device (no sparsity), from the vendors' spec sheets.
# Matched against jax's device_kind; the longest matching key wins.
PEAK_BF16_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,   # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,        # v5p reports itself as "TPU v5"
    "TPU v6 lite": 918e12,   # v6e (Trillium)
    "TPU v6e": 918e12,
    "TPU7x": 1153.5e12,      # Ironwood: 2307 TFLOP/s per chip, whose two TensorCores are two devices
    "A100": 312e12,
    "H100": 989e12,          # SXM
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
}

METRIC_KEYS = ("step", "loss", "eval_loss", "learning_rate", "grad_norm", "step_time_s", "tokens_per_s",
               "tokens_per_s_per_device", "tflops_per_device", "mfu",
               # mixture of experts (null for a dense model; maxpar/training/train_step.py moe_metrics)
               "moe_load_balance_loss", "moe_dropped_tokens", "moe_dropped_fraction",
               "moe_load_max_over_mean", "moe_load_max_over_mean_worst",
               # multi-token prediction (null without it): the MTP modules' mean cross-entropy
               "mtp_loss",
               # z_loss_weight > 0 (null otherwise): the mean (log Z)^2 of the logits (maxpar/training/train_step.py)
               "z_loss",
               # the updates skipped so far in the run, by cause (maxpar/training/guards.py judge_step)
               "skipped_nonfinite", "skipped_spikes")
PER_SOURCE = ("tokens/", "eval_loss/")  # a dataset_mixture's figures per source: tokens/NAME, eval_loss/NAME
# use_dpo's reward figures (maxpar/training/dpo.py metrics), in training and on the held-out pairs: only in its rows
DPO_KEYS = ("dpo_", "eval_dpo_")


def peak_flops(device_kind: str, configured: float = 0.0) -> float | None:
    """Peak FLOP/s of one device: the configured value, else the table, else None (unknown)."""
    if configured > 0:
        return configured
    matches = [key for key in PEAK_BF16_FLOPS if key.lower() in device_kind.lower()]
    return PEAK_BF16_FLOPS[max(matches, key=len)] if matches else None


def throughput(config: Config, *, tokens_per_step: int, step_time_s: float, num_devices: int,
               peak: float | None) -> dict[str, float | None]:
    tokens_per_s = tokens_per_step / step_time_s
    tflops = tokens_per_s * training_flops_per_token(config) / num_devices / 1e12
    return {
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": tokens_per_s / num_devices,
        "tflops_per_device": tflops,
        "mfu": tflops * 1e12 / peak if peak else None,
    }


class MetricsWriter:
    """metrics.jsonl (one object per logged step) and TensorBoard events; process 0 only.

    Both are appended to local files: in the run directory, or, for a run on an object store, in a
    `storage.LocalMirror` (objects cannot be appended to), copied up as `upload_policy` allows, whenever the
    loop calls `upload` (at each checkpoint save: the rows a resume keeps) and at `close`.
    """

    def __init__(self, run_dir: epath.Path, enabled: bool, upload_policy: storage.UploadPolicy | None = None):
        self.enabled = enabled
        if not enabled:
            return
        if not storage.is_remote(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
        self._policy = upload_policy or storage.UploadPolicy()
        self._mirror = storage.LocalMirror(run_dir, names=["metrics.jsonl"])
        self._jsonl = open(self._mirror.directory / "metrics.jsonl", "a", encoding="utf-8")
        self._tensorboard = _summary_writer_class()(str(self._mirror.directory / "tensorboard"))

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {**{key: row.get(key) for key in METRIC_KEYS},
                  **{key: value for key, value in row.items() if key.startswith(PER_SOURCE + DPO_KEYS)}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if key != "step" and value is not None:
                self._tensorboard.add_scalar(key, value, row["step"])
        self._tensorboard.flush()
        if self._policy.due():
            self.upload()

    def upload(self) -> None:
        """Copy the files up now (a no-op for a local run). A failed upload (the storage unreachable after gcsfs's
        own retries, or refusing connections) is a warning: the files stay in the local mirror and the next upload
        copies them whole, so the run never stops for its metrics."""
        if not self.enabled:
            return
        try:
            self._mirror.sync()
        except OSError as e:
            print(f"maxpar: warning: metrics upload to {self._mirror.target} failed ({storage.describe_error(e)}); "
                  f"the rows are kept in {self._mirror.directory} and go up with the next upload", file=sys.stderr,
                  flush=True)
            return
        self._policy.uploaded()

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            self._tensorboard.close()
            self._mirror.close()


def _summary_writer_class() -> type:
    """tensorboardX's SummaryWriter, loaded without torch.

    tensorboardX imports torch whenever it is installed, only to accept torch tensors (maxpar logs floats);
    that import costs seconds and hundreds of MB of every training process's memory. A torch the process
    already holds is used as is.
    """
    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # makes tensorboardX's guarded `import torch` raise ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def rewind_metrics(path: epath.Path, step: int) -> int:
    """Drop metrics.jsonl rows after `step`, the step the run (re)starts from; returns how many.

    Rows logged after the restored checkpoint are logged again by the resumed run, so without
    this the file would hold them twice. A half-written last line (a kill mid-write) goes too.
    """
    if not path.exists():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if _row_step(line) is not None and _row_step(line) <= step]
    if len(kept) == len(lines):
        return 0
    text = "".join(line + "\n" for line in kept)
    if storage.is_remote(path):  # an object is replaced whole by one upload
        path.write_text(text, encoding="utf-8")
    else:
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    return len(lines) - len(kept)


def _row_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
