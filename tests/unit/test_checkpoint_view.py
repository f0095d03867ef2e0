"""The checkpoint code sees a CheckpointView, never the engine ([Note: checkpoint view] in
deepspeed/runtime/checkpoint/view.py). Read from the source (no processes): every field of the view is
typed, and no module of the checkpoint code names `engine` as a value (a parameter, `engine.x`,
`getattr(engine, ...)`) or reads one of the engine's private attributes from anything, so the boundary
cannot come back unnoticed."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import deepspeed
from deepspeed.runtime.checkpoint.view import CheckpointView, Counters

PACKAGE = Path(deepspeed.__file__).parent
CHECKPOINT_CODE = sorted((PACKAGE / "runtime" / "checkpoint").glob("*.py")) + [PACKAGE / "runtime" / "pipe" /
                                                                                "checkpoint.py"]
# what the engine keeps to itself: the view carries each of these under a public field name
ENGINE_PRIVATE = {"_stage3", "_expert_comm", "_split", "_pending_checkpoint", "_pending_slot", "_checkpoint_slot",
                  "_config", "_has_optimizer", "_checkpoint_reader", "_extra_checkpoint_files", "_checkpoint_view"}


def engine_reads(source: str) -> list[str]:
    """Lines of `source` that take or read an engine: a name, argument or parameter `engine`, or an
    engine-private attribute read from any object (directly or by getattr/hasattr)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "engine":
            found.append(f"line {node.lineno}: the name `engine`")
        elif isinstance(node, ast.arg) and node.arg == "engine":
            found.append(f"line {node.lineno}: a parameter `engine`")
        elif isinstance(node, ast.Attribute) and node.attr in ENGINE_PRIVATE:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in ENGINE_PRIVATE):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_the_checkpoint_code_reads_no_engine() -> None:
    bad = {path.relative_to(PACKAGE).as_posix(): hits for path in CHECKPOINT_CODE
           if (hits := engine_reads(path.read_text()))}
    assert not bad, f"checkpoint modules reading the engine instead of the CheckpointView: {bad}"


def test_the_check_sees_each_kind_of_engine_read() -> None:
    """(So the test above cannot pass by finding nothing.)"""
    assert engine_reads("def f(engine):\n    pass\n")
    assert engine_reads("x = engine.module\n")
    assert engine_reads("x = getattr(view, '_stage3', None)\n")
    assert engine_reads("x = f'{engine.global_steps}'\n")
    assert engine_reads("x = view._split\n")
    assert not engine_reads("def f(view):\n    return view.stage3, is_moe_engine(view)  # engine.x\n")


def test_every_view_field_is_typed() -> None:
    for cls in (CheckpointView, Counters):
        for field in dataclasses.fields(cls):
            kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
            assert kind and "Any" not in kind, f"{cls.__name__}.{field.name} is typed {kind!r}: name what it is"
    assert CheckpointView.__dataclass_params__.frozen
