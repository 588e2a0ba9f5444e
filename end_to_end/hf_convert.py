"""Regression: a 125M-parameter Llama goes Hugging Face -> maxpar -> Hugging Face, exactly, with transformers' logits.

    python end_to_end/hf_convert.py [--layers 12] [--emb 768] [--keep DIR]

1. transformers builds a random LlamaForCausalLM (GQA 12/4 heads, vocab 32000) and saves it in
   bfloat16, sharded into 100 MB safetensors files;
2. `python -m maxpar.convert from_hf` (its own process, 8 simulated CPU devices, FSDP(8)) writes the
   maxpar checkpoint; wall time and the process's peak resident memory are printed;
3. maxpar's float32 logits of the converted checkpoint under FSDP(4)xTP(2) must match transformers'
   float32 logits of the original within --atol;
4. `python -m maxpar.convert to_hf --dtype bfloat16` (its own process) must give back every tensor
   bit for bit; wall time and peak memory are printed.

Prints the figures and a final PASS/FAIL line; exits non-zero on FAIL.
"""

from __future__ import annotations

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]

REPO = prepare(devices=8)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from test_convert import hf_logits, maxpar_logits, read_all  # noqa: E402

# Runs the converter's CLI and reports the process's own peak RSS (VmHWM, KiB) on its last line. Not
# getrusage's ru_maxrss: Linux carries the forking parent's peak into it across exec.
MEASURED = ("import re, runpy, sys\n"
            "sys.argv = ['maxpar.convert', *sys.argv[1:]]\n"
            "status = 0\n"
            "try:\n    runpy.run_module('maxpar.convert', run_name='__main__')\n"
            "except SystemExit as e:\n    status = e.code\n"
            "print('PEAK_RSS_KIB', re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read())[1])\n"
            "sys.exit(status)\n")


def measured_convert(*args: str) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one `python -m maxpar.convert ...` in its own process."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", MEASURED, *args], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"maxpar.convert {args[0]} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    peak = int(re.findall(r"PEAK_RSS_KIB (\d+)", result.stdout)[-1]) / 1024
    return seconds, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--emb", type=int, default=768)
    parser.add_argument("--atol", type=float, default=2e-4)
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temporary one)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="hf_convert_"))
    work.mkdir(parents=True, exist_ok=True)
    hf_dir, maxpar_dir, back_dir = work / "hf", work / "maxpar", work / "back"

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.emb, intermediate_size=args.emb * 8 // 3 // 64 * 64,
                         num_hidden_layers=args.layers, num_attention_heads=args.emb // 64,
                         num_key_value_heads=args.emb // 192, vocab_size=32000, rms_norm_eps=1e-5)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))  # off the init, so that every tensor shapes the logits
    model.save_pretrained(hf_dir, max_shard_size="100MB")
    count = sum(p.numel() for p in model.parameters())
    files = sorted(hf_dir.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files) / 2**20
    print(f"model: LlamaForCausalLM, {count / 1e6:.1f} M parameters, {args.layers} layers, emb {args.emb}, "
          f"bfloat16 in {len(files)} safetensors files ({size:.0f} MiB); float32 = {count * 4 / 2**20:.0f} MiB")
    del model

    from_s, from_peak = measured_convert("from_hf", "--hf_path", str(hf_dir), "--out", str(maxpar_dir))
    print(f"from_hf: {from_s:.1f} s, peak RSS {from_peak:.0f} MiB (8 simulated devices hold the float32 model)")

    tokens = np.random.default_rng(0).integers(0, 32000, size=(8, 32)).astype(np.int32)
    ours = maxpar_logits(maxpar_dir, tokens, jax.devices(), "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    theirs = hf_logits(hf_dir, tokens)
    logits_error = float(np.abs(ours - theirs).max())
    print(f"logits: max |maxpar FSDP(4)xTP(2) - transformers| = {logits_error:.2e} (max |logit| "
          f"{np.abs(theirs).max():.2f}; --atol {args.atol})")

    to_s, to_peak = measured_convert("to_hf", "--checkpoint", str(maxpar_dir), "--out", str(back_dir),
                                     "--dtype", "bfloat16", "--max_shard_size_mb", "100", "--hf_template", str(hf_dir))
    print(f"to_hf: {to_s:.1f} s, peak RSS {to_peak:.0f} MiB")
    original, back = read_all(hf_dir), read_all(back_dir)
    different = sorted(name for name in original if name not in back or not np.array_equal(original[name], back[name]))
    extra = sorted(set(back) - set(original))
    original_config, back_config = (json.loads((d / "config.json").read_text()) for d in (hf_dir, back_dir))
    same_config = all(back_config.get(key) == value for key, value in original_config.items())
    print(f"round trip: {len(original) - len(different)}/{len(original)} tensors bit-identical, {len(extra)} extra; "
          f"config.json keeps every original key: {same_config}")

    ok = logits_error <= args.atol and not different and not extra and same_config
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
