"""The README's demo command (`bash scripts/demo.sh`), run through the script itself with
small knobs (the default size takes minutes): side-by-side speeds, the depth controller's
choices, and the identity verdict with the draft counts behind it, exit 0 only when every
output equals plain vLLM's and the fixed-depth run drafted."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.network
def test_demo_script_runs_and_outputs_are_identical(smollm2):
    proc = subprocess.run(
        ["bash", "scripts/demo.sh", "--prompt-tokens", "512", "--batch", "2",
         "--max-tokens", "12", "--budget", "192"],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for line in ("plain vLLM", "Both engines run with", "TriForce, controller", "TriForce, depth 6",
                 "depth controller: ", "outputs identical to plain vLLM: YES", "vLLM's log: ",
                 "round 3 of 3", "Where TriForce pays"):
        assert line in out, out
    assert len(out.splitlines()) <= 40, out  # vLLM's own log goes to its file
    log = re.search(r"vLLM.s log: (\S+);", out)[1]
    assert "Initializing a V1 LLM engine" in Path(log).read_text()
    drafts = re.search(r"outputs identical to plain vLLM: YES \(drafts verified by vLLM, "
                       r"proposed / accepted: controller (\d+) / (\d+), fixed k=6 (\d+) / (\d+)",
                       out)
    assert drafts, out
    proposed, accepted = int(drafts[3]), int(drafts[4])
    assert proposed >= accepted and proposed > 0  # the fixed-depth run drafted

