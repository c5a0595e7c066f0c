"""The contract with vLLM (vllm_triforce/tools/contract.py): it holds for the installed vLLM, and
it fails, naming the symbol, on a copy of vLLM's sources with one symbol renamed."""

import shutil
from pathlib import Path

import pytest

from vllm_triforce.tools import contract

RUNNER = "vllm/v1/worker/gpu_model_runner.py"


def test_contract_holds_for_the_installed_vllm():
    assert contract.check(contract.installed_root()) == []
    # what it reads is not empty: imports found in our sources, and vLLM's call found
    assert ("vllm.v1.spec_decode.draft_model", "DraftModelProposer") in contract.plugin_imports()
    assert {"target_token_ids", "common_attn_metadata"} <= contract.our_propose_params()


@pytest.fixture(scope="module")
def vllm_copy(tmp_path_factory) -> Path:
    """The installed vLLM's Python sources, copied (never imported)."""
    root = tmp_path_factory.mktemp("vllm-sources")
    shutil.copytree(contract.installed_root() / "vllm", root / "vllm",
                    ignore=lambda folder, names: [n for n in names if not n.endswith(".py")
                                                  and "." in n])
    return root


def _renamed(root: Path, path: str, old: str, new: str):
    """A context: `old` replaced by `new` in root/path, restored afterwards."""
    class Renamed:
        def __enter__(self):
            self.file = root / path
            self.text = self.file.read_text()
            assert old in self.text, f"{old!r} not in {path}: the test needs updating"
            self.file.write_text(self.text.replace(old, new))

        def __exit__(self, *exc):
            self.file.write_text(self.text)
    return Renamed()


@pytest.mark.parametrize("path, old, new, named", [
    (RUNNER, "def _bookkeeping_sync(", "def _bookkeeping_sync_v2(",
     "vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync: missing"),
    ("vllm/model_executor/models/utils.py", "def extract_layer_index(",
     "def layer_index_of(", "vllm.model_executor.models.utils.extract_layer_index: missing"),
    (RUNNER, "token_indices_to_sample=token_indices_to_sample",
     "sample_indices=token_indices_to_sample", "passes propose(sample_indices=...)"),
    # a moved symbol (compat.py MOVED) that moved again
    ("vllm/v1/core/kv_cache_utils.py", "def get_kv_cache_groups(",
     "def kv_cache_groups_of(", "get_kv_cache_groups: bound in none of"),
])
def test_contract_names_a_renamed_symbol(vllm_copy, path, old, new, named):
    assert contract.check(vllm_copy) == []
    with _renamed(vllm_copy, path, old, new):
        problems = contract.check(vllm_copy)
    assert any(named in p for p in problems), problems
