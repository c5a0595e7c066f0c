"""`vllm-triforce bench gpu` (tools/bench/gpu_check.py and its gpu_* siblings) and its offline
bundle (scripts/gpu_bundle.py).

The dry run is the GPU check's own jobs on this CPU (tiny shapes, CPU_ATTN): every line a
GPU run would execute outside the CUDA-only probes, so no lent GPU minute is lost to a
Python error. The other tests are hand-worked cases of what the check concludes.
"""

import argparse
import importlib.util
import json
import struct
from pathlib import Path

import pytest

from vllm_triforce.tools.bench import gpu_check, gpu_render, gpu_summary

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.engine
def test_dry_run_of_the_gpu_check_passes_on_cpu(tmp_path):
    args = argparse.Namespace(out=tmp_path / "out", resume=None, tokenizer=None,
                              models=tmp_path / "models", budget_s=None, only=None,
                              cases=None, redo=False, dry_run=True, acceptance=None,
                              summarise=False)
    results = gpu_check.run(args)
    assert {name: job["status"] for name, job in results["jobs"].items()} == {
        "kernels": "ok", "exact-cpu-fp32-plain": "ok", "exact-cpu-fp32-3L": "ok",
        "sample-cpu-fp32-plain": "ok", "sample-cpu-fp32-2L": "ok",
        "costs-triforce": "ok", "costs-plain-forced": "ok"}
    summary = results["summary"]
    [exact] = summary["exactness"]
    assert exact["identical"], exact["divergences"]
    assert exact["drafted"] > 0 and exact["middle_drafted"] > 0, exact  # drafting happened
    assert 0 < exact["accepted"] < exact["drafted"], exact  # both verification paths ran
    [sampled] = summary["distribution"]  # 300 samples: the statistics are the GPU's to judge
    assert sampled["drafted"] > 0 and len(sampled["pvalues"]) == 3, sampled
    assert all(0.0 <= p <= 1.0 for p in sampled["pvalues"]), sampled
    assert sum(sampled["depth_counts"][1:]) > 0 and sampled["depth_counts"][0] > 0, sampled
    tri_syncs = next(r for r in summary["syncs"] if r["job"] == "exact-cpu-fp32-3L")
    assert tri_syncs["propose_max_round"] <= 1 and tri_syncs["propose_max_step"] <= 3
    for row in summary["costs"]:
        assert row["plain_forced_ms"] is None or row["plain_forced_ms"] > 0  # never negative
        assert {"0", "2"} <= set(row["depths"]), row
        assert row["depths"]["2"]["middle_round_ms"] > 0
        assert all(d["step_ms"] is None or d["step_ms"] > 0 for d in row["depths"].values())
        assert row["reference"].startswith("plain vLLM with TriForce's settings"), row
    # resumable: a second run with everything done starts no engine
    again = gpu_check.run(argparse.Namespace(**{**vars(args), "resume": None}))
    assert again["jobs"] == results["jobs"]
    assert "## Costs" in (args.out / "results.md").read_text()


def test_divergences_are_explained_only_below_the_margin():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    margins = [[1.0, 1.0, 0.01, 1.0], [1.0, 1.0, 1.0, 1.0]]
    assert gpu_summary.compare_tokens(ref, ref, margins)["identical"]
    near_tie = gpu_summary.compare_tokens(ref, [[1, 2, 9, 9], [5, 6, 7, 8]], margins)
    assert not near_tie["identical"] and near_tie["explained"]
    assert near_tie["divergences"] == [{"sequence": 0, "position": 2, "plain_margin": 0.01}]
    clear = gpu_summary.compare_tokens(ref, [[1, 2, 3, 4], [5, 0, 7, 8]], margins)
    assert not clear["explained"]  # plain was sure there (margin 1.0): a real difference


