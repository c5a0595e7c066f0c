"""CPU fix for the rejection sampler's `expand_kernel` (vllm#55005, fix PR vllm#55006).

Upstream (vLLM 0.32.0, `vllm/utils/cpu_triton_utils.py::_expand_kernel_impl`):
the CPU stand-in for the Triton `expand_kernel` passes `_ensure_int64(output)`
to the int64-only C++ op. For a non-int64 buffer that is a *copy*, so the op
fills the copy and the caller's buffer stays as allocated by
`expand_batch_to_tokens` (`x.new_empty(num_tokens)`, i.e. uninitialised).
The buffers it expands are the per-request temperature (float32), top-k
(int32) and top-p (float32) of `apply_sampling_constraints` in
`v1/sample/rejection_sampler.py`, so every non-greedy speculative step on CPU
scales target logits by garbage: a model drafting for itself at T=0.8 accepts
~65% of drafts instead of 100%. (Float inputs were also truncated to int.)

Fix: replace the function by a pure-torch expansion at the caller's dtype
(the semantics of the Triton kernel, and of PR vllm#55006).

Why a patch: the override is registered by `CpuPlatform.register_triton_kernel_overrides`
(`platforms/cpu.py`), which `WorkerWrapperBase.init_worker` calls right after
`load_general_plugins()`; it reads `cpu_triton_utils._expand_kernel_impl` at
that moment. No option selects another implementation, and registering our
own override for the kernel would be overwritten by that later call. Replacing
the module attribute from the plugin entry point happens before registration,
so the registered override is ours. If the override was registered before
`apply()` ran (plugin applied late by hand), `apply()` re-registers it through
the official `register_kernels` API. Harmless off CPU: the function is only
ever registered on CPU builds without Triton.
"""

import torch

from vllm_triforce.patches import _util

NAME = "cpu_expand"
MODULE = "vllm.utils.cpu_triton_utils"
QUALNAME = "_expand_kernel_impl"
KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def _expand_kernel_impl(
    output,  # [num_tokens], any dtype; written in place
    input_val,  # [batch_size]
    cu_num_tokens,  # [batch_size], inclusive cumulative token counts
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,
):
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to), at output's dtype.

    Example: input_val = [a, b, c], cu_num_tokens = [2, 5, 6] -> [a, a, b, b, b, c].
    The replacement is compared at the input's dtype before the store casts to
    the output's dtype, as in the Triton kernel. MAX_NUM_TOKENS (the kernel's
    per-request tile width, >= any request's draft count) is not needed here.
    """
    values = torch.where(input_val == replace_from, replace_to, input_val)  # [batch_size]
    counts = torch.diff(cu_num_tokens, prepend=cu_num_tokens.new_zeros(1))  # [batch_size]
    expanded = torch.repeat_interleave(values, counts)  # [cu_num_tokens[-1]]
    output[: expanded.shape[0]].copy_(expanded)


def _reregister_if_already_registered(original) -> None:
    """Point an override registered before apply() (with the buggy impl) at ours."""
    from vllm.triton_utils import dispatcher

    entry = dispatcher._registry.get(KERNEL)
    if entry is not None and entry[1] is original:
        dispatcher.register_kernels({KERNEL: _expand_kernel_impl})


def apply() -> None:
    *_, original = _util.resolve(MODULE, QUALNAME)
    if _util.is_patched(original):
        _util.APPLIED[NAME] = True
        return
    _util.replace(MODULE, QUALNAME, _expand_kernel_impl, NAME)
    _reregister_if_already_registered(original)
