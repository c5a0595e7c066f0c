"""The `[gpu]` extra's pip resolutions that tests/test_gpu_install.py checks, started as soon
as the suite is collected (tests/conftest.py `pytest_collection_finish`), not when the test
comes up: they wait on the network, not on the cores, so they run beside the tests that use
the cores. Run when the test came up they held a worker for 32 s (a 2-vCPU AMD EPYC on a
fast network) to 102 s (a slower one), waiting.

What runs is what a GPU user's `pip install -e ".[gpu]"` does, minus the install (see
tests/test_gpu_install.py). Under pytest-xdist the first worker to collect starts both
resolutions into a folder named by the run's id; whichever worker runs the test reads them.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Machine-local pip settings a GPU user does not have: a folder holding torch 2.13.0+cpu,
# a torch version cap, and local mirror indexes.
LOCAL_PIP_ENV = ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_EXTRA_INDEX_URL")
PINS = {"unpinned": (), "vllm==0.32.0": ("vllm==0.32.0",)}
TEST = "tests/test_gpu_install.py::test_gpu_extra_resolves_to_cuda_vllm"
TIMEOUT_S = 600


def folder(config) -> Path:
    """This run's folder: one per xdist run (its workers share the run's id), else per
    process."""
    run = getattr(config, "workerinput", {}).get("testrunuid") or f"pid{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"vllm-triforce-pip-{run}"


def start_if_selected(session) -> None:
    """Start both resolutions if the test is among the collected items and no other worker
    of this run has started them."""
    if any(item.nodeid.startswith(TEST) for item in session.items):
        start(folder(session.config))


def start(where: Path) -> None:
    try:
        where.mkdir()  # atomic: one worker of the run starts them
    except FileExistsError:
        return
    env = {k: v for k, v in os.environ.items() if k not in LOCAL_PIP_ENV}
    env["PIP_CONFIG_FILE"] = os.devnull  # no config files (they hold the same local settings)
    for pin, also in PINS.items():
        pin_dir = where / _name(pin)
        pin_dir.mkdir()
        cmd = shlex.join([sys.executable, "-m", "pip", "install", "--dry-run",
                          "--ignore-installed", "--use-feature=fast-deps", "--quiet",
                          "--report", "report.json", f"vllm-triforce[gpu] @ {REPO.as_uri()}",
                          *also])
        # the exit status lands last, in one rename: its file's presence means done
        subprocess.Popen(["sh", "-c", f"{cmd} > /dev/null 2> stderr.txt; echo $? > rc.tmp; "
                          "mv rc.tmp rc"], env=env, cwd=pin_dir, start_new_session=True,
                         stdin=subprocess.DEVNULL)


def results(where: Path) -> dict[str, dict[str, str]]:
    """{pin: {name: version} pip picked}, waiting for each resolution (started now if
    nothing started them); the folder is removed once read."""
    start(where)
    picked = {}
    deadline = time.monotonic() + TIMEOUT_S
    for pin in PINS:
        pin_dir = where / _name(pin)
        while not (pin_dir / "rc").exists():
            assert time.monotonic() < deadline, f"{pin}: pip did not finish in {TIMEOUT_S} s"
            time.sleep(1.0)
        rc = int((pin_dir / "rc").read_text())
        assert rc == 0, f"{pin}: {(pin_dir / 'stderr.txt').read_text()[-3000:]}"
        install = json.loads((pin_dir / "report.json").read_text())["install"]
        picked[pin] = {item["metadata"]["name"].lower().replace("_", "-"):
                       item["metadata"]["version"] for item in install}
    shutil.rmtree(where, ignore_errors=True)
    return picked


def _name(pin: str) -> str:
    return pin.replace("=", "-")