def test_an_exact_row_is_compared_only_against_a_reference_of_the_same_models():
    """A later run rebuilt the tiny models (another `model_tag`) and ran the plain
    reference again: the TriForce rows of the earlier models are listed as stale, not
    compared with tokens of other models."""
    def job(tokens, tag):
        return {"status": "ok", "model_tag": tag,
                "result": {"tokens": tokens, "facts": {}, "stats": {"top_proposed": 4}}}

    jobs = {"exact-t-plain": job([[1, 2]], "new"), "exact-t-2L": job([[9, 9]], "old"),
            "exact-t-3L": job([[1, 2]], "new"),
            "sample-t-plain": {"status": "ok", "model_tag": "new",
                               "result": {"samples": [{"1": 10}, {"5": 10}]}},
            "sample-t-2L": {**_sampled([{"1": 10}, {"7": 10}]), "model_tag": "old"}}
    summary = gpu_summary.summarise({"jobs": jobs})
    assert [r["job"] for r in summary["exactness"]] == ["exact-t-3L"]
    assert summary["exactness"][0]["identical"]
    assert summary["distribution"] == []  # the sampled row too: judged by no reference
    assert summary["stale"] == ["exact-t-2L", "sample-t-2L"]
    assert "run them again): exact-t-2L" in gpu_render.render({"jobs": jobs})


