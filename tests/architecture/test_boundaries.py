"""The package's shape: no import circles, dependencies point one way, and training never loads ops tooling."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sdc_telemetry"

# What each layer may import from the package (besides itself). Top-level modules are listed by name.
ALLOWED: dict[str, set[str]] = {
    "core": {"core"},
    "parallel": {"core", "parallel"},
    "checks": {"core", "checks"},
    "sinks": {"core", "sinks"},
    "step": {"core", "checks"},
    "measure": {"core", "parallel", "checks"},
    "monitor": {"core", "parallel", "checks", "sinks", "step", "measure"},
    "integrations": {"core", "sinks", "monitor", "step", "stop", "integrations"},
    "stop": {"core", "monitor"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Intra-package modules ``name`` imports (anywhere in the file, lazy imports included)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            submodules = {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules}
            found |= submodules
            if len(submodules) < len(node.names):  # names defined in ``mod`` itself, not only its submodules
                found.add(mod)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "package"


def test_import_graph_has_no_circle() -> None:
    """No module of the package reaches itself through its imports (lazy imports included)."""
    graph = _graph()
    assert len(graph) > 30 and sum(map(len, graph.values())) > 50  # the graph was really built
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt):], nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, f"import circles: {circles}"


def test_dependencies_point_from_training_to_core_and_never_to_ops() -> None:
    """core imports only core; parallel and checks only core; sinks never checks, parallel or ops; nothing on the
    training path imports ops."""
    graph = _graph()
    wrong = []
    for module, deps in graph.items():
        allowed = ALLOWED.get(_layer(module))
        if allowed is None:
            continue
        for dep in deps:
            if dep != "sdc_telemetry" and _layer(dep) not in allowed:
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "imports against the layering: " + ", ".join(sorted(wrong))
    checked = [m for m in graph if _layer(m) in ALLOWED]
    assert len(checked) > 25


def test_core_imports_no_telemetry_or_ops_libraries() -> None:
    """The detection core is torch and the standard library: no OpenTelemetry, prometheus_client, yaml, grafanalib."""
    heavy = ("opentelemetry", "prometheus_client", "yaml", "grafanalib", "safetensors", "lightning", "transformers")
    offenders = []
    for path in (PACKAGE / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in heavy]
    assert not offenders, offenders


def test_monitored_training_never_loads_ops_grafanalib_or_yaml() -> None:
    """One process and 2 DDP ranks train with every sink on; none loads grafanalib, yaml or sdc_telemetry.ops."""
    script = Path(__file__).with_name("_training_path.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = [result["single"], *result["ddp"]]
    assert len(runs) == 3
    for run in runs:
        assert run["forbidden"] == [], run["forbidden"]
        assert run["incidents"] == 0 and run["certified"] == 4
        assert run["passes"].get("grad_local", 0) >= 3  # the checks really ran, through the real telemetry
    for rank in result["ddp"]:
        assert rank["passes"].get("weights", 0) >= 3 and rank["passes"].get("replay", 0) >= 2
        assert rank["passes"].get("grad_reduced", 0) >= 3
