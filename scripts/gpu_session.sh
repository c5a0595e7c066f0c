#!/usr/bin/env bash
# The GPU check of one lease on an air-gapped GPU machine (benchmarks/gpu/README.md), in
# three back-to-back calls, each carrying one part (at most 64 MiB a call):
#
#   bash scripts/gpu_session.sh unpack           # carry .bundle: vLLM unpacked, nothing run
#                                                # (about 30 s), for the calls that carry a
#                                                # model part instead
#   bash scripts/gpu_session.sh costs [SECONDS]  # carry .bundle: vLLM unpacked, the 8B cost
#                                                # cases not measured yet (vLLM defaults,
#                                                # TriForce, TriForce's settings)
#   bash scripts/gpu_session.sh model-a          # carry .carry/a: SmolLM2 part a
#   bash scripts/gpu_session.sh real [SECONDS] [graphs|fused]  # carry .carry/b: part b,
#                                                # conversion checked against the CPU's, the
#                                                # real-model run ("graphs": with round graphs
#                                                # on; "fused": and selection graphs), then
#                                                # the cost jobs still missing; carrying
#                                                # nothing, it resumes the run a call before
#                                                # it left (each engine's part kept in /tmp)
#   bash scripts/gpu_session.sh host-rounds [SECONDS] [graphs]  # carry .bundle: host ms
#                                                # per middle round at batch 8-128 with the
#                                                # tiny model, with "graphs" as CUDA graphs,
#                                                # the selection compiled and a round's
#                                                # re-selection and load one graph
#                                                # (benchmarks/explore/host_per_round.py)
#   bash scripts/gpu_session.sh kv-kept [SECONDS]  # carry .bundle: the KV cache TriForce
#                                                # keeps (compact summaries, prefill_from_cache,
#                                                # at gpu_memory_utilization 0.9) against
#                                                # plain vLLM's at the same settings
#                                                # (kv-plain), and the tokens with
#                                                # prefill_from_cache on
#   bash scripts/gpu_session.sh mrv2 [SECONDS]    # carry .bundle: TriForce in Model Runner
#                                                # V2 (VLLM_TRIFORCE_MRV2=1, experimental):
#                                                # tokens against plain vLLM's, drafts verified;
#                                                # then requests growing past the budget
#                                                # (plain steps found on the host first)
#   bash scripts/gpu_session.sh mrv2-first [SECONDS]  # carry .bundle: the first look at
#                                                # MRV2 in one short call: greedy tokens
#                                                # (TRITON_ATTN fp32, two levels) and
#                                                # sampled output with its negative control
#   bash scripts/gpu_session.sh sampled [SECONDS] # carry .bundle: sampled output (temperature
#                                                # 1) against plain vLLM's distribution, on
#                                                # V1 and MRV2 (sync and async), each beside
#                                                # a negative control that must be caught
#   bash scripts/gpu_session.sh mrv2-full [SECONDS]  # carry .bundle: TriForce on vLLM's
#                                                # defaults (MRV2, FULL_AND_PIECEWISE, async):
#                                                # tokens against plain vLLM's defaults, then
#                                                # the 8B step at depths 0 and 6
#   bash scripts/gpu_session.sh windows [SECONDS] # carry .bundle: a target with sliding-
#                                                # window layers beside full ones (Gemma 2's
#                                                # and gpt-oss's pattern), two levels against
#                                                # plain vLLM, FLASH_ATTN bf16, TRITON_ATTN fp32,
#                                                # with round_graphs first, then without
#   bash scripts/gpu_session.sh tax [SECONDS]     # carry .bundle: where the tax of
#                                                # TriForce's settings goes: plain vLLM at
#                                                # the 8B shape with vLLM's defaults, one
#                                                # setting changed at a time (V2+FULL+sync,
#                                                # V2+PIECEWISE+sync, V1+FULL+async), and
#                                                # TriForce's settings; then a spec-decode
#                                                # engine's 1+K-token FULL step (tax-*)
#   bash scripts/gpu_session.sh round-graphs [SECONDS] [PARTS]  # carry .bundle: the middle
#                                                # passes' CUDA graphs against today's path
#                                                # (a), their cost at the 8B width (b) and at
#                                                # SmolLM2's shape (c), (a)'s two levels on
#                                                # TRITON_ATTN fp32 (t); PARTS a,b by default
#                                                # (benchmarks/explore/gpu_round_graph.py)
#   bash scripts/gpu_session.sh hot-path [SECONDS]  # carry .bundle: the hot path's device
#                                                # work at Llama-3.1-8B's shape (8 x 32K,
#                                                # 32 layers), coded summaries, the block
#                                                # scores eager and compiled
#                                                # (benchmarks/explore/cuda_hot_path.py)
#
# Results go to $OUT (gpu/ of bench gpu; demo.json, demo.log of the real-model run) as
# each part completes. Parts: scripts/gpu_bundle.py (.bundle), scripts/gpu_model_carry.py
# split (.carry).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-session-out}
mkdir -p "$OUT"
export VLLM_TRIFORCE_CACHE=/tmp/vt-cache
step=${1:?unpack, costs, kv-kept, mrv2-first, mrv2, sampled, mrv2-full, windows, tax, model-a, real, host-rounds, round-graphs or hot-path}
budget=${2:-270}
case "$step" in
  costs)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    bash scripts/gpu_run.sh --only kernels,costs --budget-s "$budget" 2>&1 \
      | grep -v " INFO \| DEBUG "
    ;;
  kv-kept)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    bash scripts/gpu_run.sh --budget-s "$budget" --only \
      kernels,kv-plain,kv-kept,exact-flash-bf16-plain,exact-flash-bf16-fromcache \
      2>&1 | grep -v " INFO \| DEBUG "
    ;;
  mrv2)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    bash scripts/gpu_run.sh --budget-s "$budget" --only \
      kernels,exact-flash-bf16-plain,exact-flash-bf16-2L-mrv2,exact-flash-bf16-3L-mrv2,exact-triton-fp32-plain,exact-triton-fp32-2L-mrv2,exact-triton-fp32-3L-mrv2,exact-triton-fp32-grow-plain,exact-triton-fp32-grow-2L-mrv2,exact-triton-fp32-grow-2L \
      2>&1 | grep -v " INFO \| DEBUG "
    ;;
  windows)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    bash scripts/gpu_run.sh --budget-s "$budget" --only \
      kernels,exact-flash-bf16-window-plain,exact-flash-bf16-window-2L-graphs,exact-flash-bf16-window-2L,exact-triton-fp32-window-plain,exact-triton-fp32-window-2L-graphs,exact-triton-fp32-window-2L \
      2>&1 | grep -v " INFO \| DEBUG "
    ;;
  mrv2-first)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    bash scripts/gpu_run.sh --budget-s "$budget" --only \
      kernels,exact-triton-fp32-plain,exact-triton-fp32-2L-mrv2,sample-triton-fp32-plain,sample-triton-fp32-2L-mrv2,sample-triton-fp32-2L-mrv2-wrong \
      2>&1 | grep -v " INFO \| DEBUG "
    ;;
  sampled)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    bash scripts/gpu_run.sh --budget-s "$budget" --only \
      kernels,sample-triton-fp32-plain,sample-triton-fp32-2L-mrv2,sample-triton-fp32-2L-mrv2-wrong,sample-triton-fp32-2L-mrv2-async,sample-triton-fp32-2L,sample-triton-fp32-2L-wrong,sample-triton-fp32-2L-compiled \
      2>&1 | grep -v " INFO \| DEBUG "
    ;;
  mrv2-full)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    bash scripts/gpu_run.sh --budget-s "$budget" --only \
      kernels,exact-flash-bf16-grow-defaults-plain,exact-flash-bf16-grow-2L-mrv2-full,costs-triforce-mrv2 \
      2>&1 | grep -v " INFO \| DEBUG "
    ;;
  tax)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    bash scripts/gpu_run.sh --budget-s "$budget" --only kernels,tax 2>&1 \
      | grep -v " INFO \| DEBUG "
    ;;
  hot-path)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    timeout "$budget" bash scripts/gpu_run.sh -- python3 "$PWD/benchmarks/explore/cuda_hot_path.py" \
      --coded --json "$OUT/hot_path.json" 2>&1 | grep -v " INFO \| DEBUG \|WARNING"
    ;;
  host-rounds)
    # a third argument "graphs": the middle passes as CUDA graphs (`round_graphs`), the
    # selection compiled (`compiled_selection`) and a round's re-selection and load one
    # graph (`selection_graphs`)
    timeout "$budget" bash scripts/gpu_run.sh -- python3 "$PWD/benchmarks/explore/host_per_round.py" \
      --configs 2:0 30:1 ${3:+--round-graphs --compiled-selection --selection-graphs} \
      --out "$OUT/host_per_round" 2>&1 \
      | grep -v " INFO \| DEBUG \|WARNING"
    ;;
  round-graphs)
    # the script's own budget leaves the bundle's unpack (about 25 s) and a margin; the
    # tokenizer from the carried bundle, or from the unpack of an earlier call
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    tokenizer=$PWD/.bundle/tokenizer
    [ -d "$tokenizer" ] || tokenizer=/tmp/vllm-bundle/tokenizer
    timeout "$budget" bash scripts/gpu_run.sh -- python3 "$PWD/benchmarks/explore/gpu_round_graph.py" \
      --parts "${3:-a,b}" --budget-s $((budget - 40)) --tokenizer "$tokenizer" \
      --out "$OUT/round_graph" 2>&1 | grep -v " INFO \| DEBUG \|WARNING"
    ;;
  unpack)
    # vLLM from the carried bundle into /tmp, and its tokenizer beside it, for the calls
    # after this one on the same machine (model-a, real, round-graphs without .bundle)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    bash scripts/gpu_run.sh -- python3 -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
      || exit 1
    mkdir -p /tmp/vllm-bundle && cp -r .bundle/tokenizer /tmp/vllm-bundle/
    ;;
  model-a)
    python3 scripts/gpu_model_carry.py assemble --carry .carry/a
    ;;
  real)
    start=$SECONDS
    # a call that carries no .carry/b resumes the run of the call before it on this machine
    # (the conversion and each engine's finished part stay in /tmp: --state-dir)
    if [ -d .carry/b ]; then
      python3 scripts/gpu_model_carry.py assemble --carry .carry/b || exit 1
    fi
    # the tensors must equal the CPU conversion's; the tokenizer files differ between the
    # GPU image's transformers and the CPU's (seen on every lease), so they may
    python3 scripts/gpu_model_carry.py convert --allow-file-differences || exit 1
    # a third argument "graphs": the demo with TriForce's round graphs on (`--round-graphs`)
    # and its selection compiled (`--compiled-selection`); "fused": and a round's
    # re-selection and load as one graph (`--selection-graphs`)
    fused=""
    [ "$3" = fused ] && fused="--selection-graphs"
    # the engines one after another, each one's results kept in /tmp as its part ends, so
    # that a call its cap stops leaves the next call (the same command, no carry) to go on
    # from the engine it stopped in; the demo stops 20 s before the cap, its results and
    # the logs come back
    cap=$((budget - (SECONDS - start) - 20))
    [ "$cap" -gt 60 ] || { echo "real: ${cap} s left of ${budget}, too few for the demo"; exit 1; }
    timeout "$cap" bash scripts/gpu_run.sh -- \
      python3 -m vllm_triforce.tools.cli demo --device cuda --state-dir /tmp/vt-demo-state \
      --out "$OUT/demo.json" --log "$OUT/vllm.log" --eager-check \
      ${3:+--round-graphs --compiled-selection} $fused > "$OUT/demo.log" 2>&1
    echo "demo: exit $?"
    ls -l /tmp/vt-demo-state
    grep -v " INFO \| DEBUG \|WARNING\|^\s*$\|Loading\|it/s\]" "$OUT/demo.log" | tail -40
    left=$((budget - (SECONDS - start)))
    if [ "$left" -gt 100 ]; then
      bash scripts/gpu_run.sh --only costs-plain-forced,costs-plain-defaults,costs-triforce \
        --cases 8x32K,1x128K --budget-s "$left" 2>&1 | grep -v " INFO \| DEBUG "
    fi
    ;;
esac
