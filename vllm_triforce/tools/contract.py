"""The contract with vLLM: every vLLM symbol this plugin imports or patches, and the keyword
arguments vLLM's runner passes to the proposer, checked by reading vLLM's Python sources
(no import, no GPU): against the installed vLLM, or against another release's wheel.

    vllm-triforce contract                 # the installed vLLM
    vllm-triforce contract --wheel 0.33.0  # a release's wheel, downloaded once into the cache

What is checked, each failure naming the symbol:
1. imports: every `from vllm... import NAME` in this package and in patches/ (read from our
   own sources, so the list cannot drift): the module exists and binds NAME at its top level
   (a definition, an assignment, an import, or a lazy module `__getattr__` that names it);
2. patch targets (PATCH_TARGETS): each `module:Class.method` a patch wraps or replaces is
   defined in that class's body, and so is each attribute read on vLLM's objects
   (READ_ATTRIBUTES; an instance attribute counts where a method of the class assigns
   `self.attribute`);
3. the proposer's call: the keywords `GPUModelRunner.propose_draft_token_ids` passes to
   `self.drafter.propose(...)` (the draft-model call, the one with `target_token_ids`) are
   all parameters of `TriForceProposer.propose`; and every `self.speculator.propose(...)`
   of Model Runner V2's `GPUModelRunner` passes no more positional arguments than
   `TriForceSpeculator.propose` (engine/mrv2/speculator.py) takes, and only keywords it
   takes;
4. moved symbols (compat.py `MOVED`): one of the modules the plugin looks in binds each.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # vllm_triforce/
# Every symbol a patch changes (patches/*.py), `module`, `Class.attribute`.
PATCH_TARGETS = (
    ("vllm.engine.arg_utils", "EngineArgs.add_cli_args"),                    # cli_args
    ("vllm.engine.arg_utils", "EngineArgs.create_speculative_config"),       # spec_config
    ("vllm.platforms.cpu", "CpuPlatform.check_and_update_config"),           # cpu_defaults
    ("vllm.platforms.cpu", "CpuPlatform.ray_device_key"),                    # ray_cpu
    ("vllm.v1.executor.ray_executor_v2", "RayWorkerProc"),                   # ray_cpu
    ("vllm.v1.executor.ray_executor_v2", "RayExecutorV2._get_actor_resource_kwargs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.__init__"),          # runner
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample"),           # cpu_seed
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._bookkeeping_sync"),  # cpu_seed
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._prepare_inputs"),   # zero_draft
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.propose_draft_token_ids"),
    # handoff_rows, plain_propose
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._get_spec_decode_draft_probs"),
    ("vllm.v1.engine.input_processor", "InputProcessor._validate_params"),  # plain_params
    ("vllm.sampling_params", "SamplingParams._validate_spec_decode"),         # plain_params
    ("vllm.v1.worker.gpu_model_runner", "build_logitsprocs"),                # plain_params
    ("vllm.v1.worker.gpu_worker", "Worker.determine_available_memory"),      # kv_reservation
    ("vllm.v1.worker.cpu_worker", "CPUWorker.determine_available_memory"),   # kv_reservation
    ("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._raise_if_mrope"),
    # mrope_draft
)
# Every attribute the plugin reads or calls on vLLM's objects that no import names, with
# the file of ours that reads it: the middle passes over persistent buffers
# (engine/device/round_graph.py) and per-layer tables (engine/device/forward.py).
READ_ATTRIBUTES = (
    ("vllm.v1.attention.backend", "CommonAttentionMetadata.query_start_loc_cpu"),
    ("vllm.v1.attention.backend", "CommonAttentionMetadata.seq_lens_cpu_upper_bound"),
    ("vllm.v1.attention.backend", "AttentionMetadataBuilder.update_block_table"),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadataBuilder.update_block_table"),
    ("vllm.v1.attention.backends.flash_attn", "FlashAttentionMetadata.scheduler_metadata"),
    ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadata.scheduler_metadata"),
    ("vllm.v1.worker.utils", "AttentionGroup.build_metadata"),
    ("vllm.v1.worker.utils", "AttentionGroup.get_metadata_builder"),
    # a plain step's host facts during the pass (engine/plain_steps.py `read_v1_ahead`)
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.query_start_loc"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.optimistic_seq_lens_cpu"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.discard_request_mask"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.num_reqs"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids"),
    # M-RoPE targets: each generated token's shift (engine/batch.py `rope_shift`), and
    # which models take [3, T] positions (engine/device/forward.py `rotary_positions`)
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.uses_mrope"),
    ("vllm.v1.worker.gpu_input_batch", "CachedRequestState.mrope_position_delta"),
    ("vllm.model_executor.models.interfaces", "SupportsMRoPE.supports_mrope"),
    # targets with local layers (engine/drafting.py `_attach_target`, the other
    # KV-cache groups' tables: engine/batch.py `_group_table`)
    ("vllm.model_executor.layers.attention.attention", "Attention.sliding_window"),
    ("vllm.model_executor.layers.attention.chunked_local_attention",
     "ChunkedLocalAttention.attention_chunk_size"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.block_table"),
    ("vllm.v1.worker.block_table", "MultiGroupBlockTable.__getitem__"),
    ("vllm.v1.worker.block_table", "BlockTable.get_device_tensor"),
    # LoRA adapters on TriForce's passes (engine/adapters.py)
    ("vllm.v1.worker.lora_model_runner_mixin", "LoRAModelRunnerMixin._set_active_loras"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.request_lora_mapping"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch.lora_id_to_lora_request"),
    # what patches/plain_propose.py reads and sets on the runner
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.use_async_scheduling"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._draft_probs"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._draft_prob_req_ids"),
) + (  # Model Runner V2 (engine/mrv2/, engine/batch.py `StepBatch.from_mrv2`)
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.req_ids"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.num_reqs"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.idx_mapping"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.idx_mapping_np"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.seq_lens"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.query_start_loc"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.input_ids"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.num_tokens"),
    # a plain step's host facts (engine/plain_steps.py `read_mrv2`)
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.query_start_loc_np"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.seq_lens_cpu_upper_bound"),
    ("vllm.v1.worker.gpu.input_batch", "InputBatch.prefill_len_np"),
    # the tokens of plain steps (engine/mrv2/requests.py `TokenHistory`)
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.req_states"),
    ("vllm.v1.worker.gpu.states", "RequestState.all_token_ids"),
    ("vllm.v1.worker.gpu.buffer_utils", "StagedWriteTensor.gpu"),
    ("vllm.v1.worker.gpu.sample.states", "SamplingStates.temperature"),
    ("vllm.v1.worker.gpu.sample.states", "SamplingStates.top_k"),
    ("vllm.v1.worker.gpu.sample.states", "SamplingStates.top_p"),
    ("vllm.v1.worker.gpu.sample.states", "SamplingStates.seeds_set"),
    ("vllm.v1.worker.gpu.sample.states", "SamplingStates.vocab_size"),
    ("vllm.v1.worker.gpu.buffer_utils", "UvaBackedTensor.np"),
    ("vllm.v1.worker.gpu.buffer_utils", "UvaBackedTensor.gpu"),
    ("vllm.v1.worker.gpu.block_table", "BlockTables.input_block_tables"),
    ("vllm.v1.worker.gpu.states", "RequestState.last_sampled_tokens"),
    ("vllm.v1.worker.gpu.sample.sampler", "Sampler.sampling_states"),
    ("vllm.v1.worker.gpu.spec_decode.utils", "DraftTokensHandler.set_draft_tokens"),
    ("vllm.v1.worker.gpu.spec_decode.utils", "DraftTokensHandler.get_draft_tokens"),
    ("vllm.v1.worker.gpu.spec_decode.speculator", "BaseSpeculator.propose"),
    ("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.load_model"),
    ("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.set_attn"),
    ("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.draft_logits"),
    ("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.draft_tokens"),
    ("vllm.v1.worker.gpu.spec_decode.speculator",
     "DraftModelSpeculator.num_speculative_steps"),
    ("vllm.v1.worker.gpu.spec_decode.speculator",
     "DraftModelSpeculator.draft_attn_layer_names"),
    ("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.supports_mm_inputs"),
    # the small draft's model and attention groups (engine/drafting.py `_draft_parts`)
    ("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.model"),
    ("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.attn_groups"),
    ("vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.block_tables"),
    # a method of MRV2's speculators: TriForce's capture is `layer_capture`, not `capture`
    ("vllm.v1.worker.gpu.spec_decode.speculator", "BaseSpeculator.capture"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.get_kv_cache_spec"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.speculator"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.draft_tokens_handler"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sampler"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.load_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.update_requests"),
    ("vllm.v1.worker.gpu_worker", "Worker._make_model_runner"),
    ("vllm.v1.worker.gpu_worker", "Worker.use_v2_model_runner"),
    ("vllm.v1.core.sched.output", "NewRequestData.prefill_token_ids"),
    ("vllm.v1.core.sched.output", "NewRequestData.prompt_len"),
    ("vllm.v1.core.sched.output", "NewRequestData.block_ids"),
    ("vllm.v1.core.sched.output", "CachedRequestData.new_block_ids"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.finished_req_ids"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.preempted_req_ids"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.scheduled_new_reqs"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.scheduled_cached_reqs"),
    # async scheduling's drafts cut to each request's depth (engine/mrv2/draft_tokens.py)
    ("vllm.v1.core.sched.output", "SchedulerOutput.scheduled_spec_decode_tokens"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.num_scheduled_tokens"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.total_num_scheduled_tokens"),
    ("vllm.v1.core.sched.output", "SchedulerOutput.has_structured_output_requests"),
    # ... and the cut slots off vLLM's drafted counts (`note_cut`), read by its metrics
    ("vllm.v1.core.sched.output", "SchedulerOutput.num_invalid_spec_tokens"),
    ("vllm.v1.core.sched.scheduler", "Scheduler.make_spec_decoding_stats"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model"),
    # FULL decode graphs where TriForce reads nothing of a pass (engine/mrv2/graphs.py)
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.initialize_kv_cache"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.gather_batch_req_state"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.cudagraph_manager"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.decode_query_len"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner.attn_groups"),
    ("vllm.v1.worker.gpu.model_runner", "BatchReqState.req_ids"),
    ("vllm.v1.worker.gpu.model_runner", "BatchReqState.idx_mapping_np"),
    ("vllm.v1.worker.gpu.model_runner", "BatchReqState.num_scheduled_tokens"),
    ("vllm.v1.worker.gpu.model_runner", "BatchReqState.prefill_len_np"),
    ("vllm.v1.worker.gpu.states", "RequestState.num_computed_tokens_np"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager.cudagraph_mode"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager.varlen_decode"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager._candidates"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager._capture_descs"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager._init_candidates"),
    ("vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager.dispatch"),
    ("vllm.config.compilation", "CUDAGraphMode.separate_routine"),
    ("vllm.config.compilation", "CUDAGraphMode.decode_mode"),
    ("vllm.config.compilation", "CUDAGraphMode.mixed_mode"),
    ("vllm.v1.outputs", "DraftTokenIds.draft_token_ids"),
)
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
PROPOSE_CALLER = "GPUModelRunner.propose_draft_token_ids"
MRV2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"


def add_contract_parser(subparsers) -> None:
    p = subparsers.add_parser("contract", help="check the vLLM symbols this plugin relies on, "
                                               "by reading vLLM's sources (no GPU, no install)")
    p.add_argument("--wheel", metavar="VERSION", default=None,
                   help="check that vLLM release's wheel (downloaded once into the cache) "
                        "instead of the installed vLLM")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from vllm_triforce import assets
    from vllm_triforce.compat import MOVED

    root = (wheel_root(args.wheel, assets.cache_root() / "vllm-wheels") if args.wheel
            else installed_root())
    problems = check(root)
    what = f"vLLM {args.wheel}" if args.wheel else f"the installed vLLM ({root})"
    for problem in problems:
        print(f"contract: {problem}")
    print(f"contract: {'broken' if problems else 'holds'} for {what}: "
          f"{len(plugin_imports())} imports, {len(PATCH_TARGETS)} patch targets, "
          f"{len(READ_ATTRIBUTES)} attributes read, {len(MOVED)} moved, "
          f"the proposer's and the MRV2 speculator's calls")
    return 1 if problems else 0


def check(vllm_root: Path) -> list[str]:
    """Problems found in the vLLM sources under `vllm_root` (the folder holding `vllm/`);
    empty when the contract holds."""
    source = Sources(vllm_root)
    problems = [p for module, name in plugin_imports() for p in source.binds(module, name)]
    problems += [p for module, qualname in PATCH_TARGETS + READ_ATTRIBUTES
                 for p in source.defines(module, qualname)]
    problems += propose_keywords_problems(source)
    problems += speculator_call_problems(source)
    problems += moved_problems(source)
    return problems


def moved_problems(source: "Sources") -> list[str]:
    """Each symbol vLLM moved between releases (compat.py `MOVED`) is bound by one of the
    modules the plugin looks in."""
    from vllm_triforce.compat import MOVED

    return [f"{name}: bound in none of {', '.join(modules)} (compat.py MOVED)"
            for name, modules in MOVED.items()
            if all(source.binds(module, name) for module in modules)]


def installed_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parent.parent


def wheel_root(version: str, cache: Path) -> Path:
    """vLLM `version`'s Python sources from PyPI's wheel, extracted once under `cache`."""
    root = cache / f"vllm-{version}-sources"
    if (root / "vllm" / "__init__.py").exists():
        return root
    wheels = cache / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", "3.12", "--platform",
                    "manylinux_2_28_x86_64", "-d", str(wheels), f"vllm=={version}"], check=True)
    [wheel] = wheels.glob(f"vllm-{version}-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                zf.extract(name, root)
    return root


# ----------------------------------------------------------------- our side

def plugin_imports() -> list[tuple[str, str]]:
    """(module, name) of every `from vllm... import name` in this package and patches/."""
    import vllm_triforce.patches as patches

    found = set()
    for folder in {PACKAGE_DIR, Path(patches.__file__).parent}:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                        node.module == "vllm" or node.module.startswith("vllm.")):
                    found.update((node.module, alias.name) for alias in node.names)
    return sorted(found)


def our_propose_params() -> set[str]:
    tree = ast.parse((PACKAGE_DIR / "engine" / "proposer.py").read_text())
    method = _find(tree, "TriForceProposer.propose")
    args = method.args
    return {a.arg for a in args.args + args.kwonlyargs}


def propose_keywords_problems(source: "Sources") -> list[str]:
    caller = source.find(RUNNER_MODULE, PROPOSE_CALLER)
    if caller is None:
        return [f"{RUNNER_MODULE}.{PROPOSE_CALLER}: missing (it calls the proposer)"]
    calls = [node for node in ast.walk(caller) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "propose"
             and ast.unparse(node.func.value) == "self.drafter"]
    keywords = [{k.arg for k in call.keywords} for call in calls]
    ours = [k for k in keywords if "target_token_ids" in k]
    if not ours:
        return [f"{RUNNER_MODULE}.{PROPOSE_CALLER}: no self.drafter.propose(...) call with "
                "target_token_ids (the draft-model call TriForce's proposer answers)"]
    accepted = our_propose_params()
    return [f"{RUNNER_MODULE}.{PROPOSE_CALLER} passes propose({name}=...), which "
            f"TriForceProposer.propose does not take" for name in sorted(set().union(*ours))
            if name not in accepted]


def our_speculator_params() -> tuple[int, set[str]]:
    """(positional parameters after self, every parameter name) of
    `TriForceSpeculator.propose`."""
    tree = ast.parse((PACKAGE_DIR / "engine" / "mrv2" / "speculator.py").read_text())
    args = _find(tree, "TriForceSpeculator.propose").args
    return len(args.args) - 1, {a.arg for a in args.args + args.kwonlyargs}


def speculator_call_problems(source: "Sources") -> list[str]:
    """Every `self.speculator.propose(...)` in MRV2's runner, against our signature."""
    tree = source.tree(MRV2_RUNNER_MODULE)
    if tree is None:
        return [f"{MRV2_RUNNER_MODULE}: no such module (Model Runner V2)"]
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "propose"
             and ast.unparse(node.func.value) == "self.speculator"]
    if not calls:
        return [f"{MRV2_RUNNER_MODULE}: no self.speculator.propose(...) call"]
    num_positional, accepted = our_speculator_params()
    problems = []
    for call in calls:
        if len(call.args) > num_positional:
            problems.append(f"{MRV2_RUNNER_MODULE} line {call.lineno} passes "
                            f"{len(call.args)} positional arguments to propose; "
                            f"TriForceSpeculator.propose takes {num_positional}")
        problems += [f"{MRV2_RUNNER_MODULE} line {call.lineno} passes propose({k.arg}=...), "
                     "which TriForceSpeculator.propose does not take"
                     for k in call.keywords if k.arg not in accepted]
    return problems


