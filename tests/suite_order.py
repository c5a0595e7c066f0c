"""The order of the suite's test files (scripts/test.sh, tests/conftest.py)."""

# The test files that take longest, longest first: seconds of one run of the suite
# (`scripts/test.sh --junitxml`, summed per file) on a 2-vCPU AMD EPYC (family 25, AVX-512),
# 2026-12-01 (1,970 worker-seconds; about 3,550 on a 2-vCPU EPYC with AVX2 only).
# scripts/test.sh hands whole files to two workers in collection order
# (`--no-loadscope-reorder`), so these go first and the short files fill the end: the two
# workers finish together (about 70 s sooner than xdist's order by test count, whose last
# file ran alone on one worker). A file missing here runs after them, in collection order.
LONGEST_FIRST = (
    "tests/test_triforce_engine.py",  # 285
    "tests/test_readme_serve.py",  # 202
    "tests/test_gpu_check.py",  # 133
    "tests/test_bench.py",  # 129
    "tests/test_serving_plumbing.py",  # 123
    "tests/test_memory_plan.py",  # 109
    "tests/test_bench_serve.py",  # 94
    "tests/test_fp8_kv_cache.py",  # 82
    "tests/test_round_graphs.py",  # 80
    "tests/test_flex_backend.py",  # 78
    "tests/test_demo.py",  # 58
    "tests/test_capture.py",  # 54
    "tests/test_doctor.py",  # 52
    "tests/test_patches_sampling.py",  # 46
    "tests/test_serving_load.py",  # 43
    "tests/test_triforce_sampling.py",  # 42
    "tests/test_chat.py",  # 42
    "tests/core/test_core_fused_reads.py",  # 41
    "tests/test_engine_depth_rules.py",  # 41
    "tests/test_syncs.py",  # 29
    "tests/test_gpu_model_carry.py",  # 28
    "tests/test_gpu_safety.py",  # 23
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
