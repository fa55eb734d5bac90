"""The layer order, enforced: every import (lazy ones inside functions too) points down.

    cpu_kernels, models, kv_cache -> attention -> speculative -> engine -> training | disagg -> triton -> client
    lora (adapters): on models, under engine
    parallel (tensor-parallel sharding and rank groups): on models, under engine
    rdma: a leaf beside them, used by disagg, triton and client only

No cycle either, between packages or between modules: the imports a module runs when
it is imported (not those inside functions, nor ``if TYPE_CHECKING:`` ones) never lead
back to it.

Third-party rules: only ``backends/triton`` imports Triton's Python utilities; only
``backends/triton`` and ``client`` import ``tritonclient``; ``rdma`` imports torch only
inside the functions that are handed a tensor.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"backends": "tandem.backends", "rdma": "tandem.rdma", "client": "tandem.client"}

# what each layer may import besides itself ("lazy" is backends' PEP 562 helper)
ENGINE_BELOW = {"models", "kv_cache", "attention", "speculative", "cpu_kernels", "lora", "parallel"}
ALLOWED: dict[str, set[str]] = {
    "models": {"cpu_kernels"},
    "kv_cache": set(),
    "attention": {"kv_cache", "cpu_kernels"},
    "speculative": {"models"},
    "lora": {"models", "cpu_kernels"},
    "parallel": {"models", "cpu_kernels"},
    "engine": ENGINE_BELOW,
    "training": ENGINE_BELOW | {"engine"},
    "disagg": ENGINE_BELOW | {"engine", "rdma"},
    "triton": ENGINE_BELOW | {"engine", "disagg", "rdma"},
    "client": ENGINE_BELOW | {"backends", "engine", "training", "disagg", "triton", "rdma"},
    "rdma": set(),
    "backends": {"engine", "speculative"},   # the package root's lazy exports
    "lazy": set(),
    "cpu_kernels": set(),   # the C++ CPU kernels and the machine's compiler
}
PB_UTILS = "triton_python_backend_utils"


@dataclass(frozen=True, slots=True)
class Import:
    path: str        # relative to the repository root
    line: int
    target: str      # absolute module name
    top_level: bool  # runs when the module is imported (not inside a function)
    names: tuple[str, ...] = ()   # "from target import names"


def layer_of(module: str) -> str | None:
    """``tandem.backends.engine.sampler`` -> ``engine``; ``tandem.rdma.plan`` -> ``rdma``."""
    parts = module.split(".")
    if parts[0] != "tandem" or len(parts) < 2:
        return None
    if parts[1] == "backends":
        return parts[2] if len(parts) > 2 else "backends"
    return parts[1]


@dataclass(frozen=True, slots=True)
class Source:
    path: str        # relative to the repository root, e.g. "backends/engine/sampler.py"
    text: str


def module_name(path: str) -> tuple[str, bool]:
    folder, *rest = PurePosixPath(path).with_suffix("").parts
    is_pkg = rest[-1] == "__init__"
    parts = rest[:-1] if is_pkg else rest
    return ".".join((PACKAGES[folder], *parts)), is_pkg


def _resolve(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(src: Source) -> list[Import]:
    module, is_pkg = module_name(src.path)
    rel = src.path
    found: list[Import] = []

    def visit(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(rel, child.lineno, a.name, not deferred) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(child, module, is_pkg)
                # "from . import x" names submodules: record each as its own target
                if not child.module:
                    found.extend(Import(rel, child.lineno, f"{base}.{a.name}", not deferred)
                                 for a in child.names)
                else:
                    found.append(Import(rel, child.lineno, base, not deferred,
                                        tuple(a.name for a in child.names)))
            if _is_type_checking(child):   # its body runs only under a type checker
                visit(ast.Module(child.body, []), True)
                visit(ast.Module(child.orelse, []), deferred)
            else:
                visit(child, deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                            ast.Lambda)))

    visit(ast.parse(src.text, rel), False)
    return found


def _is_type_checking(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING"
            or isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def source_files() -> list[Source]:
    return [Source(str(p.relative_to(ROOT)), p.read_text())
            for folder in PACKAGES for p in sorted((ROOT / folder).rglob("*.py"))]


def layer_violations(files: list[Source]) -> list[str]:
    bad = []
    for src in files:
        own = layer_of(module_name(src.path)[0])
        for imp in imports_of(src):
            other = layer_of(imp.target)
            if other is None or other == own or other == "lazy" and own != "rdma":
                continue
            if other not in ALLOWED[own]:
                bad.append(f"{imp.path}:{imp.line}: {own} imports {imp.target} ({other}); "
                           f"{own} may import only {sorted(ALLOWED[own]) or 'nothing of tandem'}")
    return bad


def third_party_violations(files: list[Source]) -> list[str]:
    bad = []
    for src in files:
        own = layer_of(module_name(src.path)[0])
        for imp in imports_of(src):
            root = imp.target.split(".")[0]
            if root == PB_UTILS and own != "triton":
                bad.append(f"{imp.path}:{imp.line}: {PB_UTILS} outside backends/triton")
            if root == "tritonclient" and own not in ("triton", "client"):
                bad.append(f"{imp.path}:{imp.line}: tritonclient outside backends/triton and client")
            if root == "torch" and own == "rdma" and imp.top_level:
                bad.append(f"{imp.path}:{imp.line}: rdma imports torch when it is imported; "
                           "import it inside the function that is handed a tensor")
    return bad


def package_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by depth-first search over ``edges`` (layer -> layers it imports,
    or module -> modules)."""
    cycles, state = [], {}

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                dfs(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            dfs(node, [node])
    return cycles


def actual_edges(files: list[Source]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for src in files:
        own = layer_of(module_name(src.path)[0])
        for imp in imports_of(src):
            other = layer_of(imp.target)
            if other is not None and other != own:
                edges.setdefault(own, set()).add(other)
    return edges


def lazy_exports_of(src: Source) -> dict[str, str]:
    """A package ``__init__``'s ``_EXPORTS`` (name -> the absolute module defining it)."""
    package = module_name(src.path)[0]
    for node in ast.parse(src.text, src.path).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)):
            return {k.value: package + v.value for k, v in zip(node.value.keys, node.value.values)}
    return {}


