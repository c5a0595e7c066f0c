#!/usr/bin/env python3
"""Build an offline bundle of vLLM for an air-gapped GPU machine that already has PyTorch.

Run where PyPI is reachable; carry `.bundle/` to the GPU machine (scp, a USB disk, a
64 MiB-per-call sandbox) and run `bash scripts/gpu_run.sh` there, from this repository.

Why it works without vLLM's pinned torch: the official `vllm` wheel's compiled kernels
(`vllm/_C_stable_libtorch.abi3.so`, FlashAttention 3's `_vllm_fa3_C.abi3.so`) are built on
PyTorch's stable C ABI: they import only `aoti_torch_*` / `torch_*` shim symbols, which a
torch older than vLLM's pin (2.11 for vLLM 0.32, which pins 2.13) exports too. The bundle
takes vLLM's Python from the wheel, those two kernel libraries, the wheels of the runtime
dependencies `LLM.generate` needs that a torch + transformers image lacks, and one real
tokenizer (SmolLM2's) for the check's models.

Size. The kernel libraries hold machine code for every GPU architecture vLLM supports
(sm_75 ... sm_120); a GPU loads only its own. `--arch 90` (Hopper: H100, H200) zeroes the
fatbin entries that an sm_90 GPU never loads (other architectures' cubins, and PTX where the
same fatbin has an sm_90 cubin), so they compress to nothing: `_C_stable_libtorch` 54 MB ->
14 MB xz. Headers and offsets are untouched, so the file stays a valid library; on another
architecture its kernels are missing (`--arch all` keeps everything).

Output (`--out`, default .bundle/, git-ignored): vllm-python.tar.xz, vllm-kernels.tar.xz,
wheels/, tokenizer/, MANIFEST.sha256 (checked by gpu_run.sh). The script refuses to finish
when the bundle exceeds `--max-mib` (default 60), so that it fits one carry.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64")
KERNELS = ("vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")
# What `LLM.generate` (and this plugin) import from vLLM 0.32 / 0.33 beyond a torch 2.11 +
# transformers 5.17 image (the lent GPU machines' package list): found by importing, under
# that image's packages and a stub libcuda, every vLLM module a CPU engine run of the GPU
# check loads, and vLLM's engine, worker, attention backends and model code (0.33 adds
# orjson). Pinned so the bundle is reproducible.
RUNTIME_WHEELS = (
    "annotated-doc==0.0.7", "annotated-types==0.8.0", "anyio==4.16.0",
    "apache-tvm-ffi==0.1.11", "blake3==1.0.11", "cachetools==8.0.2", "cbor2==6.3.0",
    "compressed-tensors==0.17.0", "dill==0.4.1", "loguru==0.7.3",
    "fastapi==0.136.3", "httpcore2==2.16.2", "httpx2==2.16.2", "jiter==0.19.0",
    "llguidance==1.7.6", "msgspec==0.22.0", "openai==3.57.0", "orjson==3.13.0",
    "oss-harmony==0.0.11",
    "partial-json-parser==0.2.1.1.post7", "pybase64==1.5.1", "pydantic==2.14.4",
    "pydantic-core==2.50.5", "python-json-logger==4.2.0", "pyzmq==27.3.0",
    "setproctitle==1.3.8", "sniffio==1.3.1", "starlette==1.10.0", "truststore==0.10.5",
    "typing-extensions==4.16.0", "typing-inspection==0.4.5", "xgrammar==0.2.8",
)
PYTHON_SUFFIXES = (".py", ".json", ".jinja", ".typed", ".txt", "METADATA", "RECORD", "WHEEL",
                   "entry_points.txt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
MANIFEST = "MANIFEST.sha256"
FATBIN_MAGIC = 0xBA55ED50
ELF_KIND, PTX_KIND = 2, 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm", default="0.32.0", help="vLLM version (0.32.x or 0.33.x)")
    p.add_argument("--arch", default="90",
                   help="GPU architecture to keep kernels for (90: H100/H200), or 'all'")
    p.add_argument("--out", type=Path, default=REPO / ".bundle")
    p.add_argument("--max-mib", type=float, default=60.0)
    p.add_argument("--cache", type=Path,
                   default=Path(os.environ.get("VLLM_TRIFORCE_CACHE",
                                               Path.home() / ".cache" / "vllm-triforce"))
                   / "gpu-bundle")
    args = p.parse_args(argv)
    build(args.vllm, args.arch, args.out, args.cache)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"bundle: {args.out} {size / 2**20:.1f} MiB")
    if size > args.max_mib * 2**20:
        print(f"bundle: larger than --max-mib {args.max_mib}", file=sys.stderr)
        return 1
    return 0


def build(version: str, arch: str, out: Path, cache: Path) -> None:
    wheel = download([f"vllm=={version}"], cache / "vllm")[0]
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        write_python(zf, out / "vllm-python.tar.xz")
        write_kernels(zf, out / "vllm-kernels.tar.xz", arch)
    for whl in download(list(RUNTIME_WHEELS), cache / "wheels"):
        shutil.copy2(whl, out / "wheels" / whl.name)
    copy_tokenizer(out / "tokenizer")
    write_manifest(out)


def download(requirements: list[str], dest: Path) -> list[Path]:
    """cp312 manylinux x86-64 wheels of exactly `requirements` (no dependencies)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + requirements, check=True)
    wheels = []
    for req in requirements:
        name, _, ver = req.partition("==")
        stem = f"{name.replace('-', '_').lower()}-{ver}-"
        found = [w for w in dest.glob("*.whl") if w.name.lower().startswith(stem)]
        if len(found) != 1:
            raise SystemExit(f"bundle: expected one wheel for {req} in {dest}, found {found}")
        wheels.append(found[0])
    return wheels


