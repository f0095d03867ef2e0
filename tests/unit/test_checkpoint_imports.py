"""No import cycle among the checkpoint modules (deepspeed/checkpoint, deepspeed/runtime/checkpoint).

An AST scan: every `import` / `from ... import`, at module level or inside functions (a lazy
import is still a dependency), resolved to a module path; the graph restricted to the checkpoint
modules must be acyclic, so imports point one way."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("deepspeed/checkpoint", "deepspeed/runtime/checkpoint")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str, name: str) -> set[str]:
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}  # `from . import zero3_io`
    return found


def checkpoint_graph() -> dict[str, set[str]]:
    paths = {}
    for package in PACKAGES:
        for entry in sorted(os.listdir(os.path.join(ROOT, package))):
            if entry.endswith(".py"):
                path = os.path.join(ROOT, package, entry)
                paths[_module_name(path)] = path
    return {name: {m for m in _imports(path, name) if m in paths and m != name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_scan_sees_the_modules_and_their_edges():
    graph = checkpoint_graph()
    assert "deepspeed.runtime.checkpoint.writer" in graph and "deepspeed.checkpoint.reader" in graph
    assert "deepspeed.runtime.checkpoint.zero3_io" in graph["deepspeed.runtime.checkpoint.writer"]
    assert "deepspeed.checkpoint.files" in graph["deepspeed.checkpoint.reader"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_among_checkpoint_modules():
    cycle = find_cycle(checkpoint_graph())
    assert cycle is None, " -> ".join(cycle)
