"""Input throughput: tokens/s of every data source alone (no model) next to the training step's tokens/s.

    python end_to_end/data_throughput.py [--batches 1000] [--steps 12] [key=value ...]

Writes the default corpus (the standard library's `*.py` files, real text) as each source's format in
a temporary directory: text files as they are, JSONL, Parquet and ArrayRecord shards (dataset_type=
grain), a `dataset_mixture` of the JSONL shards and the text files by tokens (0.7 / 0.3), synthetic
tokens, and with the `hf` extra a `save_to_disk` dataset and the `json` builder over the JSONL shards
(dataset_type=hf). For each it builds this process's datasets exactly as the trainer does
(`maxpar.io.data.pipeline.make_datasets`: tokenize, pack into lanes, shuffle) and times `--batches`
global batches after the first. Then it trains the default model (`configs/base.yml` plus the
overrides) for `--steps` steps and takes the median step. PASS when every source delivers tokens at
least 2x as fast as the step consumes them (input is not the bottleneck), else FAIL. The load average
is printed beside the figures: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from preamble import prepare  # end_to_end/preamble.py: this script's folder is sys.path[0]
from verdict import exit_with

REPO = prepare(devices=None)
from maxpar.tools import records  # noqa: E402
HEADROOM = 2.0
SHARD_COUNT = 8


def write_sources(documents: list[str], directory: Path) -> dict[str, list[str]]:
    """The corpus in every format; returns each source's overrides (the hf ones only with `datasets` installed)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    shards = [documents[i::SHARD_COUNT] for i in range(SHARD_COUNT)]
    for kind in ("jsonl", "parquet", "arrayrecord"):
        (directory / kind).mkdir()
    for s, texts in enumerate(shards):
        records = [json.dumps({"text": t}) for t in texts]
        (directory / "jsonl" / f"part-{s}.jsonl").write_text("".join(r + "\n" for r in records))
        pq.write_table(pa.table({"text": texts}), directory / "parquet" / f"part-{s}.parquet", row_group_size=16)
        writer = ArrayRecordWriter(str(directory / "arrayrecord" / f"part-{s}.arrayrecord"), "group_size:1")
        for record in records:
            writer.write(record.encode())
        writer.close()
    grain = ["dataset_type=grain", "dataset_text_field=text"]
    sources = {
        "text files": ["dataset_type=text"],
        "grain jsonl": [*grain, "grain_file_type=jsonl", f"dataset_path={directory}/jsonl/*.jsonl"],
        "grain parquet": [*grain, "grain_file_type=parquet", f"dataset_path={directory}/parquet/*.parquet"],
        "grain arrayrecord": [*grain, "grain_file_type=arrayrecord",
                              f"dataset_path={directory}/arrayrecord/*.arrayrecord"],
        "mixture (jsonl 0.7, text files 0.3)": [
            f"dataset_mixture=[{{name: jsonl, weight: 0.7, dataset_type: grain, grain_file_type: jsonl, "
            f"dataset_path: '{directory}/jsonl/*.jsonl'}}, {{name: text, weight: 0.3, dataset_type: text}}]"],
        "synthetic": ["dataset_type=synthetic"],
    }
    try:
        import datasets
    except ImportError:
        print("hf rows skipped: the `datasets` package is missing (pip install -e '.[hf]')")
        return sources
    datasets.Dataset.from_dict({"text": documents}).save_to_disk(str(directory / "hf"))
    return {**sources, "hf save_to_disk": ["dataset_type=hf", f"hf_path={directory}/hf"],
            "hf json builder": ["dataset_type=hf", "hf_path=json", f"hf_data_files={directory}/jsonl/*.jsonl"]}


def source_tokens_per_s(config, rows: int, batches: int) -> tuple[float, float]:
    """(tokens/s over `batches` global batches after the first, seconds to open the source and build the first)."""
    from maxpar.io.data.pipeline import make_datasets

    start = time.perf_counter()
    iterator = iter(make_datasets(config, global_rows=rows, eval_rows=rows, shard_index=0, shard_count=1)[0])
    next(iterator)
    opened = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * rows * config.max_target_length / (time.perf_counter() - start), opened


def main() -> int:
    load_start = records.load_average()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=1000,
                        help="global batches timed per source (1000 x 2,048 tokens: ~40%% of the default corpus)")
    parser.add_argument("--steps", type=int, default=12, help="training steps (the first two are not timed)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every source and the run")
    records.add_record_option(parser)
    args = parser.parse_args()
    import jax

    from maxpar.core.config import load_config
    from maxpar.io.data.text import read_text, resolve_files
    from maxpar.train import train

    base = [str(REPO / "configs" / "base.yml"), *args.overrides]
    config = load_config(base)
    documents = [read_text(path) for path in resolve_files(config.dataset_path)]
    rows = round(config.per_device_batch_size * jax.device_count()) * config.gradient_accumulation_steps
    print(f"corpus: {len(documents)} documents, {sum(map(len, documents)) / 1e6:.1f} MB ({config.dataset_path}); "
          f"global batch {rows} x {config.max_target_length} tokens", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        sources = write_sources(documents, Path(tmp))
        figures = {name: source_tokens_per_s(load_config([*base, *extra]), rows, args.batches)
                   for name, extra in sources.items()}
        run_dir = Path(tmp) / "run"
        train(load_config([*base, f"steps={args.steps}", "eval_interval=0", "enable_checkpointing=false"]),
              run_dir=run_dir)
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_rate = statistics.median(r["tokens_per_s"] for r in steps if r["step"] > 2)
    load = os.getloadavg()
    print(f"\n| source | tokens/s | x the training step | open + first batch |\n|---|---|---|---|")
    for name, (rate, opened) in figures.items():
        print(f"| {name} | {rate:,.0f} | {rate / step_rate:.1f}x | {opened:.2f} s |")
    print(f"| training step ({jax.device_count()} {jax.devices()[0].platform} device(s), median of steps 3-"
          f"{args.steps}) | {step_rate:,.0f} | 1.0x | |")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.record:
        rows = [{"source": name, "tokens_per_s": rate, "x_step": rate / step_rate, "open_s": opened}
                for name, (rate, opened) in figures.items()]
        rows.append({"source": "training step", "tokens_per_s": step_rate, "x_step": 1.0})
        print("record:", records.write_record(args.record, "data_throughput",
                                              ["python", "end_to_end/data_throughput.py", *sys.argv[1:]],
                                              {"rows": rows}, load_start))
    slow = [name for name, (rate, _) in figures.items() if rate < HEADROOM * step_rate]
    if slow:
        print(f"FAIL: input slower than {HEADROOM}x the step's consumption: {', '.join(slow)}")
        return 1
    print(f"PASS: every source delivers >= {HEADROOM}x the tokens the training step consumes")
    return 0


if __name__ == "__main__":
    exit_with(main)
