"""benchmarks/RESULTS.md is generated (`vllm-triforce bench report`), not written by hand.

No engine: the page is built from the committed run folders' results.json and
benchmarks/cases.json. If a test here fails after a new run, rerun the command
(`vllm-triforce bench report`) and commit the page with the run.
"""

import json
import re
from pathlib import Path

import pytest

from vllm_triforce.tools.bench import results_page

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
INDEX = BENCH / "cases.json"
MAX_LINES = 250  # one page, not a notebook
NOT_RUNS = {"explore", "history"}  # exploration scripts; superseded runs
# gpu/: the GPU check's resumable output, which scripts/gpu_run.sh resumes from by that name
UNDATED = {"gpu"}
# history/ folders of numbered runs (run1, run2, ...), named as HISTORY.md maps them to commits
NUMBERED_SERIES = ["hierarchy_controller", "kv_bound_controller"]


def test_committed_page_is_what_the_command_writes():
    assert (BENCH / "RESULTS.md").read_text() == results_page.build_page(INDEX), (
        "benchmarks/RESULTS.md is not what `vllm-triforce bench report` writes: run it")


def test_page_is_one_page_about_the_software():
    page = (BENCH / "RESULTS.md").read_text()
    assert len(page.splitlines()) <= MAX_LINES
    assert not re.search(r"\bsessions?\b|\bsitting\b|_s\d\d", page, re.IGNORECASE)


def test_page_links_only_what_exists():
    page = (BENCH / "RESULTS.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)\)", page)
    assert targets
    assert [t for t in targets if not (BENCH / t).exists()] == []


def test_every_run_folder_is_a_case_or_history():
    """A new run folder beside RESULTS.md must be indexed (or moved under history/); a case
    may live in a folder of another's (gpu/real_model_<date>/ in gpu/)."""
    indexed = {case.folder.split("/")[0] for case in results_page.load_cases(INDEX)}
    folders = {p.name for p in BENCH.iterdir() if p.is_dir()} - NOT_RUNS
    assert folders == indexed


def test_run_folders_are_named_by_case_and_date():
    names = [p.name for p in BENCH.iterdir() if p.is_dir()] + [
        p.name for p in (BENCH / "history").iterdir() if p.is_dir()]
    dated = re.compile(r"^[a-z0-9_]+_\d{4}-\d{2}-\d{2}(_\d+)?$")
    odd = [n for n in names if n not in NOT_RUNS | UNDATED and not dated.match(n)]
    assert sorted(odd) == NUMBERED_SERIES


def test_history_reaches_every_old_run():
    history = (BENCH / "HISTORY.md").read_text()
    old_runs = [p.name for p in (BENCH / "history").iterdir() if p.is_dir()]
    assert [n for n in old_runs if f"history/{n}/" not in history] == []


def test_readme_results_table_is_taken_from_the_page():
    """Each cell a sentence of <= 300 characters; every decimal in it is on RESULTS.md."""
    readme = (BENCH.parent / "README.md").read_text()
    start = readme.index("| case (latest run) | result |")
    rows = readme[start:].split("\n\n")[0].splitlines()[2:]
    cells = [c.strip() for row in rows for c in row.strip("| ").split(" | ")]
    assert rows and max(len(c) for c in cells) <= 300
    page = (BENCH / "RESULTS.md").read_text()
    assert [n for c in cells for n in re.findall(r"\d+\.\d+", c) if n not in page] == []


# ------------------------------------------------------------------ hand-worked tiny cases

def _speed_run(tmp_path: Path, **case_over) -> Path:
    """A one-case index and a two-row `bench speed` folder written by hand."""
    folder = tmp_path / "kv_2026-01-02"
    folder.mkdir()
    rows = [
        {"method": "plain", "decode_tok_s": 10.0, "speedup": 1.0, "round_speedups": [1.0, 1.0],
         "top_acceptance": None, "middle_acceptance": None, "identical": True,
         "controller": None},
        {"method": "triforce2", "decode_tok_s": 12.5, "speedup": 1.25,
         "round_speedups": [1.3, 1.2], "top_acceptance": 0.75, "middle_acceptance": None,
         "identical": True, "controller": {"plain_steps": 3, "steps": 10}},
    ]
    config = {"prompt_tokens": 64, "batch": 2, "max_tokens": 8, "repeats": 1, "rounds": 2,
              "budget": 32, "gamma": [6], "dtype": "float32", "model": "/m/tiny", "draft": None}
    (folder / "results.json").write_text(
        json.dumps({"config": config, "rows": rows, "all_identical": True}))
    (folder / "speed.png").write_bytes(b"")
    case = {"case": "kv", "kind": "speed", "title": "Tiny", "folder": folder.name,
            "command": f"vllm-triforce bench speed --out benchmarks/{folder.name}",
            "shows": "What it shows.", "machine": "a CPU", "date": "2026-01-02",
            "commit": "abc1234", **case_over}
    index = tmp_path / "cases.json"
    index.write_text(json.dumps({"cases": [case]}))
    return index


def test_tiny_speed_case(tmp_path):
    page = results_page.build_page(_speed_run(tmp_path))
    assert "| triforce2 | controller | 12.5 | 1.25x (1.30, 1.20) | 0.750 | 3 of 10 | yes |" in page
    assert "| plain |  | 10.0 | 1.00x (1.00, 1.00) |  |  | yes |" in page
    assert "| `kv` | [kv_2026-01-02/](kv_2026-01-02/) | plain 10.0 tok/s; triforce2 " \
           "controller 1.25x; outputs identical |" in page
    assert "[speed.png](kv_2026-01-02/speed.png)" in page
    assert "2026-01-02, commit abc1234; a CPU (machine, date, commit from cases.json" in page


def test_unrecorded_machine_must_be_in_the_index(tmp_path):
    index = _speed_run(tmp_path, machine=None)
    with pytest.raises(ValueError, match="does not record its machine"):
        results_page.build_page(index)


def test_command_must_write_the_case_folder(tmp_path):
    index = _speed_run(tmp_path, command="vllm-triforce bench speed --out /tmp/elsewhere")
    with pytest.raises(ValueError, match="must write its folder"):
        results_page.load_cases(index)
