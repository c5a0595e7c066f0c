"""vLLM's LoRA adapters (`--enable-lora`) on TriForce's passes.

vLLM maps each token of its own batch to its request's adapter once a step (the V1
runner's `set_active_loras`, from `input_batch.request_lora_mapping`); the punica
wrapper's metadata then holds one entry per token of that batch and one per sampled row.
TriForce's middle passes run other tokens (a request's newest token and its drafts), so
before each pass, and each chunk of a split one, `PassAdapters.set_for` maps that pass's
tokens and sampled rows to the same per-request adapters, through the same runner method
vLLM uses (`_set_active_loras`, vllm/v1/worker/lora_model_runner_mixin.py). vLLM maps its
own batch again at its next step. The small draft (three levels) has no adapters: vLLM
wraps only the target with LoRA layers, so it drafts from its own weights, and the middle
level, which has them, verifies its drafts.
"""

from __future__ import annotations

import numpy as np


class PassAdapters:
    """Sets the LoRA mapping of the V1 `runner` for one TriForce pass at a time."""

    def __init__(self, runner):
        self.runner = runner

    def set_for(self, batch_rows: np.ndarray, query_start_loc: list[int],
                sample_rows: list[int]) -> None:
        """A pass of the requests in `batch_rows` (rows of vLLM's input batch, in pass
        order), request i running tokens [query_start_loc[i], query_start_loc[i + 1]),
        sampling the token rows `sample_rows`. Example: requests with adapters [1, 0]
        running 2 and 1 tokens, every row sampled: tokens [1, 1, 0], sampled rows [1, 1, 0]
        (0: no adapter)."""
        batch = self.runner.input_batch
        ids = batch.request_lora_mapping[np.asarray(batch_rows, dtype=np.int64)]  # [n]
        starts = np.asarray(query_start_loc, dtype=np.int64)
        tokens = np.repeat(ids, np.diff(starts))
        owners = np.searchsorted(starts[1:], np.asarray(sample_rows, dtype=np.int64),
                                 side="right")
        self.runner._set_active_loras(tuple(ids[owners].tolist()), tuple(tokens.tolist()),
                                      set(batch.lora_id_to_lora_request.values()))
