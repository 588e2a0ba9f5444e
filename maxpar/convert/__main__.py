"""`python -m maxpar.convert from_hf|to_hf ...`: Hugging Face checkpoints <-> maxpar checkpoints.

Bad input (no config.json, an unsupported architecture or feature, a model_name or key=value that
disagrees with config.json, tensors that do not match it) is one message and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from maxpar.convert.architectures import ARCHITECTURES
from maxpar.convert.from_hf import convert_from_hf
from maxpar.convert.hf_config import training_overrides
from maxpar.convert.to_hf import DEFAULT_MAX_SHARD_BYTES, convert_to_hf
from maxpar.core import storage
from maxpar.core.config import DTYPES, ConfigError
from maxpar.io import logs


BASE_CONFIG = storage.path(Path(__file__).resolve().parents[2] / "configs" / "base.yml")
OVERRIDES_FILE = "overrides.txt"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m maxpar.convert",
                                     description="Convert Llama/Mistral/Mixtral checkpoints between Hugging Face and maxpar.")
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log_level", choices=("info", "debug"), default="info",
                        help=f"library logs (absl, Orbax, JAX): info = only in {logs.tool_log_path('convert')}; "
                             f"debug = DEBUG records too, also printed here")
    from_hf = commands.add_parser("from_hf", parents=[common],
                                  help="Hugging Face directory -> maxpar checkpoint (load_parameters_path=)")
    from_hf.add_argument("--hf_path", type=storage.path, required=True,
                         help="directory, local or gs://: config.json + *.safetensors")
    from_hf.add_argument("--out", type=storage.path, required=True,
                         help="new directory, local or gs://; the checkpoint is OUT/checkpoints/0")
    from_hf.add_argument("--config", type=storage.path, default=BASE_CONFIG,
                         help="maxpar base config (configs/base.yml)")
    from_hf.add_argument("overrides", nargs="*", metavar="key=value",
                         help="maxpar config overrides: model_name= (checked against config.json), weight_dtype=, "
                              "mesh degrees for the conversion's sharding")
    to_hf = commands.add_parser("to_hf", parents=[common],
                                help="maxpar checkpoint -> Hugging Face directory (from_pretrained)")
    to_hf.add_argument("--checkpoint", required=True, help="RUN/checkpoints/STEP, or a run directory (newest step)")
    to_hf.add_argument("--out", type=storage.path, required=True,
                       help="directory for config.json and *.safetensors, local or gs:// (written locally, then "
                            "uploaded)")
    to_hf.add_argument("--architecture", choices=sorted(ARCHITECTURES),
                       help="default: Qwen3ForCausalLM (Qwen3MoeForCausalLM with experts) for a qk_norm model, "
                            "else MixtralForCausalLM with experts, MistralForCausalLM with a sliding window, "
                            "else LlamaForCausalLM")
    to_hf.add_argument("--dtype", choices=DTYPES, help="tensor dtype (default: the checkpoint's weight_dtype)")
    to_hf.add_argument("--max_shard_size_mb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 2**20,
                       help="largest safetensors file before a new shard starts (MiB)")
    to_hf.add_argument("--hf_template", type=storage.path,
                       help="config.json (or its directory) of the original model: its token ids, "
                            "max_position_embeddings and architecture are kept; its model keys must match")
    to_hf.add_argument("--config", type=storage.path, default=BASE_CONFIG,
                       help="maxpar base config (configs/base.yml)")
    to_hf.add_argument("--tokenizer_path", default=None,
                       help="the tokenizer to write beside the model (default: the checkpoint's tokenizer_path; "
                            "'' = maxpar's byte tokenizer)")
    to_hf.add_argument("--peft", action="store_true",
                       help="a LoRA run's adapters as a PEFT adapter (adapter_config.json, adapter_model.safetensors) "
                            "of the Hugging Face model its base came from (--hf_template: that model's directory, "
                            "recorded as base_model_name_or_path); without it a LoRA run exports merged")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        with logs.library_logs(logs.tool_log_path("convert"), args.log_level, mode="w"):
            _convert(args)
    except ConfigError as e:
        print(f"maxpar.convert: error: {e}", file=sys.stderr)
        return 2
    return 0


def _convert(args: argparse.Namespace) -> None:
    """The conversion the command line asks for; bad input raises ConfigError."""
    if args.command == "from_hf":
        config = convert_from_hf(args.hf_path, args.out, args.overrides, args.config)
        load = f"load_parameters_path={storage.absolute(args.out)}"
        (args.out / OVERRIDES_FILE).write_text("\n".join([load, *training_overrides(config, args.config)]) + "\n",
                                               encoding="utf-8")
        print(f"the checkpoint carries its model ({config.model_name or 'no preset: its own keys'}); train, sample "
              f"or plan from it with load_parameters_path= alone:\n  python -m maxpar.train configs/base.yml {load}\n"
              f"(the model's keys as key=value: {args.out / OVERRIDES_FILE})")
    else:
        convert_to_hf(args.checkpoint, args.out, args.config, architecture=args.architecture, dtype=args.dtype,
                      max_shard_bytes=int(args.max_shard_size_mb * 2**20), template_path=args.hf_template,
                      tokenizer_path=args.tokenizer_path, peft=args.peft)


if __name__ == "__main__":
    sys.exit(main())