# --------------------------------------------------------------- vLLM's side

class Sources:
    """vLLM's modules as syntax trees, read from files under `root` (never imported)."""

    def __init__(self, root: Path):
        self.root = root

    @functools.cache
    def tree(self, module: str) -> ast.Module | None:
        base = self.root.joinpath(*module.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.exists():
                return ast.parse(path.read_text())
        return None

    def binds(self, module: str, name: str) -> list[str]:
        if self.tree(module) is None:
            return [f"{module}: no such module (the plugin imports {name} from it)"]
        if self.tree(f"{module}.{name}") is not None or self._bound(module, name):
            return []
        return [f"{module}.{name}: missing (the plugin imports it)"]

    def _bound(self, module: str, name: str, depth: int = 0) -> bool:
        """`name` bound in `module` itself or through its `from X import *`."""
        tree = self.tree(module)
        if tree is None or depth > 4:
            return False
        if name in top_level_names(tree):
            return True
        stars = [self.imported_module(module, node) for node in _top_level(tree.body)
                 if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)]
        return any(self._bound(source, name, depth + 1) for source in stars)

    def imported_module(self, module: str, node: ast.ImportFrom) -> str:
        """The absolute name of the module `node` (written in `module`) imports from."""
        if node.level == 0:
            return node.module or ""
        is_package = self.root.joinpath(*module.split("."), "__init__.py").exists()
        parts = module.split(".")[:len(module.split(".")) - node.level + is_package]
        return ".".join(parts + ([node.module] if node.module else []))

    def find(self, module: str, qualname: str, depth: int = 0) -> ast.AST | None:
        """`Class.attr` defined in the class or, failing that, in a base class that the
        module defines or imports from another vLLM module."""
        tree = self.tree(module)
        if tree is None or depth > 4:
            return None
        found = _find(tree, qualname)
        if found is not None or "." not in qualname:
            return found
        cls_name, attr = qualname.rsplit(".", 1)
        cls = _find(tree, cls_name)
        found = _assigned_on_self(cls, attr)
        if found is not None:
            return found
        for base in getattr(cls, "bases", []):
            if isinstance(base, ast.Name):
                where = next((self.imported_module(module, node)
                              for node in _top_level(tree.body)
                              if isinstance(node, ast.ImportFrom)
                              and any((a.asname or a.name) == base.id for a in node.names)),
                             module)
                found = self.find(where, f"{base.id}.{attr}", depth + 1)
                if found is not None:
                    return found
        return None

    def defines(self, module: str, qualname: str) -> list[str]:
        if self.tree(module) is None:
            return [f"{module}: no such module (a patch changes {qualname} in it)"]
        imported = "." not in qualname and self._bound(module, qualname)  # a module's name
        if self.find(module, qualname) is None and not imported:
            return [f"{module}.{qualname}: missing (a patch changes it)"]
        return []