def module_graph(files: list[Source]) -> dict[str, dict[str, str]]:
    """module -> {module its import runs: where ("path:line")}, over the imports that run
    when a module is imported. Importing ``a.b.c`` runs the packages ``a.b`` and ``a``
    first (those the importer is not inside); a name a package exports lazily loads the
    module that defines it."""
    sources = {module_name(s.path)[0]: s for s in files}
    lazy = {m: lazy_exports_of(s) for m, s in sources.items() if s.path.endswith("__init__.py")}

    def loaded(imp: Import, inside: set[str]) -> list[str]:
        target, names = imp.target, imp.names
        if target not in sources:   # "from pkg import name": a name, not a submodule
            target, _, name = target.rpartition(".")
            names = (name,)
        out = [target]
        for name in names:
            sub = f"{target}.{name}"
            out.append(sub if sub in sources else lazy.get(target, {}).get(name, target))
        parts = target.split(".")
        return out + [p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                      if p not in inside]

    graph: dict[str, dict[str, str]] = {}
    for module, src in sources.items():
        out = graph.setdefault(module, {})
        inside = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
        for imp in imports_of(src):
            if imp.top_level:
                for m in loaded(imp, inside):
                    if m in sources and m != module:
                        out.setdefault(m, f"{imp.path}:{imp.line}")
    return graph


def module_cycles(files: list[Source]) -> list[str]:
    """Each import cycle between modules, as ``a -> b -> a`` with where each import is."""
    graph = module_graph(files)
    return [" -> ".join(cycle) + " (" + ", ".join(graph[a][b] for a, b in zip(cycle, cycle[1:])) + ")"
            for cycle in package_cycles({m: set(out) for m, out in graph.items()})]


# -- the rules, on the tree --------------------------------------------------------------

def test_every_import_points_down_the_layer_order():
    assert layer_violations(source_files()) == []


def test_only_backends_triton_speaks_triton_and_rdma_loads_torch_lazily():
    assert third_party_violations(source_files()) == []


def test_no_cycle_between_packages():
    assert package_cycles(ALLOWED) == []                 # the order itself
    assert package_cycles(actual_edges(source_files())) == []


def test_no_import_cycle_between_modules():
    cycles = module_cycles(source_files())
    assert not cycles, "import cycles (a module's imports lead back to it):\n" + "\n".join(cycles)


def test_the_thin_adapters_import_only_backends_triton():
    for path in (ROOT / "model_repository").glob("*/1/model.py"):
        targets = {i.target for i in imports_of_adapter(path)}
        assert all(t.startswith("tandem.backends.triton.") for t in targets), (path, targets)


def imports_of_adapter(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text())
    return [Import(str(path), n.lineno, n.module, True)
            for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]


