#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels tools/gpu/check.sh installs on a device machine
# (which has no network): into .whl/ (ignored by git; the `run` tool's carry takes it along).
#
#   tools/gpu/fetch_wheels.sh                    # -> .whl/ for CPython 3.12 manylinux x86-64
#   PY_VERSIONS="3.11 3.12" tools/gpu/fetch_wheels.sh
#
# What the device image lacks (it has torch with CUDA, transformers, accelerate, lightning,
# pytest, numpy): pydantic and its dependencies (this package needs pydantic>=2), and for the
# side-by-side benchmark DeepSpeed 0.19.8, built here as a wheel with DS_BUILD_OPS=0 (no ops
# compiled; pure Python + op sources for JIT), with its runtime requirements that the image
# may lack: hjson, ninja, py-cpuinfo, msgpack, einops (and psutil, tqdm, packaging, which
# both packages need). Binary wheels (pydantic-core, msgpack, psutil, ninja) are fetched for
# every version in PY_VERSIONS, so an image whose Python is not 3.12 still finds a match
# (check.sh says clearly when none does). .whl/manifest.txt lists the names check.sh installs.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${WHEEL_DIR:-$REPO/.whl}"
PYTHON="${PYTHON:-python3}"
PY_VERSIONS="${PY_VERSIONS:-3.12 3.10 3.11 3.13}"
PLATFORM="${PLATFORM:-manylinux2014_x86_64}"
DS_SPEC="deepspeed==0.19.8"
# Everything but deepspeed: installed (no dependency resolution on the device) from this list.
DEPS=(pydantic hjson ninja py-cpuinfo msgpack einops psutil tqdm packaging)

mkdir -p "$DEST"
PIP=("$PYTHON" -m pip --disable-pip-version-check)
for version in $PY_VERSIONS; do
  echo "[fetch_wheels] ${DEPS[*]} for CPython $version $PLATFORM"
  "${PIP[@]}" download -q --only-binary=:all: --python-version "$version" --implementation cp \
    --platform "$PLATFORM" -d "$DEST" "${DEPS[@]}"
done
if ! ls "$DEST"/deepspeed-0.19.8-*.whl >/dev/null 2>&1; then
  echo "[fetch_wheels] building $DS_SPEC wheel with DS_BUILD_OPS=0"
  DS_BUILD_OPS=0 "${PIP[@]}" wheel -q --no-deps -w "$DEST" "$DS_SPEC"
fi
# The names to install, from the wheel files (pydantic's own dependencies included).
ls "$DEST"/*.whl | sed -E 's#.*/##; s#-[0-9].*##' | grep -v '^deepspeed$' | sort -u > "$DEST/manifest.txt"
echo "[fetch_wheels] $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST:"
sed 's/^/  /' "$DEST/manifest.txt"
ls "$DEST"/deepspeed-*.whl
