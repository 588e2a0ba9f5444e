#!/usr/bin/env bash
# The folder end_to_end/bench_gpu_fp8.py takes to a GPU machine that reaches no package registry (docs/benchmarks.md):
# the wheels its image lacks, for maxpar (grain, omegaconf, tensorboardX) and for MaxText (the extras a CPU run of it
# needs, less what the image has), plus MaxText itself.
#
#     end_to_end/gpu_bundle.sh [DIR]        # default .gpu_bundle (git-ignored): about 23 MiB of wheels
#
# The image: Python 3.12 on x86-64 Linux, JAX 0.11 with CUDA, flax, optax, orbax-checkpoint, chex, jaxtyping,
# transformers, sentencepiece, tiktoken and more (the device tool's KINDS.md lists them). The wheels are fetched for
# that Python and platform whatever this machine's are (`pip download --only-binary`), each pinned and without its
# dependencies: the list is the whole closure the image lacks. MaxText is its published source distribution
# (maxtext on PyPI is a pure-Python wheel of its src/ tree); MAXTEXT_GIT=<git dir>[@rev] packs that checkout's
# src/maxtext instead. The script installs the folder on the GPU machine itself (pip --no-index --target).
set -euo pipefail

dir=${1:-.gpu_bundle}
python=${PYTHON:-python3}
mkdir -p "$dir/wheels"

platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
fetch() {
  "$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$dir/wheels" "$@"
}

# maxpar's imports the image lacks.
fetch grain==0.2.18 array_record==0.8.6 omegaconf==2.4.0 tensorboardX==2.6.5
# MaxText's (0.2.5) imports the image lacks, with their own (found by importing its trainer in a venv of the image's
# packages). tokamax 0.0.12: later ones import xprof (a 32 MB wheel needing 50 MB more) when MaxText imports them.
fetch pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
      ml_collections==1.1.0 aqtp==0.9.0 qwix==0.1.8 pathwaysutils==0.1.13 tokamax==0.0.12 typeguard==2.13.3 drjax==0.2.1 \
      einshape==1.0 immutabledict==4.3.1 portpicker==1.6.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
      opentelemetry-api==1.45.2

rm -rf "$dir/maxtext"
if [[ -n "${MAXTEXT_GIT:-}" ]]; then
  git_dir=${MAXTEXT_GIT%@*} rev=HEAD
  [[ "$MAXTEXT_GIT" == *@* ]] && rev=${MAXTEXT_GIT##*@}
  mkdir -p "$dir/maxtext"
  git --git-dir="$git_dir" archive "$rev" src/maxtext | tar -x -C "$dir/maxtext" --strip-components=1
  rm -f "$dir"/wheels/maxtext-*.whl
else
  fetch maxtext==0.2.5
fi
carry="'$dir/wheels'"
[[ -d "$dir/maxtext" ]] && carry="$carry, '$dir/maxtext'"
du -sh "$dir/wheels"
echo "bundle ready: $dir (to the GPU machine: run(..., carry=[$carry]))"
