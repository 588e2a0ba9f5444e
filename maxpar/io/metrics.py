"""Analytic FLOPs, MFU, parameter counts, and the metrics writers (JSONL, TensorBoard, terminal)."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import jax
from etils import epath

from maxpar.core import storage
from maxpar.core.config import Config
from maxpar.model.mtp import MTP
from maxpar.model.roles import Block, ParamRole, param_role, path_keys

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


def matmul_params(config: Config) -> int:
    """Weights that take part in a matmul per token (the output projection included, even if tied).

    Active parameters only: a mixture-of-experts layer counts its router, the
    num_experts_per_tok experts a token is routed to and its shared experts, not the others.
    Each multi-token prediction module adds its projection [2 emb, emb], one layer like the last (MoE when the
    model has experts) and the output projection.
    """
    e = config.emb_dim
    attention = attention_matmul_params(config)
    mlp = 3 * e * config.mlp_dim
    expert = 3 * e * (config.moe_mlp_dim or config.mlp_dim)  # routed and shared experts alike
    moe = (config.num_experts_per_tok + config.num_shared_experts) * expert + e * config.num_experts
    moe_layers = config.num_moe_layers
    mtp = 2 * e * e + attention + (moe if config.num_experts > 1 else mlp) + e * config.vocab_size
    return (config.num_decoder_layers * attention + (config.num_decoder_layers - moe_layers) * mlp
            + moe_layers * moe + e * config.vocab_size + config.mtp_num_layers * mtp)


def attention_matmul_params(config: Config) -> int:
    """One layer's attention projection weights: GQA's q, k, v and out; MLA's (maxpar/model/mla.py) q (direct or
    through its low rank), kv_a, kv_b and out."""
    e, h = config.emb_dim, config.num_query_heads
    if config.attention_type != "mla":
        return e * config.head_dim * (2 * h + 2 * config.num_kv_heads)
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    query = config.q_lora_rank * (e + h * qk) if config.q_lora_rank else e * h * qk
    return (query + e * (config.kv_lora_rank + config.qk_rope_head_dim)
            + config.kv_lora_rank * h * (config.qk_nope_head_dim + config.v_head_dim) + h * config.v_head_dim * e)


def attention_head_widths(config: Config) -> tuple[int, int]:
    """(q/k width, v width) of one head: head_dim twice, or MLA's qk_nope + qk_rope and v_head_dim."""
    if config.attention_type == "mla":
        return config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    return config.head_dim, config.head_dim


def attended_keys_per_query(config: Config) -> float:
    """Keys a query attends to on average: seq/2 for causal attention (the lower triangle); with a
    sliding window w < seq, w - w^2 / (2 seq) (the triangle's band of width w)."""
    seq, window = config.max_target_length, config.sliding_window
    if window <= 0 or window >= seq:
        return seq / 2
    return window - window * window / (2 * seq)


def training_flops_per_token(config: Config) -> float:
    """Forward + backward FLOPs per token: 6 * matmul params + causal attention.

    Attention scores (QK^T) and the weighted sum (PV) cost 2 * (q/k width + v width) FLOPs per
    query head per attended key. Causal attention is counted once: with seq/2 keys per query
    this is half of PaLM's 12*L*H*D*T term (less with a sliding window).
    Backward is twice forward, hence the factor 3 on both terms.
    """
    widths = sum(attention_head_widths(config))
    per_layer_attention = 2 * attended_keys_per_query(config) * config.num_query_heads * widths
    layers = config.num_decoder_layers + config.mtp_num_layers  # each MTP module attends like a layer
    return 6 * matmul_params(config) + 3 * layers * per_layer_attention


def parameter_counts(abstract_params: Any, experts_per_token: int = 1) -> dict[str, int]:
    """Total, embedding and active parameter counts of an (abstract) parameter tree.

    Active: what one token uses; of each MoE layer's experts only
    `experts_per_token` count (all of a dense model's parameters are active). `mtp` and `mtp_active`: the part of
    total and active in the multi-token prediction modules, which published model sizes leave out.
    """
    total, embedding, inactive, mtp, mtp_inactive = 0, 0, 0, 0, 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params):
        size = math.prod(leaf.shape)
        keys = path_keys(path)
        in_mtp = MTP in keys
        total += size
        mtp += size if in_mtp else 0
        role = param_role(keys)
        if role is ParamRole.EMBEDDING:
            embedding += size
        if role is not None and role.block is Block.EXPERTS:  # [..., experts, in, out]
            experts = leaf.shape[-3]
            unused = size // experts * (experts - experts_per_token)
            inactive += unused
            mtp_inactive += unused if in_mtp else 0
    return {"total": total, "embedding": embedding, "non_embedding": total - embedding, "active": total - inactive,
            "mtp": mtp, "mtp_active": mtp - mtp_inactive}


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