def write_python(zf: zipfile.ZipFile, path: Path) -> None:
    """vLLM's sources, configs and templates, and its dist-info (vLLM reads its own version
    from the metadata). Left out: compiled libraries (`write_kernels` takes the two the
    engine needs), the `vllm-rs` launcher binary, and the C++/CUDA headers that only JIT
    kernels of other architectures (DeepGEMM, SM100 attention) compile against."""
    with tarfile.open(path, "w:xz", preset=6) as tar:
        for info in zf.infolist():
            if not info.is_dir() and info.filename.endswith(PYTHON_SUFFIXES):
                add_bytes(tar, info.filename, zf.read(info))


def write_kernels(zf: zipfile.ZipFile, path: Path, arch: str) -> None:
    with tarfile.open(path, "w:xz", preset=6) as tar:
        for name in KERNELS:
            data = bytearray(zf.read(name))
            if arch != "all":
                kept, zeroed = keep_only_arch(data, int(arch))
                print(f"bundle: {name}: sm_{arch} code {kept / 1e6:.1f} MB kept, "
                      f"{zeroed / 1e6:.1f} MB of other architectures zeroed")
            add_bytes(tar, name, bytes(data), mode=0o755)


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))


def fatbin_section(elf: bytes | bytearray) -> tuple[int, int]:
    """(offset, size) of the `.nv_fatbin` section of a 64-bit little-endian ELF file."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    def header(i):  # (name offset, file offset, size)
        base = shoff + i * shentsize
        name, = struct.unpack_from("<I", elf, base)
        offset, size = struct.unpack_from("<QQ", elf, base + 0x18)
        return name, offset, size
    _, strtab, _ = header(shstrndx)
    for i in range(shnum):
        name, offset, size = header(i)
        end = elf.index(b"\0", strtab + name)
        if bytes(elf[strtab + name:end]) == b".nv_fatbin":
            return offset, size
    raise ValueError("no .nv_fatbin section")


def keep_only_arch(elf: bytearray, sm: int) -> tuple[int, int]:
    """Zero, in place, the payload of every fatbin entry an sm_`sm` GPU never loads: cubins
    of other architectures, and PTX in a fatbin that has an sm_`sm` cubin (the driver prefers
    the cubin; PTX of an older architecture is kept where there is none: the driver compiles
    it). Returns (bytes kept, bytes zeroed) of payload.

    Layout (CUDA's fatbin format): the section holds fatbins, each a 16-byte header
    (u32 magic 0xBA55ED50, u16 version, u16 header size, u64 size of the entries) followed
    by entries, each a header (u16 kind: 1 PTX, 2 ELF cubin; u16 version; u32 header size;
    u64 payload size; ...; u32 architecture at byte 28) and its payload."""
    offset, size = fatbin_section(elf)
    pos, end_of_section, kept, zeroed = offset, offset + size, 0, 0
    while pos < end_of_section:
        magic, _, header_size, entries_size = struct.unpack_from("<IHHQ", elf, pos)
        if magic != FATBIN_MAGIC:  # alignment padding between fatbins
            pos += 8
            continue
        entries, e, end = [], pos + header_size, pos + header_size + entries_size
        while e < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", elf, e)
            entry_sm, = struct.unpack_from("<I", elf, e + 28)
            entries.append((kind, entry_sm, e + entry_header, payload))
            e += entry_header + payload
        has_cubin = any(k == ELF_KIND and s == sm for k, s, _, _ in entries)
        for kind, entry_sm, start, payload in entries:
            loads = (entry_sm == sm if kind == ELF_KIND
                     else kind == PTX_KIND and entry_sm <= sm and not has_cubin)
            if loads:
                kept += payload
            else:
                elf[start:start + payload] = bytes(payload)
                zeroed += payload
        pos = end
    return kept, zeroed


def copy_tokenizer(dest: Path) -> None:
    """SmolLM2-135M's tokenizer (a real 49,152-token BPE) from this project's model cache."""
    model = subprocess.run([sys.executable, "-m", "vllm_triforce.tools.cli", "models", "fetch",
                            "smollm2-135m"], check=True, capture_output=True, text=True,
                           cwd=REPO).stdout.strip().splitlines()[-1]
    dest.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (Path(model) / name).exists():
            shutil.copy2(Path(model) / name, dest / name)


def write_manifest(out: Path) -> None:
    lines = []
    for f in sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        lines.append(f"{digest}  {f.relative_to(out)}")
    (out / MANIFEST).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