def top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (inside `if`/`try` too), plus the string
    constants of a module-level `__getattr__` (lazy attributes such as
    `vllm.platforms.current_platform`)."""
    names: set[str] = set()
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                names.update(c.value for c in ast.walk(node) if isinstance(c, ast.Constant)
                             and isinstance(c.value, str))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _top_level(body: list[ast.stmt]):
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from _top_level(node.body + node.orelse + node.finalbody
                                  + [s for h in node.handlers for s in h.body])


def _find(tree: ast.Module, qualname: str) -> ast.AST | None:
    """The definition (or class-level assignment) of `Class.attr` or `name` in `tree`."""
    node: ast.AST = tree
    for part in qualname.split("."):
        body = getattr(node, "body", [])
        match = next((n for n in _top_level(body) if _defines(n, part)), None)
        if match is None:
            return None
        node = match
    return node


def _assigned_on_self(cls: ast.AST | None, attr: str) -> ast.AST | None:
    """The first statement in a method of `cls` that assigns `self.attr`, if any (an
    instance attribute: MRV2's state objects declare theirs in `__init__`, its
    speculators some in `load_model`), alone or in a tuple (`self.attr, x = ...`)."""
    for node in ast.walk(cls) if isinstance(cls, ast.ClassDef) else ():
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Attribute) and t.attr == attr
               and isinstance(t.value, ast.Name) and t.value.id == "self"
               for target in targets for t in ast.walk(target)):
            return node
    return None


def _defines(node: ast.AST, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False
