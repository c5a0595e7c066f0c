#!/usr/bin/env bash
# On an air-gapped GPU machine with PyTorch (and transformers) but no vLLM: unpack the offline
# bundle built by scripts/gpu_bundle.py into $SITE, install this plugin beside it, and run
# `vllm-triforce bench gpu` (or, with arguments after `--`, any command in that environment).
#
#   bash scripts/gpu_run.sh [--bundle DIR] [--out DIR] [bench gpu options...]
#   bash scripts/gpu_run.sh --bundle DIR -- python3 -c "import vllm; print(vllm.__version__)"
#
# Defaults: bundle .bundle/; results in /tmp/vllm-bundle/out (a later call on the same
# machine resumes from there) and, when $OUT is set, in $OUT/gpu too; the first run resumes
# from benchmarks/gpu/results.json when present; site /tmp/vllm-bundle/site.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=.bundle
OUT_DIR=/tmp/vllm-bundle/out
SITE=${SITE:-/tmp/vllm-bundle/site}
PYTHON=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE=$2; shift 2 ;;
    --out) OUT_DIR=$2; shift 2 ;;
    *) break ;;
  esac
done

if [ ! -f "$SITE/.bundle-ok" ]; then
  echo "gpu_run: checking and unpacking $BUNDLE into $SITE" >&2
  (cd "$BUNDLE" && sha256sum -c --quiet MANIFEST.sha256)
  mkdir -p "$SITE"
  tar -xJf "$BUNDLE/vllm-python.tar.xz" -C "$SITE"
  tar -xJf "$BUNDLE/vllm-kernels.tar.xz" -C "$SITE"
  touch "$SITE/.bundle-ok"
fi
# Wheels not installed yet (a bundle that gained one since the last unpack adds just it).
NEW_WHEELS=()
for whl in "$BUNDLE"/wheels/*.whl; do
  grep -qxF "$(basename "$whl")" "$SITE/.wheels" 2>/dev/null || NEW_WHEELS+=("$whl")
done
if [ ${#NEW_WHEELS[@]} -gt 0 ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" --upgrade \
    "${NEW_WHEELS[@]}"
  for whl in "${NEW_WHEELS[@]}"; do basename "$whl" >> "$SITE/.wheels"; done
fi
# This plugin from this checkout (patches/ installs as vllm_triforce.patches), with the
# entry-point metadata through which vLLM finds it (vllm.general_plugins).
rm -rf "$SITE/vllm_triforce" "$SITE"/vllm_triforce-*.dist-info
cp -r vllm_triforce "$SITE/vllm_triforce"
cp -r patches "$SITE/vllm_triforce/patches"
DIST="$SITE/vllm_triforce-0.1.0.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm-triforce\nVersion: 0.1.0\n' > "$DIST/METADATA"
printf '[vllm.general_plugins]\ntriforce = vllm_triforce:register\n\n[console_scripts]\nvllm-triforce = vllm_triforce.tools.cli:main\n' \
  > "$DIST/entry_points.txt"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The bundle carries no FlashInfer; vLLM's sampler imports it to ask whether it may use it
# unless told not to (vllm/v1/sample/ops/topk_topp_sampler.py)
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export VLLM_TRIFORCE_COMMIT=${VLLM_TRIFORCE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || true)}
# Run outside the checkout: from its root, Python would import ./vllm_triforce, which has
# no patches/ inside (setup.cfg maps it there only on install).
REPO=$PWD
BUNDLE=$(cd "$BUNDLE" && pwd)
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
cd "$SITE/.."

if [ "${1:-}" = "--" ]; then
  shift
  exec "$@"
fi
RESUME=()
if [ ! -f "$OUT_DIR/results.json" ] && [ -f "$REPO/benchmarks/gpu/results.json" ]; then
  RESUME=(--resume "$REPO/benchmarks/gpu/results.json")
fi
if [ -n "${OUT:-}" ]; then  # kept current job by job, in case the run is cut short
  export VLLM_TRIFORCE_GPU_MIRROR="$OUT/gpu"
fi
"$PYTHON" -m vllm_triforce.tools.cli bench gpu --out "$OUT_DIR" --tokenizer "$BUNDLE/tokenizer" \
  --models "$SITE/../models" "${RESUME[@]}" "$@"
