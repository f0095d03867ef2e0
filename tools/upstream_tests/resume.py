"""After a pytest INTERNALERROR (exit 3: upstream's harness timed out outside the forked test), the
arguments that run the rest of the file: the chunk's own, minus every test already reported, minus
the one that hung. The hung test is written as a failure into its own junit file, so it counts.

    python resume.py CHUNK.args OUT.args HUNG.xml LOG [JUNIT.xml ...]

Exit 1 when nothing is left to run (or the hung test cannot be named: no progress is possible)."""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from xml.sax.saxutils import quoteattr


def reported(junit_files: list[str], module_file: str) -> set[str]:
    """Node ids of the tests the junit files report."""
    module = module_file[:-3].replace("/", ".")
    ids = set()
    for path in junit_files:
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError):
            continue
        for case in root.iter("testcase"):
            classname, name = case.get("classname", ""), case.get("name", "")
            cls = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
            ids.add(f"{module_file}::{cls + '::' if cls else ''}{name}")
    return ids


def hung_test(log: str, module_file: str) -> str | None:
    """The last test the verbose log started (the one running when the timeout fired)."""
    last = None
    with open(log, errors="replace") as f:
        for line in f:
            line = re.sub(r"\x1b\[[0-9;]*m", "", line)
            if line.startswith(module_file + "::"):
                last = line.split()[0]
    return last


def main() -> int:
    chunk, out, hung_xml, log, *junit = sys.argv[1:]
    with open(chunk) as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("--deselect")]
    module_file = lines[0].split("::")[0]
    done = reported(junit, module_file)
    hung = hung_test(log, module_file)
    if hung is None or hung in done:
        return 1
    module = module_file[:-3].replace("/", ".")
    parts = hung[len(module_file) + 2:].split("::")
    classname = ".".join([module] + parts[:-1])
    with open(hung_xml, "w") as f:
        f.write(f'<testsuites><testsuite name="pytest"><testcase classname={quoteattr(classname)} '
                f'name={quoteattr(parts[-1])}><failure message="timed out: the harness stopped the file '
                f'(pytest INTERNALERROR), the rest was resumed without it"/></testcase></testsuite></testsuites>\n')
    wanted = [line for line in lines if "::" in line]
    if wanted and all(w in done or w == hung for w in wanted):
        return 1
    with open(out, "w") as f:
        f.write("\n".join(lines + [f"--deselect={i}" for i in sorted(done | {hung})]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
