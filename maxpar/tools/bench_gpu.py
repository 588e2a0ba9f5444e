"""The GPU benchmark's levers: `python -m maxpar.tools.bench --gpu` times one setting per row.

The model is configs/models/llama-1b.yml (~1B parameters: 16 layers, emb 2048, 16 heads x 128,
SwiGLU 5632) at sequence 2048 in bf16 on one device, synthetic data. A *setting* is `base` or a
comma-joined list of levers: any config key (`remat_policy=full`, `per_device_batch_size=8`,
`attention=cudnn_flash_causal`, `scan_layers=false`, ...) and `xla=NAME[+NAME]`, which adds the
named XLA flag sets below to XLA_FLAGS of that row's process (XLA reads its flags once, at start).
Every flag here exists in jaxlib 0.10.2 (XLA aborts at start-up on an unknown flag; a test checks).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence

from maxpar.core.config import FIELDS

# Named XLA flag sets for the `xla=` lever (references: JAX "GPU performance tips" and NVIDIA
# JAX-Toolbox "GPU performance" pages).
XLA_FLAG_SETS: dict[str, tuple[str, ...]] = {
    # Latency-hiding scheduler: orders the program so async work overlaps compute. NVIDIA's JAX
    # container turns it on by default; on one GPU there are no collectives, so expect little.
    "lhs": ("--xla_gpu_enable_latency_hiding_scheduler=true",),
    # cuBLAS/cuBLASLt for every GEMM instead of Triton-generated (possibly fused) GEMMs.
    "cublas": ("--xla_gpu_enable_triton_gemm=false",),
    # The opposite: let Triton emit any GEMM it supports (autotuned against cuBLAS).
    "triton_any": ("--xla_gpu_triton_gemm_any=true",),
}

# The run every lever changes one thing of (the sweep reads as "base, then one lever at a time").
BASE = dict(model_name="llama-1b", max_target_length=2048, per_device_batch_size=4, dtype="bfloat16",
            weight_dtype="float32", attention="dot_product", remat_policy="none", scan_layers=True,
            dataset_type="synthetic", enable_checkpointing=False, eval_interval=-1, ici_fsdp_parallelism=1)

# `--smoke`: the same code path with a model a CPU runs in seconds (exercises the sweep, measures nothing).
SMOKE = dict(num_decoder_layers=2, emb_dim=128, num_query_heads=4, num_kv_heads=4, head_dim=32, mlp_dim=352,
             vocab_size=512, max_target_length=128, per_device_batch_size=2)

DEFAULT_SETTINGS = (
    "base",
    "remat_policy=minimal",
    "remat_policy=full",
    "attention=xla",
    "attention=cudnn_flash",
    "attention=cudnn_flash_causal",
    "scan_layers=false",
    "xla=lhs",
    "xla=cublas",
    "xla=triton_any",
    "per_device_batch_size=8,remat_policy=minimal",
    "per_device_batch_size=8,attention=cudnn_flash_causal",
    "per_device_batch_size=8,attention=cudnn_flash_causal,remat_policy=minimal,xla=cublas",
    "per_device_batch_size=16,attention=cudnn_flash_causal,remat_policy=full",
    # fp8 projections and MLP (maxpar/model/fp8.py): against `base`, and with the best-guess levers above.
    "quantization=fp8",
    "quantization=fp8,per_device_batch_size=8,attention=cudnn_flash_causal,remat_policy=minimal,xla=cublas",
)

# Let XLA take most of the GPU's memory (JAX preallocates 75% by default); a user's value wins.
MEMORY_FRACTION = "0.92"


def parse_setting(setting: str) -> tuple[list[str], list[str]]:
    """`a=1,xla=lhs+cublas` -> (config overrides ['a=1'], flag-set names ['lhs', 'cublas'])."""
    if setting.strip() == "base":
        return [], []
    overrides, flag_sets = [], []
    for item in setting.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not key or not value:
            raise ValueError(f"setting {setting!r}: {item!r} is not key=value (or use 'base')")
        if key == "xla":
            unknown = [n for n in value.split("+") if n not in XLA_FLAG_SETS]
            if unknown:
                raise ValueError(f"setting {setting!r}: unknown XLA flag set {unknown[0]!r}; "
                                 f"known: {', '.join(XLA_FLAG_SETS)}")
            flag_sets += value.split("+")
        elif key not in FIELDS:
            raise ValueError(f"setting {setting!r}: {key!r} is neither a config key nor xla")
        else:
            overrides.append(f"{key}={value}")
    return overrides, flag_sets


def setting_overrides(setting: str, smoke: bool) -> list[str]:
    """key=value list of one row: the base run, the smoke shape if asked, then the setting's levers."""
    base = {**BASE, **(SMOKE if smoke else {})}
    values = [f"{key}={json.dumps(v)}" for key, v in base.items()]
    return values + parse_setting(setting)[0]


