"""Hugging Face interop: `python -m maxpar.convert from_hf|to_hf` (see docs/huggingface.md).

architectures.py  the tables: config.json keys and tensors of each supported architecture
hf_config.py      config.json <-> maxpar config, unsupported features, override conflicts
tensor_blocks.py  one maxpar parameter <-> its HF tensors (slices, nn.Linear transposes)
safetensors_io.py reading slices of, and writing shards of, safetensors checkpoints
from_hf.py        HF checkpoint -> sharded arrays -> maxpar Orbax checkpoint
to_hf.py          maxpar Orbax checkpoint -> config.json + safetensors
tokenizer_files.py the export's tokenizer files (the byte tokenizer as a tokenizer.json)
"""
