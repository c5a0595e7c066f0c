"""The middle level's logits, handed to Model Runner V2's verifier by request slot and step.

What MRV2's verifier reads (vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py,
0.32.0 and 0.33.0): `speculator.draft_logits` [max_num_reqs, K, V], indexed by request
*slot* (`input_batch.idx_mapping[row]`, the request's row in the runner's persistent
state) and draft step k, holding *pre-temperature* logits; it takes the draft distribution
of request r's k-th draft as q = softmax(draft_logits[slot_r, k] / T_r), with no top-k and
no top-p (MRV2 drafts with temperature only: `DraftModelSpeculator._copy_request_inputs`).
Rejection sampling is exact for any q the drafts were really drawn from, so TriForce's
middle level draws its tokens on MRV2 from exactly that q (`temperature_only`), and
`keep_logits` writes the logits each middle token was drawn from to its (slot, k).

The V1 runner instead reads draft *probabilities* by batch row (engine/middle.py
`HandOffBuffer`), which carry top-k and top-p; both bindings verify exactly, each with the
distribution its verifier assumes.

Exactness needs the same numbers on both sides: the verifier upcasts the stored logits
to float32, as `sampling_probs` (core/verify.py) upcasts the middle pass's logits, so the
buffer holds the logits' own dtype (the head dtype MRV2 allocates `draft_logits` in,
`DraftModelSpeculator.draft_logits_spec`); `keep_logits` refuses any other.
"""

from __future__ import annotations

import dataclasses

import torch


class DraftLogitsBuffer:
    """`logits` [max_num_reqs, K, V] (the speculator's `draft_logits`, which MRV2 hands to
    its verifier) and, in the same allocation, one spare row after them where the writes
    of rows nobody verifies land (no host list, hence no device sync, decides them)."""

    def __init__(self, max_num_reqs: int, num_steps: int, vocab_size: int,
                 dtype: torch.dtype, device=None):
        # [max_num_reqs * K + 1, V]
        self.flat = torch.zeros(max_num_reqs * num_steps + 1, vocab_size, dtype=dtype,
                                device=device)
        self.logits = self.flat[:-1].view(max_num_reqs, num_steps, vocab_size)
        self.spare = max_num_reqs * num_steps  # the spare row's index in `flat`
        self.num_steps = num_steps

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes


def keep_logits(buffer: DraftLogitsBuffer, logits: torch.Tensor, emitted: torch.Tensor,
                slots: torch.Tensor, first_k: torch.Tensor) -> None:
    """One middle round's level-2 logits into `buffer`, with one index copy on the device.

    logits [n, width, V]: per request of the round, the logits its emitted tokens were
    drawn from, in order (zero-padded past them: engine/middle.py `_RoundLayout.
    per_request`); emitted [n]: the middle tokens the round emitted for it (accepted + 1);
    slots [n]: its MRV2 slot; first_k [n]: the middle tokens it held before the round, so
    its j-th emitted token is its draft step first_k + j. Steps >= K and rows past
    `emitted` go to the spare row.

    Example, K 3: a request at slot 1 holding 2 middle tokens that emitted 2: row 0 goes
    to logits[1, 2], row 1 (step 3, past K) to the spare row."""
    if logits.dtype != buffer.flat.dtype:
        raise TypeError(f"middle logits are {logits.dtype}, MRV2's draft_logits "
                        f"{buffer.flat.dtype}: the verifier would see another q than the "
                        "tokens were drawn from")
    num_steps = buffer.num_steps
    j = torch.arange(logits.shape[1], device=logits.device)  # [width]
    step = first_k[:, None] + j  # [n, width]
    kept = (j < emitted[:, None]) & (step < num_steps)
    dst = torch.where(kept, slots[:, None] * num_steps + step, buffer.spare)
    buffer.flat[dst.flatten()] = logits.flatten(0, 1)


def temperature_only(batch):
    """`batch` (a StepBatch) with top-k and top-p off: the distribution the middle level
    draws from on MRV2, q = softmax(logits / T), the one its verifier assumes (module
    docstring). Level 3 still applies the request's top-k and top-p to the target."""
    if batch.top_k is None and batch.top_p is None:
        return batch
    return dataclasses.replace(batch, top_k=None, top_p=None)