def xla_flags(flag_sets: Sequence[str]) -> tuple[str, ...]:
    """The flags of the named sets, in order, without repeats."""
    return tuple(dict.fromkeys(flag for name in flag_sets for flag in XLA_FLAG_SETS[name]))


def setting_env(setting: str, environ: dict[str, str]) -> dict[str, str]:
    """The row's environment: the caller's, its XLA flag sets appended, and a larger GPU memory fraction."""
    env = dict(environ)
    flags = " ".join([env.get("XLA_FLAGS", ""), *xla_flags(parse_setting(setting)[1])]).strip()
    if flags:
        env["XLA_FLAGS"] = re.sub(r"\s+", " ", flags)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEMORY_FRACTION)
    return env


def describe_gpu_run(smoke: bool) -> str:
    """The fixed part of every row, for the table's header line."""
    base = {**BASE, **(SMOKE if smoke else {})}
    model = "smoke-test shape (measures nothing)" if smoke else "llama-1b"
    return (f"{model}, seq {base['max_target_length']}, {base['per_device_batch_size']} rows/device unless the "
            f"setting says otherwise, dtype {base['dtype']}, weights {base['weight_dtype']}, synthetic data, one device")


# ---------------------------------------------------------------- fp8 GEMMs in a program (quantization=fp8)

FP8_GEMM = "__cublas$lt$matmul$f8"  # the custom call XLA's GPU GEMM rewriter makes of a dot on fp8 operands
# A StableHLO dot's operand types: `stablehlo.dot_general %a, %b, ... : (tensor<2x3xf8E4M3FN>, tensor<...>) -> ...`
_STABLEHLO_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<(?:[0-9]+x)*(\w+)>, tensor<(?:[0-9]+x)*(\w+)>\)")
# An optimized-HLO instruction: `%name = f8e4m3fn[...]{...} op(...)`, and a dot's operand names.
_HLO_DEFINITION = re.compile(r"%([\w.\-]+) = (\w+)\[")
_HLO_DOT = re.compile(r"= \w+\[[^\]]*\][^ ]* dot\(%([\w.\-]+), %([\w.\-]+)\)")


def dot_operand_types(stablehlo: str) -> Counter:
    """(lhs, rhs) element types of every dot_general of a lowered program (`jax.jit(f).lower(...).as_text()`)."""
    return Counter(match.groups() for line in stablehlo.splitlines() if (match := _STABLEHLO_DOT.search(line)))


def f8_dots(stablehlo: str) -> int:
    """Dots on fp8 operands in a lowered program: 3 per quantized matmul (maxpar.model.fp8.fp8_product)."""
    return sum(n for types, n in dot_operand_types(stablehlo).items() if any(t.startswith("f8") for t in types))


def fp8_gemms(hlo: str) -> int:
    """cuBLASLt fp8 GEMM calls in a compiled program's text (`compiled.as_text()`)."""
    return hlo.count(FP8_GEMM)


def unrewritten_f8_dots(hlo: str) -> int:
    """Dots of a compiled program (fusions' included) that still take an fp8 operand: ones XLA did not make
    cuBLASLt fp8 GEMMs (a Triton GEMM, or XLA:CPU's), which run at the bf16 rate or below."""
    types = dict(_HLO_DEFINITION.findall(hlo))
    return sum(1 for line in hlo.splitlines() if (match := _HLO_DOT.search(line))
               and any(types.get(name, "").startswith("f8") for name in match.groups()))


def fp8_counts(stablehlo: str, hlo: str) -> dict[str, int]:
    """What became of a quantized step's fp8 dots: in the lowered program, as cuBLASLt fp8 GEMMs, and left as
    dots on fp8 operands after compilation."""
    return {"f8_dots_lowered": f8_dots(stablehlo), "fp8_gemms": fp8_gemms(hlo),
            "f8_dots_unrewritten": unrewritten_f8_dots(hlo)}
