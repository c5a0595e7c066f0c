"""The order of the suite's test files (scripts/test.sh, tests/conftest.py)."""

# The test files that take longest, longest first: seconds of one run of the suite
# (`scripts/test.sh --junitxml`, summed per file) on a 2-vCPU AMD EPYC (family 25, AVX-512),
# 2026-12-03 (2,358 worker-seconds, 1,216 s wall; about 3,550 worker-seconds on a 2-vCPU EPYC
# with AVX2 only, 2026-12-01).
# scripts/test.sh hands whole files to two workers in collection order
# (`--no-loadscope-reorder`), so these go first and the short files fill the end: the two
# workers finish together (about 70 s sooner than xdist's order by test count, whose last
# file ran alone on one worker). A file missing here runs after them, in collection order.
LONGEST_FIRST = (
    "tests/test_triforce_engine.py",  # 346
    "tests/test_readme_serve.py",  # 293
    "tests/test_serving_plumbing.py",  # 189
    "tests/test_window_layers.py",  # 150 (added after that run: its own run)
    "tests/test_bench.py",  # 137
    "tests/test_gpu_check.py",  # 130
    "tests/test_bench_serve.py",  # 129
    "tests/test_memory_plan.py",  # 122
    "tests/test_triforce_sampling.py",  # 104
    "tests/test_flex_backend.py",  # 82
    "tests/test_round_graphs.py",  # 78
    "tests/test_engine_depth_rules.py",  # 63
    "tests/test_demo.py",  # 62
    "tests/test_doctor.py",  # 57
    "tests/test_mrv2_adapter.py",  # 56
    "tests/test_mrope.py",  # 56 (added after that run: its own run)
    "tests/test_capture.py",  # 54
    "tests/test_patches_sampling.py",  # 51
    "tests/test_chat.py",  # 47
    "tests/test_serving_load.py",  # 44
    "tests/test_lora.py",  # 45 (added after that run: its own run)
    "tests/test_kv_connector.py",  # 40 (added after that run: its own run)
    "tests/test_sampling_params.py",  # 44 (added after that run: its own run)
    "tests/core/test_core_fused_reads.py",  # 36
    "tests/test_syncs.py",  # 34
    "tests/test_drafting_cap.py",  # 33
    "tests/test_plain_steps.py",  # 31
    "tests/test_gpu_model_carry.py",  # 31
    "tests/test_fp8_kv_cache.py",  # 27
    "tests/test_gpu_safety.py",  # 22
)

# Files that run last: their tests wait on work started when the suite was collected (the
# `[gpu]` extra's pip resolutions, tests/pip_resolutions.py), done by then.
LAST = ("tests/test_gpu_install.py",)


def longest_files_first(items) -> None:
    """Sorts pytest's `items` in place: the files of LONGEST_FIRST first, in its order; the
    others after, as collected; LAST's at the end (tests/conftest.py's
    `pytest_collection_modifyitems`)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    rank.update({path: len(LONGEST_FIRST) + 1 + i for i, path in enumerate(LAST)})
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(LONGEST_FIRST)))
