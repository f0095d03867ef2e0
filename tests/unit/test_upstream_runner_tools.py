"""tools/upstream_tests: splitting a selection into per-file argument files (chunks.py) and resuming
a file after upstream's harness timed out outside a forked test (resume.py). Pure file work."""

from __future__ import annotations

import os
import subprocess
import sys

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "upstream_tests")
FILE = "unit/v1/zero/test_x.py"


def _run(script: str, *args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(TOOLS, script), *args], capture_output=True, text=True,
                          cwd=cwd)


def test_chunks_one_argument_file_per_test_file(tmp_path) -> None:
    tests = tmp_path / "tests"
    (tests / "unit" / "a").mkdir(parents=True)
    for name in ("test_one.py", "test_two.py", "helper.py"):
        (tests / "unit" / "a" / name).write_text("")
    ids = tmp_path / "ids.txt"
    ids.write_text("unit/b/test_three.py::TestC::test_d[1 2]\nunit/b/test_three.py::test_e\n")
    out = tmp_path / "chunks"
    assert _run("chunks.py", str(out), "unit/a", "--ids", str(ids), cwd=str(tests)).returncode == 0
    files = sorted(os.listdir(out))
    assert files == ["unit_a_test_one.py.args", "unit_a_test_two.py.args", "unit_b_test_three.py.args"]
    assert (out / "unit_a_test_one.py.args").read_text() == "unit/a/test_one.py\n"
    # node ids keep their spaces: one per line, for pytest's @file
    assert (out / "unit_b_test_three.py.args").read_text().splitlines() == [
        "unit/b/test_three.py::TestC::test_d[1 2]", "unit/b/test_three.py::test_e"]


def _junit(path, cases: list[tuple[str, str]]) -> None:
    body = "".join(f'<testcase classname="{c}" name="{n}"/>' for c, n in cases)
    path.write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")


def test_resume_deselects_what_ran_and_the_hung_test(tmp_path) -> None:
    chunk = tmp_path / "f.args"
    chunk.write_text(FILE + "\n")
    junit = tmp_path / "f.xml"
    _junit(junit, [("unit.v1.zero.test_x.TestA", "test_ok[1]"), ("unit.v1.zero.test_x", "test_plain")])
    log = tmp_path / "f.log"
    log.write_text(f"\x1b[1mcollected 5 items\x1b[0m\n{FILE}::TestA::test_ok[1] \x1b[32mPASSED\x1b[0m\n"
                   f"{FILE}::test_plain PASSED\n{FILE}::TestB::test_hangs [2026 INFO] starting\n"
                   "INTERNALERROR> Failed: Timeout >150.0s\n")
    out, hung = tmp_path / "f.r1.resume", tmp_path / "f.hung1.xml"
    result = _run("resume.py", str(chunk), str(out), str(hung), str(log), str(junit))
    assert result.returncode == 0, result.stderr
    assert out.read_text().splitlines() == [
        FILE, f"--deselect={FILE}::TestA::test_ok[1]", f"--deselect={FILE}::TestB::test_hangs",
        f"--deselect={FILE}::test_plain"]
    # the hung test is counted as a failure, under the names report.py reads
    sys.path.insert(0, TOOLS)
    try:
        import report
    finally:
        sys.path.remove(TOOLS)
    assert report.outcomes(str(hung)) == {f"{FILE}::unit.v1.zero.test_x.TestB::test_hangs": "failed"}
    # a second resume (the resumed run hung too) also deselects the first hung test
    log2 = tmp_path / "f.r1.log"
    log2.write_text(f"{FILE}::TestB::test_other\nINTERNALERROR> Timeout\n")
    out2 = tmp_path / "f.r2.resume"
    assert _run("resume.py", str(chunk), str(out2), str(tmp_path / "f.hung2.xml"), str(log2),
                str(junit), str(hung)).returncode == 0
    assert f"--deselect={FILE}::TestB::test_hangs" in out2.read_text().splitlines()
    assert f"--deselect={FILE}::TestB::test_other" in out2.read_text().splitlines()


def test_resume_stops_when_no_test_can_be_named(tmp_path) -> None:
    chunk = tmp_path / "f.args"
    chunk.write_text(FILE + "\n")
    log = tmp_path / "f.log"
    log.write_text("INTERNALERROR> during collection\n")
    assert _run("resume.py", str(chunk), str(tmp_path / "o"), str(tmp_path / "h.xml"), str(log)).returncode == 1
    assert not (tmp_path / "o").exists()


def test_resume_of_selected_ids_stops_when_all_ran(tmp_path) -> None:
    chunk = tmp_path / "f.args"
    chunk.write_text(f"{FILE}::TestA::test_a\n{FILE}::TestA::test_b\n")
    junit = tmp_path / "f.xml"
    _junit(junit, [("unit.v1.zero.test_x.TestA", "test_a")])
    log = tmp_path / "f.log"
    log.write_text(f"{FILE}::TestA::test_a PASSED\n{FILE}::TestA::test_b\nINTERNALERROR> Timeout\n")
    result = _run("resume.py", str(chunk), str(tmp_path / "o"), str(tmp_path / "h.xml"), str(log), str(junit))
    assert result.returncode == 1   # test_b hung and was the last one asked for: nothing left
