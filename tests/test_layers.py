"""The package's import contract (docs/design.md, "Import direction"), checked on the source with `ast`.

Every module under mla_ops/ belongs to a layer; a module may import its own layer and the layers below,
never one above, function-local imports included (they run too, only later). Outside its package, no
module uses another module's underscore names. `import mla_ops` loads no optional heavy package.
"""
from __future__ import annotations

import ast
import contextlib
import os
import pathlib
import subprocess
import sys
from typing import Iterator, NamedTuple, Optional

PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[1] / "mla_ops"

# Lowest first. A module's layer is its longest matching prefix. The foundation modules import nothing
# of the package but each other; `mla_ops` itself (the package's __init__) binds the backends and
# offers `mla_ops.patch`, a lazy import of the transformers integration; `models` (the DeepSeek-V2
# configs of the CLI, the benchmarks and the tests) sits with `testing`.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("mla_ops._version", "mla_ops._library", "mla_ops._checks", "mla_ops._optional",
                    "mla_ops.settings", "mla_ops.pypto_runtime")),
    ("ops", ("mla_ops.ops",)),
    ("kernels", ("mla_ops.kernels",)),
    ("backends", ("mla_ops.backends",)),
    ("integrations", ("mla_ops.integrations", "mla_ops")),
    ("testing", ("mla_ops.testing", "mla_ops.models")),
    ("bench", ("mla_ops.bench",)),
    ("cli", ("mla_ops.cli", "mla_ops.__main__")),
)
LAYER_NAMES = [name for name, _ in LAYERS]

# Packages `import mla_ops` must leave unimported: each is optional, heavy, or breaks `import torch`
# on a machine without its runtime (torch_npu without CANN).
NOT_IMPORTED_BY_IMPORT_MLA_OPS = ("transformers", "torch_npu", "torchair", "pypto", "vllm")


