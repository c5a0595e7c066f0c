"""`vllm-triforce doctor`: the first command to run on a new machine, a GPU above all.

It builds plain vLLM and TriForce (two levels unless `--draft`) on the same long Moby-Dick
prompts, each in a child process (a crash, e.g. a CUDA device-side assert, becomes a FAIL
line instead of killing the report; each engine starts from vLLM's own defaults), and
reads from the engine actually built what TriForce depends on: the platform, the vLLM
version, the attention backend, the CUDA-graph mode, the model runner (V1/V2), async
scheduling and the memory TriForce reserved before KV sizing (engine_settings.py and
patches/kv_reservation.py set these). Then it compares the greedy tokens, reports the
acceptance and the speed ratio, prints PASS/FAIL/INFO per item and exits 1 on any FAIL.

Each child runs doctor_engine.py (one engine, its result as JSON); this module runs the two,
judges their results (`evaluate`: pure, unit-tested on made-up dicts) and prints the report.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PASS, FAIL, INFO = "PASS", "FAIL", "INFO"
DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4"}  # GiB, as the demo; ignored off CPU
# Off CPU, plain vLLM and TriForce run different kernels (one decode token vs. 1 + gamma
# verified tokens, FULL vs. PIECEWISE graphs), so a bf16/fp16 logit can round differently
# and flip a greedy choice between two tokens whose log-probabilities differ by about one
# half-precision ulp (~0.06-0.125 at logit magnitudes of 8-16). Such a flip is noise, not a
# loss: we accept a first divergence whose plain-vLLM log-prob gap is at most this.
NEAR_TIE_NATS = 0.25
QUICK = {"prompt_tokens": 512, "max_tokens": 16, "batch": 1, "budget": 256}
# TriForce's runner in Model Runner V2 (engine/mrv2/speculator.py), by class name: the
# child's results are plain dicts
MRV2_RUNNER = "TriForceRunnerV2"


def add_doctor_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor", help="check TriForce on this machine: settings, identity, acceptance")
    p.add_argument("--model", default="smollm2-135m",
                   help="target: a `vllm-triforce models` name, a directory or a hub id")
    p.add_argument("--draft", default=None,
                   help="small draft (three levels); default: none (two levels)")
    # Defaults sized for a run of a few minutes on a 2-core CPU (about 3 min of CPU time).
    p.add_argument("--prompt-tokens", type=int, default=2048, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--batch", type=int, default=1, help="requests (different book passages)")
    p.add_argument("--budget", type=int, default=512, help="retrieval_budget (tokens)")
    p.add_argument("--gamma", type=int, default=6, help="num_speculative_tokens (gamma2)")
    p.add_argument("--dtype", default=None,
                   help="model dtype; default float32 on CPU (exact), the model's own elsewhere")
    p.add_argument("--quick", action="store_true",
                   help="tiny run (1 x 512-token prompt, 16 new tokens) to check wiring fast")
    p.add_argument("--log-dir", default=None, help="child logs (default: a new temp dir)")
    p.set_defaults(func=run_doctor)


# ------------------------------------------------------------------ parent

def run_doctor(args) -> int:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="vllm-triforce-doctor-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    target, draft = _model_ref(args.model), _model_ref(args.draft) if args.draft else None
    job = _base_job(args, target)
    print(f"vllm-triforce doctor: target {target}, draft {draft or 'none (two levels)'}, "
          f"{args.batch} x {args.prompt_tokens}-token Moby-Dick prompts, {args.max_tokens} "
          f"new tokens, greedy; child logs in {log_dir}", flush=True)
    plain = _run_child({**job, "spec": None}, log_dir / "plain.log")
    tri = _run_child({**job, "spec": _triforce_spec(args, draft)}, log_dir / "triforce.log")
    checks = evaluate(plain, tri)
    print(format_report(checks), flush=True)
    return exit_code(checks)


def _model_ref(name: str) -> str:
    """A known asset name is fetched (cached); a directory or hub id is passed through."""
    from vllm_triforce import assets

    if name in assets.MODEL_SPECS and not Path(name).is_dir():
        return str(assets.ensure_model(name))
    return name


def _base_job(args, target: str) -> dict:
    from vllm_triforce.tools.bench.prompts import book_prompts

    return {"model": target, "prompts": book_prompts(target, args.prompt_tokens, args.batch),
            "max_tokens": args.max_tokens, "dtype": args.dtype,
            "max_model_len": args.prompt_tokens + args.max_tokens + 2 * args.gamma + 64}


def _triforce_spec(args, draft: str | None) -> dict:
    # A fixed depth: the doctor checks that every level runs and is verified; the depth
    # controller may (rightly) decode plainly on a short check and prove nothing.
    spec = {"method": "triforce", "num_speculative_tokens": args.gamma,
            "retrieval_budget": args.budget, "adaptive": False}
    if draft is not None:
        spec["model"] = draft
    return spec


def _run_child(job: dict, log_path: Path) -> dict:
    """One engine in a child process; {"error": ...} if it died (the log's tail)."""
    name = "TriForce" if job["spec"] else "plain vLLM"
    _logger().info("doctor: running %s (log %s)", name, log_path)
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        with open(log_path, "w") as log:
            proc = subprocess.run([sys.executable, "-m", "vllm_triforce.tools.doctor_engine",
                                   str(job_path), str(result_path)], stdout=log,
                                  stderr=subprocess.STDOUT,
                                  env=_child_env(job))
        if proc.returncode == 0 and result_path.exists():
            return json.loads(result_path.read_text())
    tail = "\n".join(log_path.read_text().splitlines()[-12:])
    return {"error": f"exit {proc.returncode}; log {log_path}:\n{tail}"}


def _logger():
    """vLLM's logger, imported late: `vllm-triforce models list` must not import vLLM."""
    from vllm.logger import init_logger

    return init_logger(__name__)


def _child_env(job: dict) -> dict:
    """This environment; DEFAULT_ENV where unset. Hub access is turned off only when every
    model is a local directory (a hub id needs it)."""
    models = [job["model"]] + ([job["spec"]["model"]] if (job["spec"] or {}).get("model")
                               else [])
    offline = {"HF_HUB_OFFLINE": "1"} if all(Path(m).is_dir() for m in models) else {}
    return {**DEFAULT_ENV, **offline, **os.environ}


# ------------------------------------------------------------------ checks

@dataclass
class Check:
    status: str  # PASS, FAIL or INFO (reported, not judged)
    item: str
    detail: str


def evaluate(plain: dict, tri: dict) -> list[Check]:
    """Every report line from the two child results (pure: unit-tested on made-up dicts)."""
    checks = [_ran("plain vLLM engine", plain), _ran("TriForce engine", tri)]
    if "error" in tri:
        return checks
    engine = tri["engine"]
    mrv2 = engine["runner_class"] == MRV2_RUNNER
    checks += [Check(INFO, "platform", engine["platform"]),
               *_openmp(engine.get("openmp"), engine["device_type"]),
               _vllm_version(engine["vllm_version"]),
               _runner(engine["runner"], engine["runner_class"]),
               _cudagraph_mode(engine["cudagraph_mode"], engine["enforce_eager"], mrv2),
               _async_scheduling(engine["async_scheduling"], mrv2),
               _attention_backend(engine["attention_backends"]),
               _reservation(engine["reserved_bytes"]),
               _key_reader(engine.get("key_reader")),
               _proposer(engine["drafter"], tri["triforce"]),
               _acceptance(tri["triforce"], tri["vllm_spec"])]
    if "error" not in plain:
        checks += [_identity(plain, tri, exact=engine["device_type"] == "cpu"),
                   _speed(plain, tri, engine["device_type"])]
    return checks


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def format_report(checks: list[Check]) -> str:
    lines = [""] + [f"{c.status:<5} {c.item:<22} {c.detail}" for c in checks]
    verdict = "FAILED" if exit_code(checks) else "all checks passed"
    return "\n".join(lines + [f"\ndoctor: {verdict}"])


def _ran(item: str, result: dict) -> Check:
    if "error" in result:
        return Check(FAIL, item, f"did not finish: {result['error']}")
    return Check(PASS, item, f"decode {result['tok_s']:.2f} tok/s, "
                             f"prefill {result['prefill_s']:.1f} s")


def _openmp(runtime: str | None, device_type: str) -> list[Check]:
    """On CPU, the OpenMP runtime the engine ran on (reported, not judged): vLLM's CPU guide
    preloads Intel OpenMP, without which speculative decoding on CPU loses up to 2x."""
    if device_type != "cpu" or runtime is None:
        return []
    if runtime == "Intel OpenMP":
        return [Check(INFO, "OpenMP runtime", runtime)]
    from vllm_triforce.tools.cpu_openmp import intel_openmp_path

    path = intel_openmp_path()
    fix = (f"LD_PRELOAD={path}" if path
           else "pip install intel-openmp, then LD_PRELOAD=<its lib>/libiomp5.so")
    return [Check(INFO, "OpenMP runtime",
                  f"{runtime}: vLLM's CPU guide preloads Intel OpenMP, without which "
                  f"speculative decoding on CPU loses up to 2x ({fix})")]


def _vllm_version(version: str) -> Check:
    from vllm_triforce import check_vllm_version

    try:
        check_vllm_version(version)
    except RuntimeError as err:
        return Check(FAIL, "vLLM version", str(err))
    return Check(PASS, "vLLM version", version)


def _runner(runner: str, runner_class: str) -> Check:
    """The V1 runner, or Model Runner V2 with TriForce's own runner in it (asked for with
    VLLM_TRIFORCE_MRV2=1 or VLLM_USE_V2_MODEL_RUNNER=1, experimental); V2 with vLLM's own
    runner would run vLLM's draft-model speculator, not TriForce."""
    if runner == "V1":
        return Check(PASS, "model runner", f"V1 ({runner_class})")
    if runner_class == MRV2_RUNNER:
        return Check(PASS, "model runner", f"V2 ({runner_class}, experimental)")
    return Check(FAIL, "model runner", f"{runner} ({runner_class}): vLLM's own V2 runner would "
                 "run its draft-model speculator, not TriForce's levels; unset "
                 "VLLM_USE_V2_MODEL_RUNNER and worker_cls")


def _cudagraph_mode(mode: str, enforce_eager: bool, mrv2: bool) -> Check:
    from vllm_triforce.engine_settings import MRV2_FULL_MODE, UNSAFE_CUDAGRAPH_MODES

    # on Model Runner V2 a pass TriForce reads runs piecewise (engine/mrv2/graphs.py)
    ok = mode not in UNSAFE_CUDAGRAPH_MODES or (mrv2 and mode == MRV2_FULL_MODE)
    note = " (enforce_eager)" if enforce_eager else ""
    why = "" if ok else ": full graphs hide attention from TriForce's key capture"
    return Check(PASS if ok else FAIL, "CUDA-graph mode", f"{mode}{note}{why}")


def _async_scheduling(on: bool, mrv2: bool) -> Check:
    if mrv2:  # MRV2's runner cuts the scheduled drafts to each request's depth
        return Check(PASS, "async scheduling", "on" if on else "off")
    detail = "on: the proposer would read placeholder token ids" if on else "off"
    return Check(FAIL if on else PASS, "async scheduling", detail)


def _attention_backend(names: list[str]) -> Check:
    from vllm_triforce.config import SUPPORTED_ATTENTION_BACKENDS

    bad = [n for n in names if n not in SUPPORTED_ATTENTION_BACKENDS]
    detail = ", ".join(names) or "none found"
    if bad or not names:
        return Check(FAIL, "attention backend",
                     f"{detail} (supported: {', '.join(SUPPORTED_ATTENTION_BACKENDS)})")
    return Check(PASS, "attention backend", detail)


def _reservation(reserved_bytes) -> Check:
    if not isinstance(reserved_bytes, int):
        return Check(INFO, "memory reservation", "n/a (this build does not report it)")
    return Check(INFO, "memory reservation",
                 f"{reserved_bytes / 2**20:.1f} MiB set aside before KV-cache sizing")


def _key_reader(status: str | None) -> Check:
    """Whether `rerank` can read keys from this backend's KV cache (engine/paged_keys.py):
    every engine compares what it reads with the keys written, once, at its first commit."""
    if not status:
        return Check(INFO, "KV-cache key reader", "n/a (this build does not report it)")
    if status.startswith("check failed"):
        return Check(FAIL, "KV-cache key reader",
                     f"{status} (`rerank` falls back to `retrieval`; please report it)")
    if status.startswith("checked"):
        return Check(PASS, "KV-cache key reader", f"{status}: `rerank` reads this cache")
    return Check(INFO, "KV-cache key reader", f"{status} (`rerank` would keep `retrieval`)")


def _proposer(drafter: str, stats: dict | None) -> Check:
    proposed = (stats or {}).get("top_proposed", 0)
    ok = drafter in ("TriForceProposer", "TriForceSpeculator") and proposed > 0
    return Check(PASS if ok else FAIL, "TriForce proposer",
                 f"{drafter}, {proposed} draft tokens verified by the full cache")


def _acceptance(stats: dict | None, vllm_spec: dict) -> Check:
    from vllm_triforce.engine.stats import format_snapshot

    accepted = vllm_spec.get("vllm:spec_decode_num_accepted_tokens") or 0
    drafts = vllm_spec.get("vllm:spec_decode_num_draft_tokens") or 0
    levels = format_snapshot(stats) if stats else "no TriForce counters"
    detail = f"vLLM spec-decode {accepted}/{drafts} accepted; {levels}"
    return Check(PASS if accepted > 0 else FAIL, "acceptance > 0", detail)


def _identity(plain: dict, tri: dict, exact: bool) -> Check:
    """Greedy tokens equal plain vLLM's: exactly on CPU (fp32, proven), else up to
    near-ties at the first divergence (see NEAR_TIE_NATS)."""
    notes = []
    for r, (p, t) in enumerate(zip(plain["tokens"], tri["tokens"])):
        j = _first_divergence(p, t)
        if j is None:
            continue
        if j >= min(len(p), len(t)):
            return Check(FAIL, "greedy identity",
                         f"request {r}: {len(p)} plain tokens, {len(t)} TriForce tokens")
        where = f"request {r} token {j}: plain {p[j]}, TriForce {t[j]}"
        if exact or not plain.get("logprobs"):
            return Check(FAIL, "greedy identity", f"first difference at {where}")
        gap = _logprob_gap(plain["logprobs"][r][j], p[j], t[j])
        if gap > NEAR_TIE_NATS:
            return Check(FAIL, "greedy identity", f"{where} (log-prob gap {gap:.3g} nats)")
        notes.append(f"{where} is a near-tie (gap {gap:.3g} nats)")
    total = sum(map(len, plain["tokens"]))
    detail = f"{total} tokens of {len(plain['tokens'])} request(s) identical to plain vLLM"
    if notes:
        detail = f"identical up to half-precision near-ties: {'; '.join(notes)}"
    return Check(PASS, "greedy identity", detail)


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def _logprob_gap(top: dict, plain_token: int, tri_token: int) -> float:
    """log p(plain's token) - log p(TriForce's token) under plain vLLM (inf if not in top-k)."""
    tri_lp = top.get(str(tri_token))
    return math.inf if tri_lp is None else top[str(plain_token)] - tri_lp


def _speed(plain: dict, tri: dict, device_type: str) -> Check:
    ratio = tri["tok_s"] / plain["tok_s"]
    why = ("not judged on CPU: CPU attention cost grows with the query tokens per request "
           "(verifying gamma+1 tokens costs ~3 decode steps here, about 1 on a GPU)"
           if device_type == "cpu" else
           "not judged: a small model on a few thousand tokens is not the KV-bound regime "
           "TriForce targets; use `vllm-triforce bench speed` for that")
    return Check(INFO, "speed ratio", f"TriForce/plain decode {ratio:.2f}x ({why})")
