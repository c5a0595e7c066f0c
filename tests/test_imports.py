"""The package's shape (docs/ARCHITECTURE.md "Layout"), read from its module-level imports:
no import circle anywhere, and how a pass runs on the device (engine/device/) is a room
the levels call, never one that calls them."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_triforce"
# the levels and what drives them: engine/device/ may import none of these
LEVELS = ("engine.middle", "engine.retrieval_level", "engine.draft_level", "engine.drafting",
          "engine.proposer", "engine.mrv2", "engine.plain_steps")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports when it is imported (imports inside
    functions, and under `if TYPE_CHECKING:`, run later or never)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If):
            if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                continue
            body = node.body + node.orelse
        elif isinstance(node, ast.Try):
            body = node.body
        else:
            body = [node]
        for stmt in body:
            if isinstance(stmt, ast.Import):
                found.update(a.name for a in stmt.names)
            elif isinstance(stmt, ast.ImportFrom):
                if stmt.level:
                    base = package.split(".")[:len(package.split(".")) - stmt.level + 1]
                    module = ".".join(base + ([stmt.module] if stmt.module else []))
                else:
                    module = stmt.module or ""
                for alias in stmt.names:
                    sub = f"{module}.{alias.name}"
                    found.add(sub if sub in modules else module)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _top_level_imports(path, set(paths)) for name, path in paths.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return groups


def test_no_module_imports_itself_round_a_circle():
    graph = _graph()
    assert len(graph) > 50 and "vllm_triforce.engine.device.round_graph" in graph
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_the_device_room_imports_no_level():
    for name, deps in _graph().items():
        if name.startswith("vllm_triforce.engine.device"):
            bad = [d for d in deps if d.removeprefix("vllm_triforce.").startswith(LEVELS)]
            assert not bad, (name, bad)


def test_every_import_from_the_package_names_what_it_binds():
    """Every `from vllm_triforce... import NAME` in the package, patches/, tests/, scripts/
    and benchmarks/, the imports inside functions too, names a module of the package that
    binds NAME (read, not imported: tools/contract.Sources). A benchmark that runs once a
    lease imports its helpers only when it runs, so a renamed helper would surface there."""
    from vllm_triforce.tools.contract import Sources

    class Ours(Sources):  # patches/ installs as vllm_triforce.patches (setup.cfg)
        def tree(self, module: str):
            if module.split(".")[:2] == ["vllm_triforce", "patches"]:
                module = module.replace("vllm_triforce.patches", "patches", 1)
            return super().tree(module)

    root = PACKAGE.parent
    source, problems, seen = Ours(root), [], 0
    for folder in ("vllm_triforce", "patches", "tests", "scripts", "benchmarks"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                        and node.module.split(".")[0] == "vllm_triforce"):
                    for alias in node.names:
                        seen += 1
                        problems += [f"{path.relative_to(root)}: {problem}" for problem in
                                     source.binds(node.module, alias.name)]
    assert seen > 500, f"only {seen} imports found: the walk missed the tree"
    assert not problems, "\n".join(problems)