def _sampled(counts: list[dict], drafted: int = 100, wrong: float | None = None) -> dict:
    return {"status": "ok", "result": {
        "samples": counts, "sampling": {"temperature": 1.0, "copies": 2000},
        "wrong_temperature": wrong, "reference": "sample-t-plain", "facts": {},
        "stats": {"top_proposed": drafted, "top_accepted": drafted // 2}}}


def test_sampled_jobs_are_judged_against_plain_and_their_negative_control():
    first = {"1": 2000}
    same = [first, {"5": 1000, "6": 1000}, {"7": 1500, "8": 500}]
    near = [first, {"5": 990, "6": 1010}, {"7": 1480, "8": 520}]
    shifted = [first, {"5": 1000, "6": 1000}, {"7": 1800, "8": 200}]
    jobs = {"sample-t-plain": {"status": "ok", "result": {"samples": same}},
            "sample-t-2L": _sampled(near), "sample-t-2L-wrong": _sampled(shifted, wrong=0.5),
            "sample-t-2L-mrv2-wrong": _sampled(near, wrong=0.5),
            "sample-t-2L-idle": _sampled(near, drafted=0)}
    rows = {r["job"]: r for r in gpu_summary._distribution(jobs)}
    assert rows["sample-t-2L"]["verdict"] == "same distribution"
    assert rows["sample-t-2L"]["pvalues"][0] > 0.5  # token 1 (the prefill's) is not judged
    assert rows["sample-t-2L-wrong"]["verdict"] == "caught"
    assert rows["sample-t-2L-wrong"]["pvalues"][1] < gpu_summary.ALPHA
    assert rows["sample-t-2L-mrv2-wrong"]["verdict"].startswith("NOT caught")
    assert rows["sample-t-2L-idle"]["verdict"].startswith("nothing drafted")
    assert "## Sampled output" in gpu_render.render({"jobs": jobs})


def test_cost_model_picks_the_depth_with_most_tokens_per_millisecond():
    # plain 10 ms; depth 2 costs 15 ms for 1 + 0.8 + 0.64 = 2.44 tokens at alpha 0.8
    depths = {"0": {"step_ms": 10.5}, "2": {"step_ms": 15.0}, "6": {"step_ms": 40.0}}
    best = gpu_summary.best_speedup(depths, 10.0, 0.8)
    assert best["depth"] == 2 and best["speedup"] == pytest.approx(2.44 * 10 / 15)


def test_a_later_run_measures_only_the_cases_an_earlier_one_lacks():
    job = {"kind": "costs", "cases": [{"name": "a"}, {"name": "b"}]}
    previous = {"status": "failed", "partial": {"cases": {"a": {"step_ms": 1.0}}}}
    args = argparse.Namespace(redo=False, cases=None)
    left = gpu_check._missing_cases(job, previous, args)
    assert [c["name"] for c in left["cases"]] == ["b"]
    entry = {"status": "ok", "result": {"cases": {"b": {"step_ms": 2.0}}, "facts": {}}}
    merged = gpu_check._merge_cases(previous, entry)
    assert merged["status"] == "ok" and set(merged["result"]["cases"]) == {"a", "b"}
    assert gpu_check._missing_cases(job, merged, args) is None


def _bundle_module():
    spec = importlib.util.spec_from_file_location("gpu_bundle", REPO / "scripts/gpu_bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fatbin(entries) -> bytes:
    """A fatbin of (kind, sm, payload) entries, laid out as CUDA's fatbin header says."""
    body = b""
    for kind, sm, payload in entries:
        header = struct.pack("<HHIQ", kind, 0x101, 64, len(payload))
        header += bytes(28 - len(header)) + struct.pack("<I", sm)
        body += header + bytes(64 - len(header)) + payload
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def _elf_with_section(name: bytes, data: bytes) -> bytearray:
    """A minimal 64-bit ELF: header, shstrtab, one named section, section headers."""
    shstrtab = b"\0.shstrtab\0" + name + b"\0"
    data_off = 64 + len(shstrtab)
    shoff = data_off + len(data)
    elf = bytearray(b"\x7fELF" + bytes(60))
    struct.pack_into("<Q", elf, 0x28, shoff)
    struct.pack_into("<HHH", elf, 0x3A, 64, 3, 1)
    elf += shstrtab + data
    def section(name_off, offset, size):
        sh = bytearray(64)
        struct.pack_into("<I", sh, 0, name_off)
        struct.pack_into("<QQ", sh, 0x18, offset, size)
        return sh
    elf += section(0, 0, 0) + section(1, 64, len(shstrtab)) + section(11, data_off, len(data))
    return elf


def test_bundle_keeps_only_the_code_an_sm90_gpu_loads():
    bundle = _bundle_module()
    with_cubin = [(2, 80, b"A" * 16), (2, 90, b"B" * 16), (1, 80, b"C" * 16)]
    ptx_only = [(2, 80, b"D" * 16), (1, 80, b"E" * 16)]
    section = _fatbin(with_cubin) + bytes(8) + _fatbin(ptx_only)
    elf = _elf_with_section(b".nv_fatbin", section)
    before = bytes(elf)
    kept, zeroed = bundle.keep_only_arch(elf, 90)
    assert (kept, zeroed) == (32, 48)
    assert len(elf) == len(before)  # offsets and headers untouched
    for letter, stays in zip(b"ABCDE", (False, True, False, False, True)):
        assert (bytes([letter]) * 16 in elf) == stays, chr(letter)


def test_bundle_lists_each_runtime_wheel_once_and_pinned():
    bundle = _bundle_module()
    names = [w.split("==")[0].lower() for w in bundle.RUNTIME_WHEELS]
    assert len(names) == len(set(names))
    assert all("==" in w for w in bundle.RUNTIME_WHEELS)


def test_results_render_from_partial_results():
    results = {"runs": [{"date": "2026-11-26", "gpu": "X"}],
               "jobs": {"costs-triforce": {"status": "failed", "error": "timeout",
                                           "partial": {"cases": {"8x32K": {"depths": {
                                               "0": {"step_ms": 10.0, "tokens_per_step": 1.0},
                                           }}}}}}}
    text = gpu_render.render(results)
    assert "8x32K" in text and "failed" in text
    json.dumps(gpu_summary.summarise(results))


def test_the_projection_takes_real_text_acceptance_at_the_cases_budget_ratio(tmp_path):
    """bench acceptance's default-policy rows become results["acceptance"]; each cost case
    projects with the point nearest its budget-to-context ratio, against vLLM's defaults,
    labelled; a plain engine compiled without AOT compile still gives a tax."""
    bench = {"default_policy": "retrieval_var",
             "config": {"model": "/m/qwen", "context_tokens": 16384, "temperature": 0.6},
             "cells": [{"task": "moby", "policy": "retrieval_var", "budget_tokens": 512,
                        "acceptance": 0.7, "greedy_agreement": 0.6},
                       {"task": "moby", "policy": "streamingllm", "budget_tokens": 512,
                        "acceptance": 0.1},
                       {"task": "needle", "policy": "retrieval_var", "budget_tokens": 512,
                        "acceptance": 0.1}],
             "sweep": [{"task": "moby", "policy": "retrieval_var", "budget_tokens": 2048,
                        "acceptance": 0.9, "greedy_agreement": 0.8}]}
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps(bench))
    depths = {"0": {"step_ms": 13.0}, "2": {"step_ms": 20.0}, "6": {"step_ms": 40.0}}
    case = lambda ms: {"status": "ok", "result": {"cases": {  # noqa: E731
        "8x32K": {"step_ms": ms}, "1x128K": {"step_ms": ms}}}}
    results = {"runs": [{"date": "d", "gpu": "X"}], "jobs": {
        "costs-plain-defaults-noaot": case(10.0), "costs-plain-forced": case(12.0),
        "costs-triforce": {"status": "ok", "result": {"cases": {
            "8x32K": {"depths": depths}, "1x128K": {"depths": depths}}}}}}
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(results))
    args = argparse.Namespace(out=out, resume=None, acceptance=[path])
    summary = gpu_check.summarise_only(args)["summary"]
    rows = {r["case"]: r for r in summary["costs"]}
    assert rows["8x32K"]["tax"] == pytest.approx(0.2)  # compiled without AOT is compiled
    wide, narrow = rows["8x32K"]["projection"], rows["1x128K"]["projection"]
    assert wide["measured_at"] == {"context": 16384, "budget": 2048}  # 4096 / 32256 ~ 1/8
    assert narrow["measured_at"] == {"context": 16384, "budget": 512}  # 4096 / 130048 ~ 1/32
    # 1 + 0.9 + 0.81 = 2.71 tokens in 20 ms against 10 ms a token
    assert wide["acceptance"] == 0.9 and wide["depth"] == 2
    assert wide["speedup"] == pytest.approx(2.71 * 10 / 20)
    assert narrow["acceptance"] == 0.7  # 1 + 0.7 + 0.49 tokens in 20 ms
    assert narrow["depth"] == 2 and narrow["speedup"] == pytest.approx(2.19 * 10 / 20)
    assert wide["label"] == gpu_summary.PROJECTION
    text = (out / "results.md").read_text()
    assert gpu_summary.PROJECTION in text and "1.35x at depth 2" in text
    assert json.loads((out / "results.json").read_text())["runs"] == results["runs"]


def test_the_gpu_plan_times_costs_first_and_vllm_defaults_before_forced_settings():
    from vllm_triforce.config import TriForceConfig
    from vllm_triforce.tools.bench.gpu_plan import plan

    models = {"target": "t", "draft": "d", "shape": "s", "tag": "x", "vocab": 1000,
              "sampling": "m", "windowed": "w"}
    names = [job["name"] for job in plan(True, models)]
    assert names[:7] == ["kernels", "costs-plain-defaults", "costs-triforce",
                         "costs-plain-forced", "kv-kept", "kv-plain",
                         "costs-triforce-mrv2"], names
    assert names[7:] and all(n.startswith(("exact-", "sample-", "tax-")) for n in names[7:]), \
        names
    costs = plan(True, models)[1]
    assert [c["name"] for c in costs["cases"]][:2] == ["8x32K", "1x128K"]
    # the KV cache given back: the default coded summaries, no prefill peak, at plain
    # vLLM's setting
    kept = plan(True, models)[4]
    assert kept["spec"]["prefill_from_cache"] and "compact_key_variance" not in kept["spec"]
    assert TriForceConfig.from_speculative_config(kept["spec"]).summary_kinds().coded
    assert kept["llm"]["gpu_memory_utilization"] == costs["llm"]["gpu_memory_utilization"]
    # plain vLLM's blocks at kv-kept's settings: its max_num_seqs and TriForce's forced ones
    same = plan(True, models)[5]
    assert same["llm"]["max_num_seqs"] == kept["llm"]["max_num_seqs"] == 256
    assert same["llm"]["gpu_memory_utilization"] == kept["llm"]["gpu_memory_utilization"]
    assert same["cases"] == kept["cases"] and same.get("spec") is None
    assert same["llm"]["compilation_config"]["cudagraph_mode"] == "PIECEWISE"  # TriForce's
    # ... and its tokens with prefill_from_cache, against the plain job its name leads to
    fromcache = next(job for job in plan(True, models) if job["name"].endswith("-fromcache"))
    assert fromcache["spec"]["prefill_from_cache"]
    assert fromcache["name"].rsplit("-", 1)[0] + "-plain" == fromcache["reference"]


def test_the_lease_calls_name_planned_jobs_and_each_exact_row_finds_its_reference():
    """Every job a `gpu_session.sh` call selects (`--only`, by name prefix) is in the GPU
    plan, every exactness job's reference is a planned plain job, and the summary compares
    each against it (Model Runner V2's and the growing requests' jobs included)."""
    import re

    from vllm_triforce.tools.bench.gpu_plan import plan

    models = {"target": "t", "draft": "d", "shape": "s", "tag": "x", "vocab": 1000,
              "sampling": "m", "windowed": "w"}
    jobs = {job["name"]: job for job in plan(True, models)}
    script = (REPO / "scripts" / "gpu_session.sh").read_text()
    selected = [w for only in re.findall(r"--only\s+(?:\\\n\s*)?([\w,.-]+)", script)
                for w in only.split(",")]
    assert "exact-triton-fp32-grow-2L-mrv2" in selected, selected
    for wanted in selected:
        assert any(name.startswith(wanted) for name in jobs), wanted
    exact = [n for n in jobs if n.startswith("exact-") and not n.endswith("-plain")]
    assert {"exact-triton-fp32-2L-mrv2", "exact-triton-fp32-grow-2L-mrv2"} <= set(exact)
    for name in exact:
        assert jobs[name]["reference"] in jobs and jobs[name]["reference"].endswith("-plain")
    grow = jobs["exact-triton-fp32-grow-2L-mrv2"]
    assert grow["spec"]["adaptive"] and grow["env"]["VLLM_TRIFORCE_MRV2"] == "1"
    assert jobs["exact-triton-fp32-grow-2L-mrv2-async"]["llm"]["async_scheduling"]
    assert not grow["llm"].get("async_scheduling")
    full = jobs["exact-flash-bf16-grow-2L-mrv2-full"]  # vLLM's defaults, on MRV2
    assert full["llm"]["compilation_config"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert full["llm"]["async_scheduling"] and not full["llm"]["enforce_eager"]
    assert "env" not in jobs[full["reference"]] and not jobs[full["reference"]]["llm"][
        "enforce_eager"]
    assert jobs["costs-triforce-mrv2"]["env"]["VLLM_TRIFORCE_MRV2"] == "1"
    # a target with sliding-window layers, against its own plain run
    window = jobs["exact-flash-bf16-window-2L"]
    assert window["model"] == jobs[window["reference"]]["model"] == "w"
    assert window["model_tag"] == jobs[window["reference"]]["model_tag"] != jobs[
        "exact-flash-bf16-plain"]["model_tag"]
    graphed = jobs["exact-flash-bf16-window-2L-graphs"]  # the same, its passes graphed
    assert graphed["spec"]["round_graphs"] and graphed["reference"] == window["reference"]
    assert not window["spec"].get("round_graphs")
    assert max(len(p) for p in grow["prompts"]) <= grow["spec"]["retrieval_budget"]
    # the sampled jobs: every TriForce one against the plain one, on both runners, each
    # binding beside its negative control
    sampled = [n for n in jobs if n.startswith("sample-") and not n.endswith("-plain")]
    assert {"sample-triton-fp32-2L-mrv2", "sample-triton-fp32-2L-mrv2-wrong",
            "sample-triton-fp32-2L-wrong", "sample-triton-fp32-2L-mrv2-async",
            "sample-triton-fp32-2L-compiled"} <= set(sampled)
    assert all(jobs[n]["reference"] == "sample-triton-fp32-plain" for n in sampled)
    assert all(n in selected for n in sampled + ["sample-triton-fp32-plain"]), selected
    assert len({jobs[n]["llm"]["seed"] for n in sampled + ["sample-triton-fp32-plain"]}) == \
        len(sampled) + 1  # no two engines draw from one random stream
    tokens = [[1, 2, 3]]
    results = {"jobs": {
        name: {"status": "ok", "result": {"tokens": tokens, "reference": jobs[name]["reference"],
                                          "facts": {}, "stats": {"top_proposed": 4}}}
        for name in exact}}
    results["jobs"].update({name: {"status": "ok", "result": {"tokens": tokens}}
                            for name in jobs if name.endswith("-plain")})
    rows = gpu_summary.summarise(results)["exactness"]
    assert sorted(row["job"] for row in rows) == sorted(exact)
    assert all(row["identical"] for row in rows)


def test_triforce_on_vllms_defaults_is_read_against_vllms_defaults():
    """costs-triforce-mrv2's depth-0 step over costs-plain-defaults' (issue 60's number),
    in the summary and on the page."""
    def costs(depths=None, step=None):
        case = {"depths": depths} if depths else {"step_ms": step}
        return {"status": "ok", "result": {"cases": {"8x32K": case}}}

    results = {"jobs": {"costs-plain-defaults": costs(step=12.5),
                        "costs-triforce-mrv2": costs({"0": {"step_ms": 12.75},
                                                      "6": {"step_ms": 20.0}})}}
    row, = gpu_summary.summarise(results)["costs"]
    assert row["mrv2_depth0_of_defaults"] == pytest.approx(1.02)
    page = gpu_render.render({"runs": [{"date": "2026-11-29", "gpu": "X"}], **results})
    assert "8x32K: depth 0: 12.8 ms; depth 6: 20 ms, depth 0 at 1.02x" in page, page


def test_a_step_lost_in_noise_is_timed_longer_and_never_negative():
    from vllm_triforce.tools.bench.step_timing import decode_step

    calls = []

    def noisy(m):  # 1 ms a step; 40 ms of noise on the short calls of the first 4 pairs
        calls.append(m)
        return (0.001 * m + (0.04 if m == 8 and len(calls) <= 8 else 0.0), m)

    measured = decode_step(noisy, 8, 16, repeats=2)
    assert measured["long"] == 64 and abs(measured["step_s"] - 0.001) < 1e-9, measured
    lost = decode_step(lambda m: (0.5 if m == 8 else 0.1, m), 8, 16, repeats=2, max_long=32)
    assert lost["step_s"] is None and lost["overhead_s"] is None, lost


def test_a_compile_failure_retries_without_aot_then_eager_and_says_so():
    job = {"name": "costs-triforce", "kind": "costs", "llm": {"compilation_config": {}},
           "env": {"A": "1"}}
    assert gpu_check._compile_failure({"error": "torch._inductor.exc.InductorError: x"})
    assert not gpu_check._compile_failure({"error": "CUDA out of memory"})
    no_aot = gpu_check._no_aot(job)
    assert no_aot["name"] == "costs-triforce-noaot"
    assert no_aot["env"] == {"A": "1", "VLLM_USE_AOT_COMPILE": "0"}
    eager = gpu_check._eager(no_aot)
    assert eager["name"] == "costs-triforce-eager" and eager["llm"] == {"enforce_eager": True}
    jobs = {"costs-plain-defaults-eager": {"status": "ok", "result": {"cases": {
                "8x32K": {"step_ms": 30.0}}}},
            "costs-plain-forced": {"status": "ok", "result": {"cases": {
                "8x32K": {"step_ms": 31.0}}}}}
    [row] = gpu_summary.summarise({"jobs": jobs})["costs"]
    assert row["engines"]["plain_defaults"] == "eager (compiled engine failed)"
    assert row["tax"] is None  # eager against compiled is no tax
    assert row["reference"] == "vLLM defaults"


def test_the_kv_kept_ratio_takes_plain_vllm_at_the_same_settings():
    """TriForce's KV blocks (kv-kept) against plain vLLM's at its own max_num_seqs
    (kv-plain) where that ran, else against the cost cases' plain engine, whose
    max_num_seqs the summary names beside the ratio."""
    from vllm_triforce.tools.bench.gpu_summary import _memory

    def job(blocks, seqs):
        return {"result": {"facts": {"num_gpu_blocks": blocks, "max_num_seqs": seqs}}}

    jobs = {"costs-triforce": job(46_225, 256), "costs-plain-forced": job(55_604, 64),
            "kv-kept": job(53_320, 256)}
    older = _memory(jobs)["kv_kept"]
    assert (older["plain_blocks"], older["plain_max_num_seqs"]) == (55_604, 64)
    same = _memory({**jobs, "kv-plain": job(55_000, 256)})["kv_kept"]
    assert (same["plain_blocks"], same["plain_max_num_seqs"]) == (55_000, 256)
    assert same["of_plain"] == 53_320 / 55_000


def test_the_tax_split_changes_one_of_triforces_settings_at_a_time():
    """Issue 60's first GPU question (`gpu_session.sh tax`): plain vLLM at the 8B shape,
    from vLLM's defaults toward TriForce's settings one setting at a time (async off, then
    PIECEWISE too; the V1 runner alone), graphs cut to the decode batches; then an n-gram engine whose every step verifies 1 + K tokens per
    request on a FULL graph of exactly that size. Last in the plan: asked for by name."""
    from vllm_triforce.tools.bench.gpu_plan import TAX_SPEC, plan

    models = {"target": "t", "draft": "d", "shape": "s", "tag": "x", "vocab": 1000,
              "sampling": "m", "windowed": "w"}
    jobs = plan(True, models)
    names = [j["name"] for j in jobs]
    tax = [j for j in jobs if j["name"].startswith("tax-")]
    assert names[-len(tax):] == [j["name"] for j in tax] and len(tax) == 6, names
    defaults = next(j for j in jobs if j["name"] == "costs-plain-defaults")
    forced = next(j for j in jobs if j["name"] == "costs-plain-forced")

    def settings(job):  # (V2 runner, graph mode, async), None where vLLM's default
        return (job.get("env", {}).get("VLLM_USE_V2_MODEL_RUNNER", "1"),
                job["llm"].get("compilation_config", {}).get("cudagraph_mode",
                                                            "FULL_AND_PIECEWISE"),
                job["llm"].get("async_scheduling", True))

    base, target = settings(defaults), settings(forced)
    assert base == ("1", "FULL_AND_PIECEWISE", True) and target == ("0", "PIECEWISE", False)

    def changed(job, against):  # which settings differ, each toward TriForce's
        diff = {i for i, (a, b) in enumerate(zip(settings(job), settings(against))) if a != b}
        assert all(settings(job)[i] == target[i] for i in diff), job["name"]
        return diff

    # both ends again, in the same lease (the cost jobs' may be another card's)
    again_defaults, sync, piecewise, v1, again_forced = tax[:5]
    assert settings(again_defaults) == base and settings(again_forced) == target
    assert changed(sync, defaults) == {2}  # async scheduling off
    assert changed(piecewise, sync) == {1}  # and PIECEWISE graphs
    assert changed(v1, defaults) == {0}  # the V1 runner alone
    for job in tax[:5]:
        assert [c["name"] for c in job["cases"]] == ["8x32K", "1x128K"]
        assert job["llm"]["compilation_config"]["cudagraph_capture_sizes"] == [1, 8]
        assert job["llm"]["load_format"] == "dummy" and "spec" not in job
    spec = tax[5]
    assert spec["spec"] == TAX_SPEC and spec["spec"]["method"] == "ngram_gpu"
    assert settings(spec) == base and [c["name"] for c in spec["cases"]] == ["8x32K"]
    k = TAX_SPEC["num_speculative_tokens"]
    assert spec["llm"]["compilation_config"]["cudagraph_capture_sizes"] == [8 * (1 + k)]
    # random prompts hold no repeated n-gram of this length, and the decode adds fewer
    assert TAX_SPEC["prompt_lookup_min"] > max(spec["decode_tokens"])
    assert not any(j["name"].startswith("tax-") for j in plan(False, models))


def test_the_tax_split_is_read_against_vllms_defaults():
    def costs(step, engine="compiled", **extra):
        return {"status": "ok", "result": {"cases": {"8x32K": {"step_ms": step, **extra}}}}

    results = {"jobs": {
        "costs-plain-defaults": costs(12.5), "costs-plain-forced": costs(15.0),
        "tax-v2-full-sync": costs(13.75), "tax-v2-piecewise-sync": costs(14.0),
        "tax-v1-full-async": costs(12.5),
        "tax-spec-filler": costs(13.0, draft_tokens_per_draft=6.0, acceptance=0.0),
        "costs-triforce-mrv2": {"status": "ok", "result": {"cases": {"8x32K": {
            "depths": {"0": {"step_ms": 15.0}}}}}}}}
    [row] = gpu_summary.summarise(results)["tax"]
    ratios = {e["job"]: e["of_defaults"] for e in row["settings"]}
    assert ratios["tax-v2-full-sync"] == pytest.approx(1.1)
    assert ratios["costs-plain-forced"] == pytest.approx(1.2)
    assert row["mrv2_depth0_ms"] == 15.0
    page = gpu_render.render({"runs": [{"date": "2026-12-02", "gpu": "X"}], **results})
    assert "## Where the tax goes" in page
    assert "| 8x32K | V2, FULL_AND_PIECEWISE, sync | 13.8 | 1.10x |" in page, page
    assert "(V2, FULL_AND_PIECEWISE, async; costs-plain-defaults) | 12.5 | 1 |" in page, page
    assert "6 draft tokens a request-step, acceptance 0" in page, page
    assert gpu_summary.summarise({"jobs": {"costs-plain-defaults": costs(12.5)}})["tax"] == []
    # the split's own ends, run in the same lease, are preferred to the cost jobs'
    results["jobs"].update({"tax-defaults": costs(10.0), "tax-forced": costs(13.0)})
    [row] = gpu_summary.summarise(results)["tax"]
    assert row["reference"] == "tax-defaults" and row["defaults_ms"] == 10.0
    ratios = {e["job"]: e["of_defaults"] for e in row["settings"]}
    assert "costs-plain-forced" not in ratios and ratios["tax-forced"] == pytest.approx(1.3)
    assert ratios["tax-v2-full-sync"] == pytest.approx(1.375)


@pytest.mark.engine
def test_a_spec_decode_engine_s_steps_and_drafts_are_counted_not_assumed(tiny_llama,
                                                                         tiny_draft):
    """The cost job of an engine with another drafter (the tax split's n-gram engine; here
    vLLM's own draft-model speculation with a tiny draft, which needs no numba in this
    process: vLLM's CPU n-gram imports it, and its objects then break vLLM's kernel
    dispatcher's scan of sys.modules in every later engine of the process): ms per model
    step, with the steps counted and vLLM's own spec-decode counters over the decodes, so
    a step that verified drafts is not mistaken for a 1-token step."""
    from vllm_triforce.tools.bench.gpu_costs import run_costs

    job = {"kind": "costs", "model": str(tiny_llama), "prompt_vocab": 500,
           "spec": {"method": "draft_model", "model": str(tiny_draft),
                    "num_speculative_tokens": 3},
           "cases": [{"name": "2x256", "batch": 2, "context": 256}], "decode_tokens": (4, 12),
           "llm": {"dtype": "float32", "max_model_len": 1024, "seed": 0,
                   "enforce_eager": True, "block_size": 32}}
    result = run_costs(job)
    case = result["cases"]["2x256"]
    assert result["facts"]["speculative_method"] == "draft_model"
    assert case["step_ms"] is not None and case["step_ms"] > 0, case
    counters = case["spec_counters"]
    assert counters["vllm:spec_decode_num_drafts"] > 0, counters  # drafting happened
    assert case["draft_tokens_per_draft"] == 3, case  # a draft model drafts K every step
    # counted model steps: at most one a token, fewer where drafts were accepted
    for short, long in case["timing"]["pairs"]:
        assert 0 < short[1] <= 4 and short[1] < long[1] <= case["timing"]["long"]
