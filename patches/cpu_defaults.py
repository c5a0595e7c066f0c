"""CPU defaults a user expects: a KV cache that fits, and a word when bf16 is emulated.

Upstream (vLLM 0.32.0, `v1/worker/cpu_worker.py`, `CPUWorker.__init__` and
`determine_available_memory`): without `VLLM_CPU_KVCACHE_SPACE` or
`--kv-cache-memory-bytes`, the CPU worker reserves `--gpu-memory-utilization`
(0.92) of the *total* memory of its NUMA node and refuses to start when that much
is not free ("Available memory on node 0 ... is less than desired CPU memory
utilization"). On a machine where other processes hold a few GiB, or whose
node 0 is a fraction of the RAM, `vllm serve MODEL` therefore fails out of the box,
even for a 135M model.

What this patch does, in `CpuPlatform.check_and_update_config` (`platforms/cpu.py`,
the one hook every CPU engine passes through while its config can still change: it
runs in the process that builds the `VllmConfig` -- the `vllm serve` front end or
the `LLM(...)` process -- and the config, KV size included, is then handed to the
engine core and every worker):

1. When the user chose no KV size -- no `VLLM_CPU_KVCACHE_SPACE` (which vLLM turns
   into `cache_config.kv_cache_memory_bytes` in that same method), no
   `--kv-cache-memory-bytes`, `--gpu-memory-utilization` left at its default -- it
   sets `kv_cache_memory_bytes` by the rule in `kv_cache_bytes()` -- for a TriForce
   engine, plus the reservation its memory plan makes (engine/shape.py
   `EngineShape.memory_plan`; `kv_reservation` takes it back out, so the KV cache
   itself keeps the rule's size) -- and logs the size and how it was reached
   ("vllm.triforce" logger). An explicit choice is never touched.
2. When the model runs in bfloat16 on a CPU without native bf16 (no AVX512-BF16 or
   AMX; `torch.ops.mkldnn._is_mkldnn_bf16_supported()`, the check `bench` uses),
   it warns once, naming `--dtype float32`.

Why a patch: the CPU platform's config hook is the only place the KV size can be
decided before the worker checks memory; no config option means "size it for me
without reserving a fraction of the node". Setting the config field (rather than
the `VLLM_CPU_KVCACHE_SPACE` environment variable) keeps byte precision (the
variable is whole GiB), reaches Ray and `mp` workers with the pickled config, and
leaks into no child process a user starts later. Inert on other platforms (only
`CpuPlatform` is wrapped).
"""

import os

from vllm.logger import init_logger

from vllm_triforce.engine.shape import EngineShape, requested_backend
from vllm_triforce.patches import _util

logger = init_logger("vllm.triforce")

NAME = "cpu_defaults"
TARGET = ("vllm.platforms.cpu", "CpuPlatform.check_and_update_config")
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
FREE_FRACTION = 0.5  # of the node's free memory, at most, for the KV caches of all ranks
GiB = 1 << 30
MiB = 1 << 20


def apply() -> None:
    _util.wrap(*TARGET, _make_wrapper, NAME)


def _make_wrapper(original):
    def check_and_update_config(cls, vllm_config):
        original.__func__(cls, vllm_config)  # reads VLLM_CPU_KVCACHE_SPACE first
        if vllm_config.model_config is None:
            return
        warn_if_bf16_emulated(vllm_config.model_config)
        choose_kv_cache_size(vllm_config)

    return check_and_update_config


# ------------------------------------------------------------------ KV-cache size

