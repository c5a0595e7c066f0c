"""A plain step's drafter call without vLLM's preparation of the drafter's inputs.

Upstream (vLLM 0.32.0 and 0.33.0, `v1/worker/gpu_model_runner.py`,
`GPUModelRunner.propose_draft_token_ids`): for a draft-model drafter, before calling
`drafter.propose`, every step prepares its inputs: the next token of each request
(`prepare_next_token_ids_padded`, device work), the pass's token ids, positions and
hidden states, and with drafts the padded inputs. TriForce's proposer decides during
vLLM's pass whether the step is plain (engine/plain_steps.py, asked at the pass's first
layer: engine/device/capture.py `reads_pass`), and a plain step reads none of those
inputs. On a 2-vCPU Intel Xeon (SmolLM2-135M, 2 x 1,500 tokens) the preparation took
about 0.23 ms a step, more than TriForce's own plain step (0.19 ms).

How: wrap `propose_draft_token_ids`; when the runner's drafter has
`propose_plain_step` (TriForce's proposer) and it answers with draft lists (the step was
decided plain during the pass; the proposer did its plain step's bookkeeping), those are
returned at once, as vLLM's own call would have returned the proposer's, with
`_draft_probs` and `_draft_prob_req_ids` None, as the call sets them first. Otherwise
(`None`: not decided, or a working step) vLLM's call runs unchanged.

Gate: a drafter with `propose_plain_step` and synchronous scheduling (TriForce runs the V1
runner synchronously: engine_settings.py; under async scheduling the preparation also
hands the next step its sampled counts, which this would skip). Upstream: none known.
Remove: when vLLM lets a drafter say, before the call, that it needs no inputs this step.
"""

from vllm_triforce.patches import _util

NAME = "plain_propose"
TARGET = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids")


def apply() -> None:
    _util.wrap(*TARGET, _make_propose_draft_token_ids, NAME)


def _make_propose_draft_token_ids(original):
    def propose_draft_token_ids(self, *args, **kwargs):
        plain_step = getattr(getattr(self, "drafter", None), "propose_plain_step", None)
        if plain_step is not None and not self.use_async_scheduling:
            drafts = plain_step()
            if drafts is not None:
                self._draft_probs = None
                self._draft_prob_req_ids = None
                return drafts
        return original(self, *args, **kwargs)

    return propose_draft_token_ids
