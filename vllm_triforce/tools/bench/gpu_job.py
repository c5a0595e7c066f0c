"""One engine of `vllm-triforce bench gpu` (bench/gpu_check.py), in its own process.

    python -m vllm_triforce.tools.bench.gpu_job JOB.json RESULT.json

JOB.json: {"kind": "kernels" | "generate" | "costs", "model": DIR, "llm": {LLM kwargs},
"spec": speculative_config or null, ...kind's fields}. The engine runs in this process
(gpu_engine.py, vllm_triforce/offline.py), so its runner, the TriForce proposer and the CUDA
allocator are in reach:

* kernels: vLLM's compiled kernels on this torch (RMSNorm from `_C_stable_libtorch`,
  FlashAttention 3) against torch references; no engine.
* generate: greedy outputs (and the top-2 log-prob margin at every position with
  `logprobs`), TriForce's counters, and the syncs per step and per middle round. With
  `sampling` ({"temperature", "copies"}): `copies` continuations of each prompt sampled at
  that temperature, kept as token counts per position (`samples`), for the distribution
  check (bench/gpu_summary.py); `depth_schedule` has the depth controller plan those
  depths in turn, `wrong_temperature` makes the hand-off wrong (the negative control;
  bench/forcing.py).
* costs (gpu_costs.py): per case (batch x context) the milliseconds of a decode step, and
  for TriForce of a step at each forced depth (middle rounds and verification apart), plus
  TriForce's memory against its reservation.

Syncs on CUDA are counted twice, differently: `torch.cuda.set_sync_debug_mode("warn")`
makes every synchronising CUDA call warn; each warning's Python stack says whose it is
(a frame in vllm_triforce: TriForce's, else vLLM's), divided by the steps vLLM ran. The
project's `SyncCounter` (vllm_triforce/tools/bench/syncs.py) counts inside `propose`, per
middle round.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

from vllm_triforce.tools.bench.gpu_costs import run_costs
from vllm_triforce.tools.bench.gpu_engine import (build_llm, count_steps, drafter_or_none,
                                                   engine_facts, token_prompts, top2_margins)

ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
PACKAGE = str(Path(__file__).resolve().parents[2])  # vllm_triforce/


def main(job_path: str, result_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    for key, value in {**ENGINE_ENV, **job.get("env", {})}.items():
        os.environ[key] = value
    result = {"kernels": run_kernels, "generate": run_generate, "costs": run_costs}[
        job["kind"]](job)
    Path(result_path).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------ kernels

def run_kernels(job: dict) -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        return {**out, "skipped": "no CUDA device"}
    out["gpu"] = torch.cuda.get_device_name()
    out["rms_norm"] = _check(lambda: _rms_norm_error(torch))
    out["flash_attn_3"] = _check(lambda: _fa3_error(torch))
    return out


def _check(fn) -> dict:
    try:
        return {"ok": True, "max_error": fn()}
    except Exception as err:  # a kernel that does not load or run: reported, not raised
        return {"ok": False, "error": f"{type(err).__name__}: {err}"[:500]}


def _rms_norm_error(torch) -> float:
    from vllm import _custom_ops as ops

    x = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-5)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)) * w.float()
    return float((out.float() - ref).abs().max())


def _fa3_error(torch) -> float:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    q = torch.randn(128, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(128, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    cu = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k, v, 128, cu, 128, cu_seqlens_k=cu, causal=True,
                                 fa_version=3)
    kk, vv = (t.repeat_interleave(4, dim=1).transpose(0, 1) for t in (k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).float(), kk.float(), vv.float(), is_causal=True).transpose(0, 1)
    return float((out.float() - ref).abs().max())


# ------------------------------------------------------------------------- syncs

class SyncAttribution:
    """Every synchronising CUDA call (torch's sync debug mode), recorded by the innermost
    frame of this package on its Python stack (`engine/device/forward.py:123`,
    `patches/cpu_seed.py:64`), or `vllm` where there is none. `owner` says whose work it
    is: TriForce's when that frame is the proposer's (engine/, core/) or the sync
    counter's wrapper around it (syncs.py); a patch's frame (patches/) is a thin wrapper
    around vLLM's own method, so a sync under it is vLLM's."""

    def __init__(self):
        self.sites: collections.Counter = collections.Counter()

    def __enter__(self):
        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._show, warnings.showwarning = warnings.showwarning, self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        self._catch.__exit__(*exc)

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(PACKAGE)
                and "/tools/" not in f.filename]
        if not ours:
            self.sites["vllm"] += 1
            return
        site = ours[-1]
        self.sites[f"{Path(site.filename).relative_to(PACKAGE)}:{site.lineno}"] += 1

    def summary(self, steps: int) -> dict:
        return {"steps": steps, "sites": dict(self.sites.most_common())}


def sync_owner(site: str) -> str:
    """'triforce' or 'vllm' for a site recorded by SyncAttribution (see there). Sites of
    runs before the folder was recorded name the file alone (`cpu_seed.py:64`): a file of
    patches/ is recognised by name."""
    import vllm_triforce.patches as patches

    path = site.rsplit(":", 1)[0]
    in_patches = path.startswith("patches/") or (
        "/" not in path and (Path(patches.__file__).parent / path).exists())
    return "vllm" if path == "vllm" or in_patches else "triforce"


# ---------------------------------------------------------------------- generate

def run_generate(job: dict) -> dict:
    import torch
    from vllm import SamplingParams

    from vllm_triforce.tools.bench import forcing

    if job.get("wrong_temperature"):
        forcing.force_wrong_hand_off(job["wrong_temperature"])
    llm = build_llm(job)
    drafter = drafter_or_none(llm)
    if drafter is not None and job.get("forced_depths"):
        depth, = job["forced_depths"]  # one fixed depth
        drafter.set_fixed_depth(depth)
    if drafter is not None and job.get("depth_schedule"):
        forcing.schedule_depths(drafter.depth.controller, job["depth_schedule"])
    sampling = job.get("sampling") or {"temperature": 0.0, "copies": 1}
    params = SamplingParams(temperature=sampling["temperature"], max_tokens=job["max_tokens"],
                            ignore_eos=True, logprobs=job.get("logprobs"))
    prompts = [p for p in job["prompts"] for _ in range(sampling["copies"])]
    steps = count_steps(llm)
    # syncs are read on the greedy jobs (the summary's), not on thousands of samples
    attribution = (SyncAttribution() if torch.cuda.is_available() and not job.get("sampling")
                   else None)
    attribution_error = None
    propose_syncs = None
    if drafter is not None:
        from vllm_triforce.tools.bench.syncs import ProposeSyncs

        propose_syncs = ProposeSyncs(drafter).__enter__()
    if attribution is not None:
        try:
            attribution.__enter__()
        except Exception as err:  # the counts are a finding, not a reason to lose the tokens
            attribution, attribution_error = None, f"{type(err).__name__}: {err}"
    try:
        outputs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    finally:
        if attribution is not None:
            attribution.__exit__(None, None, None)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    result = {"facts": engine_facts(llm), "steps": steps["steps"],
              "reference": job.get("reference")}
    if job.get("sampling"):
        result.update(samples=token_counts(tokens), sampling=job["sampling"],
                      wrong_temperature=job.get("wrong_temperature"))
    else:
        result["tokens"] = tokens
    if job.get("logprobs"):
        result["margins"] = [top2_margins(o.outputs[0]) for o in outputs]
    if attribution is not None:
        result["cuda_syncs"] = attribution.summary(steps["steps"])
    elif attribution_error:
        result["cuda_syncs_error"] = attribution_error
    if drafter is not None:
        from vllm_triforce.tools.bench.syncs import summarise

        summary = summarise(propose_syncs.take())
        propose_syncs.__exit__(None, None, None)
        result["propose_syncs"] = {k: summary[k] for k in (
            "max_round", "max_step", "mean_round", "mean_step", "num_rounds", "num_steps",
            "once", "host")}
        result["propose_syncs"]["by_op"] = summary["by_op"]
        result["stats"] = drafter.stats.snapshot()
    return result


def token_counts(sequences: list[list[int]]) -> list[dict[str, int]]:
    """Per position, how often each token was sampled there ({"token id": count})."""
    counts = [collections.Counter() for _ in range(max(map(len, sequences), default=0))]
    for sequence in sequences:
        for position, token in enumerate(sequence):
            counts[position][str(token)] += 1
    return [dict(c) for c in counts]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