def kv_cache_bytes(bytes_per_token: int, max_model_len: int, max_num_seqs: int,
                   free_bytes: int, num_ranks: int = 1, block_size: int = 1) -> tuple[int, str]:
    """Per-rank KV-cache bytes when the user chose none, and which bound decided it.

    size = max(min(demand, cap), one_request), demand and one_request rounded up and cap
    down to whole MiB (a full-length request that vLLM finds 1 MiB short will not start;
    token counts in whole blocks of `block_size`), where

    - demand = max_num_seqs x max_model_len x bytes_per_token: every sequence the
      scheduler may run at once, each at full length. The scheduler can never use
      more, so allocating more only takes memory from other processes (and the CPU
      backend touches every page of its cache at start-up).
    - cap = FREE_FRACTION x free memory of the NUMA node / num_ranks: leaves the
      other half for the weights, activations, the front end and whatever else runs
      on the machine. Free memory, not total (vLLM's fraction rule), is what makes it
      start on a busy or NUMA-split machine; half keeps a second server startable.
    - one_request = max_model_len x bytes_per_token: below it vLLM refuses to start
      ("max_model_len ... larger than the maximum number of tokens in the KV
      cache"); asking for it instead lets vLLM's own memory check name the shortfall.

    Free memory is read where the config is built (the front end), i.e. on the node
    the workers use on one machine; CPU workers on other hosts (Ray) want an explicit
    VLLM_CPU_KVCACHE_SPACE.

    Example (SmolLM2-135M, float32: 30 layers x 3 KV heads x 64 x 2 (K, V) x 4 B =
    45 KiB/token; `vllm serve` defaults to 128 sequences; 8192-token context; 7.7 GiB
    free): demand 45 GiB, cap 3.85 GiB -> 3.85 GiB, room for ~87K tokens.
    """
    tokens = -(-max_model_len // block_size) * block_size  # a request holds whole blocks
    null_block = block_size  # vLLM's block pool keeps block 0 as the never-allocated null block
    demand = (max_num_seqs * tokens + null_block) * bytes_per_token
    cap = int(FREE_FRACTION * free_bytes / max(num_ranks, 1)) // MiB * MiB
    one_request = (tokens + null_block) * bytes_per_token
    size, bound = (_mib_up(demand), "demand") if demand <= cap else (cap, "free memory")
    if size < one_request:
        size, bound = _mib_up(one_request), "one full-length request"
    return max(size, MiB), bound


def _mib_up(n: int) -> int:
    """Round up to whole MiB: a size the rule must reach is never rounded below it."""
    return -(-n // MiB) * MiB


def choose_kv_cache_size(vllm_config) -> int | None:
    """Set `cache_config.kv_cache_memory_bytes` unless the user chose a size; returns it."""
    cache = vllm_config.cache_config
    if user_chose_kv_size(cache):
        return None
    per_token = kv_bytes_per_token(vllm_config)
    free, node = node_free_memory()
    max_model_len = vllm_config.model_config.max_model_len
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    ranks = vllm_config.parallel_config.world_size
    size, bound = kv_cache_bytes(per_token, max_model_len, max_num_seqs, free, ranks,
                                 cache.block_size or 1)
    shape = EngineShape.of(vllm_config)
    if shape is not None:  # TriForce reserves its buffers out of this (kv_reservation)
        plan = shape.memory_plan(per_token * shape.block_size,
                                 requested_backend(vllm_config))
        size = plan.available_for(size)
    cache.kv_cache_memory_bytes = size
    logger.info(
        "CPU KV cache: %s not set, using %.2f GiB per rank (%s bound: %d seqs x %d tokens x "
        "%.1f KiB/token = %.2f GiB wanted, at most %.0f%% of the %.2f GiB free on NUMA node "
        "%d / %d rank(s)). Set %s=<GiB> or --kv-cache-memory-bytes to choose.",
        KV_ENV, size / GiB, bound, max_num_seqs, max_model_len, per_token / 1024,
        max_num_seqs * max_model_len * per_token / GiB, 100 * FREE_FRACTION, free / GiB,
        node, ranks, KV_ENV)
    return size


def user_chose_kv_size(cache_config) -> bool:
    """Any explicit KV sizing: the environment variable, the byte flag, or the fraction."""
    from vllm.config import CacheConfig

    if os.environ.get(KV_ENV, "") != "" or cache_config.kv_cache_memory_bytes is not None:
        return True
    return cache_config.gpu_memory_utilization != CacheConfig().gpu_memory_utilization


def kv_bytes_per_token(vllm_config) -> int:
    """KV bytes one token takes on one rank: the target, plus a separate draft model's.

    2 (K and V) x layers x KV heads x head size x element size; MLA models store
    less, so this errs high there (which only lowers the demand bound's effect).
    A draft that is the target itself (two-level TriForce) adds nothing.
    """
    target = vllm_config.model_config
    total = _model_kv_bytes(target, vllm_config)
    spec = vllm_config.speculative_config
    draft = getattr(spec, "draft_model_config", None) if spec is not None else None
    if draft is not None and draft.model != target.model:
        total += _model_kv_bytes(draft, vllm_config)
    return total


def _model_kv_bytes(model_config, vllm_config) -> int:
    from vllm.utils.torch_utils import get_dtype_size, kv_cache_dtype_str_to_dtype

    parallel = vllm_config.parallel_config
    try:
        dtype = kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype, model_config)
    except KeyError:
        dtype = model_config.dtype
    return (2 * model_config.get_num_layers(parallel) * model_config.get_num_kv_heads(parallel)
            * model_config.get_head_size() * get_dtype_size(dtype))


def node_free_memory() -> tuple[int, int]:
    """(free bytes, node) of the NUMA node the CPU worker will bind to.

    The same lookup as `CPUWorker.__init__`: the node of the first allowed CPU, and
    vLLM's notion of free (MemFree + file cache + reclaimable, within cgroup limits).
    """
    from vllm.utils.cpu_resource_utils import (get_allowed_cpu_list, get_memory_node_info,
                                               get_visible_memory_node)

    node = get_allowed_cpu_list()[0].numa_node
    if node not in get_visible_memory_node():
        node = get_visible_memory_node()[0]
    return get_memory_node_info(node).available_memory, node


# ------------------------------------------------------------------ bf16 warning

def bf16_is_native() -> bool:
    """True where the CPU computes bf16 in hardware (AVX512-BF16 or AMX)."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def warn_if_bf16_emulated(model_config) -> bool:
    """Warn once when the model will run in bf16 that this CPU emulates; True if so."""
    import torch

    if model_config.dtype != torch.bfloat16 or bf16_is_native():
        return False
    logger.warning_once(
        "%s runs in bfloat16, which this CPU emulates (no AVX512-BF16 or AMX): prefill and "
        "decode are several times slower than in float32. Pass --dtype float32 "
        "(LLM(..., dtype=\"float32\")) unless you need bf16 numerics.", model_config.model)
    return True
