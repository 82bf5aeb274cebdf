"""The package's layering, read from its source: imports run one way (the face -> tiers,
events -> registry -> events/types.py; events/log -> migrations), no function-level import
dodges a cycle, and torch stays in the tiers, the manager and the engine integrations.

Every module is parsed, not imported, so the test sees imports that only run on some paths. An
import inside a function is a deferred one: allowed to keep a heavy dependency lazy, never to
reach a module that imports this one back.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Which layer may import which (besides itself). The face may import anything.
MAY_IMPORT = {
    "types": set[str](),
    "registry": {"types"},
    "migrations": set[str](),
    "events": {"types", "registry", "migrations"},
    "tiers": {"types", "registry", "events"},
}
# Modules that may import torch: the tiers hold KV bytes in torch tensors, and the manager and
# the engine integrations hand them over, the G3 recovery opens a slot file. Everything else
# runs in the light install.
TORCH_USERS = ("kvledger.tiers", "kvledger.manager", "kvledger.recovery", "kvledger.integrations")


@dataclass
class Module:
    name: str
    path: Path
    top: list[tuple[str, int]] = field(default_factory=list)  # run on import
    deferred: list[tuple[str, int]] = field(default_factory=list)  # inside a function
    torch_lines: list[int] = field(default_factory=list)


def _source_folders() -> Iterator[tuple[str, Path]]:
    """(package, folder) of every package pyproject.toml installs."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped: dict[str, str] = setup["package-dir"]
    for package in setup["packages"]:
        base = max((p for p in mapped if package == p or package.startswith(p + ".")), key=len)
        rest = package[len(base) :].strip(".")
        yield package, ROOT / mapped[base] / Path(*rest.split(".")) if rest else ROOT / mapped[base]


def _layer(module: str) -> str:
    if module == "kvledger.events.types":
        return "types"
    for layer in ("registry", "tiers", "events", "migrations"):
        if module == f"kvledger.{layer}" or module.startswith(f"kvledger.{layer}."):
            return layer
    return "face"


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


@cache
def modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for package, folder in _source_folders():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = Module(name, path)
    for module in found.values():
        package = module.name if module.path.stem == "__init__" else module.name.rpartition(".")[0]
        _read_imports(module, package, set(found))
    return found


def _read_imports(module: Module, package: str, known: set[str]) -> None:
    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            roots = names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            roots = [base]
            names = [f"{base}.{alias.name}" for alias in node.names]
            names = [name if name in known else base for name in names]
        if any(root.split(".")[0] == "torch" for root in roots):
            module.torch_lines.append(node.lineno)
        return [name for name in names if name in known]

    def walk(nodes: list[ast.stmt], deferred: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                walk(node.body, True)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                walk(node.orelse, deferred)  # the TYPE_CHECKING branch never runs
            elif isinstance(node, ast.Import | ast.ImportFrom):
                into = module.deferred if deferred else module.top
                into.extend((target, node.lineno) for target in targets(node))
            else:
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, ast.stmt):
                        walk([child], deferred)

    walk(ast.parse(module.path.read_text()).body, False)


def _loaded_by_importing(name: str) -> set[str]:
    """Every project module that importing ``name`` runs: its parent packages first, then what
    each module imports at its top level."""
    known = modules()
    seen: set[str] = set()
    stack = [name]
    while stack:
        current = stack.pop()
        parts = current.split(".")
        for module in [".".join(parts[:i]) for i in range(1, len(parts) + 1)]:
            if module in known and module not in seen:
                seen.add(module)
                stack.extend(target for target, _ in known[module].top)
    return seen


def _where(module: Module, line: int) -> str:
    return f"{module.path.relative_to(ROOT)}:{line}"


def test_the_source_is_found() -> None:
    names = modules()
    assert {"kvledger", "kvledger.events.log.event_log", "kvledger.migrations.runner"} <= set(names)
    assert sum(len(m.top) for m in names.values()) > 100


def test_imports_run_one_way() -> None:
    wrong = [
        f"{_where(module, line)}: {_layer(module.name)} imports {target} ({_layer(target)})"
        for module in modules().values()
        if _layer(module.name) != "face"
        for target, line in module.top + module.deferred
        if _layer(target) != _layer(module.name)
        and _layer(target) not in MAY_IMPORT[_layer(module.name)]
    ]
    assert wrong == []


def test_no_function_level_import_dodges_a_cycle() -> None:
    """A deferred import of a module that, when imported, imports this one back is a cycle put
    off to run time; the fix is to cut the cycle, not to hide it in a function."""
    dodges = [
        f"{_where(module, line)}: {module.name} imports {target} in a function, and importing "
        f"{target} imports {module.name}"
        for module in modules().values()
        for target, line in module.deferred
        if module.name in _loaded_by_importing(target)
    ]
    assert dodges == []


def test_torch_stays_in_the_tiers_the_manager_and_the_integrations() -> None:
    known = modules()
    users = {name for name, module in known.items() if module.torch_lines}
    outside = [
        _where(known[name], line)
        for name in sorted(users)
        if not name.startswith(TORCH_USERS)
        for line in known[name].torch_lines
    ]
    assert outside == []
    assert "kvledger.tiers.base" in users  # the test reads torch imports at all
    # and no module of the light install reaches one that imports torch as it is imported
    light = [name for name in known if not name.startswith(TORCH_USERS)]
    chains = {
        name: sorted(_loaded_by_importing(name) & users)
        for name in light
        if _loaded_by_importing(name) & users
    }
    assert chains == {}
