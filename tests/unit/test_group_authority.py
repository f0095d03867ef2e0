"""One owner of process groups (DESIGN.md 13, issue 38 item 1): outside `deepspeed/comm` (the
transport facade) only `runtime/mesh.py` creates groups. A module that called `new_group` itself
would make a second authority whose ranks could disagree with the mesh's, and would have to create
its groups in the same order on every rank by its own discipline. Reads the package's source (~1 s)."""

from __future__ import annotations

import ast
import pathlib

import deepspeed

CREATORS = {"new_group", "new_subgroups", "new_subgroups_by_enumeration", "init_device_mesh", "DeviceMesh"}
OWNERS = {"comm", "runtime/mesh.py"}


def _creator_calls(path: pathlib.Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in CREATORS:
                lines.append(node.lineno)
    return lines


def test_only_the_mesh_creates_process_groups():
    root = pathlib.Path(deepspeed.__file__).parent
    found = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in OWNERS or rel in OWNERS:
            continue
        lines = _creator_calls(path)
        if lines:
            found[rel] = lines
    assert not found, f"process groups created outside runtime/mesh.py: {found}"


def test_the_scan_sees_a_creator(tmp_path):
    """The scan is not vacuous: a module calling `dist.new_group` is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch.distributed as dist\ng = dist.new_group(ranks=[0, 1])\n")
    assert _creator_calls(bad) == [2]
