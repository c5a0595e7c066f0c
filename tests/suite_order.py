"""The order of the suite's test files (scripts/test.sh, tests/conftest.py)."""

# The test files that take longest, longest first: seconds of one run of the suite
# (`scripts/test.sh --junitxml`, summed per file) on a 2-core AMD EPYC with AVX2, 2026-11-30,
# less what that day's later trims took off (the one-process CLI test, parsers without torch).
# scripts/test.sh hands whole files to two workers in collection order
# (`--no-loadscope-reorder`), so these go first and the short files fill the end: the two
# workers finish together (about 70 s sooner than xdist's order by test count, whose last
# file ran alone on one worker). A file missing here runs after them, in collection order.
LONGEST_FIRST = (
    "tests/test_readme_serve.py",  # 394
    "tests/test_triforce_engine.py",  # 377
    "tests/test_memory_plan.py",  # 224
    "tests/test_gpu_check.py",  # 175
    "tests/test_serving_plumbing.py",  # 168
    "tests/test_bench.py",  # 158
    "tests/test_bench_serve.py",  # 145
    "tests/test_demo.py",  # 111
    "tests/test_gpu_install.py",  # 102
    "tests/test_flex_backend.py",  # 93
    "tests/test_engine_depth_rules.py",  # 90
    "tests/test_doctor.py",  # 89
    "tests/test_chat.py",  # 79
    "tests/test_triforce_sampling.py",  # 79
    "tests/test_serving_load.py",  # 77
    "tests/test_patches_sampling.py",  # 74
    "tests/test_capture.py",  # 72
    "tests/test_round_graphs.py",  # 63
    "tests/test_gpu_model_carry.py",  # 60
    "tests/test_plain_steps.py",  # 54
    "tests/test_syncs.py",  # 54
    "tests/test_gpu_safety.py",  # 24
    "tests/test_mrv2_adapter.py",  # 22
)


def longest_files_first(items) -> None:
    """Sorts pytest's `items` in place: the files of LONGEST_FIRST first, in its order; the
    others after, as collected (tests/conftest.py's `pytest_collection_modifyitems`)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
