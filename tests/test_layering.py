"""Each room imports only downward: engine <- config/data/models/tasks/metrics/compare/checkpoint/plan <-
launcher <- train <- commands <- cli (the planner sits beside models and config: it never imports the loop).

Every module under ``kfac_bench/`` is parsed (not imported) and every ``import`` in it, at any depth
(imports inside functions are arrows too), is resolved to a module name, relative imports included.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import kfac_bench

ROOT = Path(kfac_bench.__file__).resolve().parent

#: Layer of each top-level part of kfac_bench: a part may import parts of lower layers, and parts of its
#: own layer as long as no cycle forms.
LAYER = {
    "kfac": 0,
    "errors": 0,
    "rank_zero": 0,  # from_main: a value as rank 0 has it (torch.distributed only)
    "safe_files": 0,  # writing inside a run directory without following links (standard library only)
    "config": 1,
    "data": 1,
    "models": 1,
    "tasks": 1,
    "metrics": 1,  # in-run recording
    "compare": 1,  # after-the-fact comparison of recorded runs
    "checkpoint": 1,
    "plan": 1,  # imports kfac, config, data, models; never train or commands
    "launcher": 2,  # starting and supervising ranks; never the training loop
    "train": 3,
    "commands": 4,
    "cli": 5,
}


def _module_name(path: Path) -> str:
    parts = ["kfac_bench", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[str]:
    """Absolute names of the modules ``path`` imports."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            yield stem
            # `from package import module` imports the submodule.
            yield from (f"{stem}.{alias.name}" for alias in node.names)


def _part(module: str) -> str | None:
    """The top-level part of kfac_bench that ``module`` belongs to (None: not kfac_bench's)."""
    pieces = module.split(".")
    if pieces[0] != "kfac_bench" or len(pieces) == 1:
        return None
    return pieces[1] if pieces[1] in LAYER else None


MODULES = sorted(ROOT.rglob("*.py"))
EDGES = {
    (path, target)
    for path in MODULES
    for target in _imports(path)
    if _part(target) is not None and _part(target) != _part(_module_name(path))
}


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {
        p.name.removesuffix(".py") for p in ROOT.iterdir() if not p.name.startswith(("_", "."))
    }
    parts -= {"py.typed"}
    assert parts == set(LAYER)


def test_the_engine_imports_only_torch_and_the_standard_library() -> None:
    for path in MODULES:
        if _part(_module_name(path)) != "kfac":
            continue
        for target in _imports(path):
            top = target.split(".")[0]
            allowed = top in sys.stdlib_module_names or top == "torch"
            allowed = allowed or target.startswith("kfac_bench.kfac") or target == "kfac_bench"
            assert allowed, f"{path.relative_to(ROOT)} imports {target}"


@pytest.mark.parametrize(
    "low",
    ["data", "models", "tasks", "metrics", "compare", "checkpoint", "config", "plan", "launcher"],
)
def test_lower_rooms_never_import_the_loop_or_the_commands(low: str) -> None:
    upward = [
        f"{p.relative_to(ROOT)} -> {t}"
        for p, t in EDGES
        if _part(_module_name(p)) == low and _part(t) in ("train", "commands", "cli")
    ]
    assert not upward


def test_every_import_arrow_points_down_or_sideways() -> None:
    upward = [
        f"{p.relative_to(ROOT)} -> {t}"
        for p, t in EDGES
        if LAYER[_part(t) or ""] > LAYER[_part(_module_name(p)) or ""]
    ]
    assert not upward


def test_no_import_cycle_between_parts() -> None:
    graph: dict[str, set[str]] = {part: set() for part in LAYER}
    for path, target in EDGES:
        graph[_part(_module_name(path)) or ""].add(_part(target) or "")
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> None:
        assert node not in trail, "import cycle: " + " -> ".join([*trail, node])
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*trail, node])
        done.add(node)

    for part in sorted(graph):
        visit(part, [])


def test_resolution_sees_relative_and_nested_imports() -> None:
    # The walker itself: a relative import inside a function of a subpackage module is an arrow.
    source = ROOT / "kfac" / "layers" / "__init__.py"
    assert any(t.startswith("kfac_bench.kfac.layers.") for t in _imports(source))
    assert any(_part(t) == "train" for t in _imports(ROOT / "commands" / "train.py"))
