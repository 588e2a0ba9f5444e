#!/usr/bin/env bash
# Benchmark the parallelism strategies on simulated CPU devices; args go to maxpar.tools.bench.
cd "$(dirname "$0")/.." && exec python -m maxpar.tools.bench "$@"
