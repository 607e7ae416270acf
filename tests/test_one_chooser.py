"""One chooser: ``engine/selection.py`` is the only module of hpmoe that picks a path, a
backend, a scheduling policy or a dispatch mode; the rest receive the choice.

A branch picks when its test reads a member of ``Backend``, ``Path``, ``SchedulePolicy``
or ``DispatchMode`` and one of its arms makes a region path (``ExactPath(...)`` and the
others), calls ``select``, replaces an option's ``backend`` or ``schedule``, returns or
assigns such a member, or returns a call (a dispatch on the member); and a conditional
expression picks when one of its values is such a member.  A branch that only raises (a
check of the options) picks nothing."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "hpmoe"
CHOICES = {"Backend", "Path", "SchedulePolicy", "DispatchMode"}
PATHS = {"ExactPath", "KernelByKernelPath", "RuntimePath", "TritonPath", "select"}
# modules that branch on a choice without being the chooser, and why
ALLOWED = {
    "engine/selection.py": "the chooser",
    "schedule/tune.py": "AUTO's tuner, which selection consults: its candidates and the knobs it stores",
    "bench/runner.py": "`hpmoe bench` times each path by name, beside the one selection picks",
}


def _member(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in CHOICES and node.attr.isupper())


def _reads_member(node: ast.AST) -> bool:
    return any(_member(n) for n in ast.walk(node))


def _arm_picks(arm: list[ast.AST]) -> bool:
    for stmt in arm:
        if isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Call):
            return True
        for n in ast.walk(stmt):
            if isinstance(n, ast.Call):
                name = getattr(n.func, "id", None) or getattr(n.func, "attr", "")
                replaced = {k.arg for k in n.keywords} & {"backend", "schedule"}
                if name in PATHS or (name == "replace" and replaced):
                    return True
            if isinstance(n, ast.Return | ast.Assign) and n.value is not None and _reads_member(n.value):
                return True
    return False


def _branch_picks(n: ast.AST) -> bool:
    if isinstance(n, ast.If):
        return _reads_member(n.test) and (_arm_picks(n.body) or _arm_picks(n.orelse))
    if isinstance(n, ast.IfExp):
        values = [ast.Expr(n.body), ast.Expr(n.orelse)]
        return _member(n.body) or _member(n.orelse) or (_reads_member(n.test) and _arm_picks(values))
    return False


def picks(source: str) -> list[int]:
    """The lines of ``source`` where a branch picks (the module's docstring)."""
    return sorted(n.lineno for n in ast.walk(ast.parse(source)) if _branch_picks(n))


def test_the_scan_sees_each_kind_of_pick_and_passes_a_check() -> None:
    def scan(code: str) -> list[int]:
        return picks(textwrap.dedent(code))
    assert scan("""
        if o.backend is Backend.TRITON:
            return TritonPath(o)
    """) == [2]
    assert scan("""
        if o.schedule is SchedulePolicy.AUTO:
            o = replace(o, schedule=p)
    """) == [2]
    assert scan("""
        if policy is SchedulePolicy.SERIAL:
            return serial_schedule(graph)
    """) == [2]
    assert scan("p = o.schedule if fixed else SchedulePolicy.HYPERPARALLEL") == [1]
    assert scan("""
        if tiles.dispatch is DispatchMode.PER_NODE:
            mode = DispatchMode.PER_RANK
    """) == [2]
    assert scan("""
        if o.backend is Backend.AUTO:
            raise ValueError("backend='auto' needs a layer")
    """) == []
    assert scan("auto = o.schedule is SchedulePolicy.AUTO") == []


def test_only_the_selection_module_picks_a_path_or_a_policy() -> None:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        lines = picks(path.read_text())
        if lines and name not in ALLOWED:
            found[name] = lines
    assert not found, f"branches that pick outside engine/selection.py (module: lines): {found}"
    assert picks((PACKAGE / "engine/selection.py").read_text()), "the scan finds the chooser's own picks"


def test_the_former_options_policy_still_answers_with_a_deprecation_warning() -> None:
    import pytest

    from hpmoe.engine import RegionOptions
    from hpmoe.engine.selection import runtime_policy
    from hpmoe.schedule import SchedulePolicy

    for o in (RegionOptions(), RegionOptions(schedule=None)):
        with pytest.warns(DeprecationWarning, match="runtime_policy"):
            assert o.policy is runtime_policy(o) is SchedulePolicy.HYPERPARALLEL
