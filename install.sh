#!/usr/bin/env bash
# Create .venv with the newest JAX this machine can run and install maxpar into it.
#
#   bash install.sh            # maxpar
#   bash install.sh test,hf    # maxpar with extras (comma-separated, as in pyproject.toml)
#   bash install.sh tpu        # with libtpu: compile for TPU topologies on this machine (docs/tpu.md)
#
# Why not plain `python3 -m venv`: JAX 0.12 needs Python >= 3.12, and on an older Python pip quietly
# resolves JAX 0.10, which is ~1.5x slower on simulated multi-device meshes. So this picks Python 3.12
# (the version MaxText also requires), else a newer 3.x, from PATH or pyenv, and only falls back to
# `python3` with a warning. PYTHON=/path/to/python overrides the choice.
set -euo pipefail
cd "$(dirname "$0")"

usable() {  # $1 is a Python >= 3.12 that runs
  "$1" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1
}

find_python() {
  local candidate version
  for candidate in python3.12 python3.13 python3.14; do
    if command -v "$candidate" >/dev/null 2>&1 && usable "$candidate"; then
      command -v "$candidate"; return
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then  # installed by pyenv but not enabled in this shell
    for version in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]\.[0-9]+$' | sort -V); do
      candidate="$(pyenv root)/versions/$version/bin/python3"
      if usable "$candidate"; then echo "$candidate"; return; fi
    done
  fi
  echo "install.sh: warning: no Python >= 3.12 found; using python3 ($(python3 --version 2>&1)), which gets" \
       "JAX 0.10 (slower on multi-device meshes). Install Python 3.12 or set PYTHON=." >&2
  command -v python3
}

check_disk() {  # a clear message now instead of pip's "No space left on device" after the downloads
  [[ -d .venv ]] && return  # reinstalling into an existing .venv needs far less
  local needed_gb=2 why="" free_gb  # a fresh clone's measured peaks (docs/results/install-*.json) plus headroom
  if [[ ",$extras," == *",test,"* ]]; then needed_gb=9 why=" (the test extra's torch comes as its ~5 GB CUDA build)"
  elif [[ ",$extras," == *",tpu,"* ]]; then needed_gb=3 why=" (libtpu is about 640 MB installed)"; fi
  free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
  if (( free_gb < needed_gb )); then
    echo "install.sh: error: ${free_gb} GB free here, and installing${extras:+ with extras '$extras'} takes about" \
         "${needed_gb} GB at its peak${why}. Free some space first." >&2
    exit 1
  fi
}

python="${PYTHON:-$(find_python)}"
extras="${1:-}"
check_disk
echo "install.sh: $("$python" --version 2>&1) from $python -> .venv" >&2
"$python" -m venv .venv
.venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"
.venv/bin/python -c 'import jax, sys; print(f"install.sh: Python {sys.version.split()[0]}, JAX {jax.__version__}", file=sys.stderr)'