def module_names(root: pathlib.Path = PACKAGE_ROOT) -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every .py file under `root` (a package's is its __init__)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = module_names()


def layer_of(module: str) -> int:
    """Index into LAYERS of `module`'s layer (longest prefix wins)."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS (and to docs/design.md)")
    return best


def package_of(module: str) -> str:
    """The package a module belongs to: a package's own __init__ belongs to the package itself."""
    if MODULES[module].name == "__init__.py":
        return module
    return module.rpartition(".")[0]


class Use(NamedTuple):
    target: str  # the mla_ops module imported (or whose attribute is read)
    name: Optional[str]  # the attribute read from it, when there is one
    line: int


def _resolve_from(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name of `from <...> import` in `module`."""
    if node.level == 0:
        return node.module or ""
    base = package_of(module).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _nearest_module(dotted: str) -> Optional[str]:
    """The longest prefix of `dotted` that is a module of the package."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in MODULES:
            return candidate
    return None


def uses(module: str) -> Iterator[Use]:
    """Every import of an mla_ops module in `module` (module level or not), and every attribute read
    through a name bound to an mla_ops module (`alias._name`)."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"), filename=str(MODULES[module]))
    aliases: dict[str, str] = {}  # local name -> mla_ops module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "mla_ops":
                    continue
                yield Use(alias.name, None, node.lineno)
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    aliases["mla_ops"] = "mla_ops"
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, node)
            if source.split(".")[0] != "mla_ops":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:  # `from package import module`
                    yield Use(submodule, None, node.lineno)
                    aliases[alias.asname or alias.name] = submodule
                else:  # `from module import name`
                    yield Use(_nearest_module(source) or source, alias.name, node.lineno)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, inner = [node.attr], node.value
        while isinstance(inner, ast.Attribute):
            chain.append(inner.attr)
            inner = inner.value
        if not isinstance(inner, ast.Name) or inner.id not in aliases:
            continue
        dotted = ".".join([aliases[inner.id], *reversed(chain)])
        owner = _nearest_module(dotted)
        rest = dotted[len(owner) + 1:].split(".") if owner and len(dotted) > len(owner) else []
        if owner and rest:
            yield Use(owner, rest[0], node.lineno)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def layer_violations() -> list[str]:
    found = []
    for module in MODULES:
        mine = layer_of(module)
        for use in uses(module):
            if use.target not in MODULES:
                found.append(f"{module}:{use.line} imports {use.target}, which is not a module of the package")
            elif layer_of(use.target) > mine:
                found.append(f"{module}:{use.line} ({LAYER_NAMES[mine]}) imports {use.target} "
                             f"({LAYER_NAMES[layer_of(use.target)]}, a higher layer)")
    return found


def _import_time_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when a module is imported: all but function bodies."""
    for node in body:
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _import_time_statements(inner)


def module_level_import_cycles() -> list[list[str]]:
    """Cycles among the imports a module runs when it is imported (its top-level statements; a package's
    implicit import of its parent is left out: Python loads the parent first)."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        graph[module] = set()
        for node in _import_time_statements(ast.parse(MODULES[module].read_text(encoding="utf-8")).body):
            if isinstance(node, ast.Import):
                graph[module] |= {_nearest_module(a.name) for a in node.names if a.name.split(".")[0] == "mla_ops"}
            elif isinstance(node, ast.ImportFrom):
                source = _resolve_from(module, node)
                if source.split(".")[0] == "mla_ops":
                    graph[module] |= {f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES
                                      else _nearest_module(source) for a in node.names}
        graph[module].discard(module)
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycles.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return cycles


def private_name_violations() -> list[str]:
    """Underscore names (and underscore modules) used from outside the package that owns them."""
    found = []
    for module in MODULES:
        for use in uses(module):
            if use.target not in MODULES:
                continue
            parts = use.target.split(".")
            # an underscore module in the path is private to the package above it
            for end, part in enumerate(parts):
                owner = ".".join(parts[:end])
                if _private(part) and not (module == owner or module.startswith(owner + ".")):
                    found.append(f"{module}:{use.line} uses {use.target}, private to {owner}")
            if use.name is not None and _private(use.name):
                owner = package_of(use.target)
                if not (module == owner or module.startswith(owner + ".")):
                    found.append(f"{module}:{use.line} uses {use.target}.{use.name}, private to {owner}")
    return found


def test_every_module_has_a_layer():
    assert len(MODULES) > 50, f"found only {len(MODULES)} modules under {PACKAGE_ROOT}"
    for module in MODULES:
        layer_of(module)


def test_no_module_imports_a_higher_layer():
    violations = layer_violations()
    assert not violations, "imports against docs/design.md's import direction:\n" + "\n".join(violations)


def test_no_module_level_import_cycle():
    cycles = module_level_import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_underscore_name_is_used_outside_its_package():
    violations = private_name_violations()
    assert not violations, "private names used outside their package:\n" + "\n".join(violations)


@contextlib.contextmanager
def _with_lines_added(module: str, source: str, tmp_path: pathlib.Path) -> Iterator[None]:
    """Check a copy of `module` with `source` appended instead of the module itself."""
    copy = tmp_path / "module.py"
    copy.write_text(MODULES[module].read_text(encoding="utf-8") + "\n" + source, encoding="utf-8")
    original = MODULES[module]
    MODULES[module] = copy
    try:
        yield
    finally:
        MODULES[module] = original


def test_the_contract_sees_upward_imports_and_cycles(tmp_path):
    """The checks find what they look for: an upward import written into a copy of a module, at module
    level (which also closes a cycle: cli.bench imports bench.timing) and inside a function."""
    with _with_lines_added("mla_ops.bench.timing", "from ..cli import bench\n", tmp_path):
        violations, cycles = layer_violations(), module_level_import_cycles()
    assert any("mla_ops.bench.timing:" in v and "(bench) imports mla_ops.cli.bench (cli, a higher layer)" in v
               for v in violations), violations
    assert any(set(cycle) == {"mla_ops.bench.timing", "mla_ops.cli.bench"} for cycle in cycles), cycles
    local = "def later():\n    from mla_ops.integrations.transformers import patch\n"
    with _with_lines_added("mla_ops.ops.rope", local, tmp_path):
        violations = layer_violations()
    assert any("mla_ops.ops.rope:" in v and "(ops) imports mla_ops.integrations.transformers.patch "
               "(integrations, a higher layer)" in v for v in violations), violations


def test_the_contract_sees_private_names(tmp_path):
    source = "from ..kernels.pypto import kv_prolog_stage2 as s2\nbuild = s2._build_kernel\n"
    with _with_lines_added("mla_ops.bench.timing", source, tmp_path):
        violations = private_name_violations()
    assert any("mla_ops.kernels.pypto.kv_prolog_stage2._build_kernel, private to mla_ops.kernels.pypto" in v
               for v in violations), violations


def test_import_mla_ops_loads_no_optional_package():
    code = ("import sys, mla_ops, torch\n"
            "assert torch.ops.mla.kv_prolog is not None\n"
            f"print(sorted(name for name in {NOT_IMPORTED_BY_IMPORT_MLA_OPS!r} if name in sys.modules))")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=PACKAGE_ROOT.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"`import mla_ops` imported {out.stdout.strip()}"
