#!/usr/bin/env bash
# Set up (idempotent) and run the demo: TriForce against plain vLLM on a long Moby-Dick
# prompt. Extra arguments go to `vllm-triforce demo` (try --help, --three-level).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/vllm-triforce demo "$@"