@pytest.mark.parametrize("model", ["preprocess_model", "postprocess_model"])
def test_light_triton_models_do_not_load_torch_or_the_engine(model):
    """A Python-backend stub loads only what its model uses: the text models run
    without torch (lazy package ``__init__``s, torch-free settings)."""
    code = (f"import sys, types; sys.modules[{PB_UTILS!r}] = types.ModuleType({PB_UTILS!r}); "
            f"import tandem.backends.triton.{model}; "
            "heavy = sorted(m for m in ('torch', 'tandem.backends.engine.llm_engine', "
            "'tandem.backends.models.llama') if m in sys.modules); print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_lazy_exports_resolve():
    import importlib
    for pkg in ("tandem.backends", "tandem.backends.engine", "tandem.backends.kv_cache",
                "tandem.backends.models", "tandem.backends.speculative", "tandem.backends.disagg"):
        mod = importlib.import_module(pkg)
        for name in mod.__all__:
            assert getattr(mod, name) is not None, (pkg, name)
        with pytest.raises(AttributeError, match="no attribute"):
            getattr(mod, "not_a_name")


# -- the checker itself catches what it must ----------------------------------------------

@pytest.mark.parametrize("folder, code, expected", [
    ("backends/kv_cache", "from ..engine import LLMEngine\n", "kv_cache imports tandem.backends.engine"),
    ("backends/engine", "def f():\n    from ..disagg import decode\n", "engine imports tandem.backends.disagg"),
    ("rdma", "from tandem.backends.kv_cache import KVPagePool\n", "rdma imports tandem.backends.kv_cache"),
    ("backends/speculative", "from tandem.backends.engine.proposers import MTPProposer\n",
     "speculative imports tandem.backends.engine.proposers"),
    ("backends/training", "from ..triton import settings\n", "training imports tandem.backends.triton"),
])
def test_a_wrong_direction_import_is_reported(folder, code, expected):
    (msg,) = layer_violations([Source(f"{folder}/_layer_probe.py", code)])
    assert expected in msg and "_layer_probe.py" in msg


@pytest.mark.parametrize("folder, code, expected", [
    ("backends/engine", "import triton_python_backend_utils as pb_utils\n", "outside backends/triton"),
    ("backends/disagg", "import tritonclient.grpc\n", "tritonclient outside"),
    ("rdma", "import torch\n", "rdma imports torch when it is imported"),
])
def test_a_misplaced_third_party_import_is_reported(folder, code, expected):
    (msg,) = third_party_violations([Source(f"{folder}/_layer_probe.py", code)])
    assert expected in msg


def test_rdma_may_import_torch_inside_a_function():
    code = "def wrap(t):\n    import torch\n    return torch.as_tensor(t)\n"
    assert third_party_violations([Source("rdma/_layer_probe.py", code)]) == []


def test_a_cycle_is_found():
    assert package_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert package_cycles({"a": {"b"}, "b": set()}) == []


PROBE = "tandem.backends.kv_cache"


@pytest.mark.parametrize("b_code, cycle", [
    ("from ._a import X\n", [f"{PROBE}._a", f"{PROBE}._b", f"{PROBE}._a"]),
    ("from . import A\n", [f"{PROBE}._a", f"{PROBE}._b", f"{PROBE}._a"]),   # a lazy export
    ("import tandem.backends.kv_cache._a as a\n", [f"{PROBE}._a", f"{PROBE}._b", f"{PROBE}._a"]),
    ("def f():\n    from ._a import X\n", None),        # runs when called, not when imported
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._a import X\n", None),
])
def test_a_module_level_import_cycle_is_reported(b_code, cycle):
    files = [Source("backends/kv_cache/__init__.py", '_EXPORTS = {"A": "._a"}\n'),
             Source("backends/kv_cache/_a.py", "from ._b import B\n"),
             Source("backends/kv_cache/_b.py", b_code)]
    found = module_cycles(files)
    if cycle is None:
        assert found == []
    else:
        (msg,) = found
        assert msg.startswith(" -> ".join(cycle) + " (backends/kv_cache/_a.py:1, backends/kv_cache/_b.py:")


def test_a_module_importing_a_name_of_its_eager_package_is_a_cycle():
    files = [Source("rdma/__init__.py", "from ._a import A\n"), Source("rdma/_a.py", "from . import B\n")]
    (msg,) = module_cycles(files)
    assert msg == "tandem.rdma -> tandem.rdma._a -> tandem.rdma (rdma/__init__.py:1, rdma/_a.py:1)"
