"""Per-file counts from a pytest junit XML of upstream's tests run against this package.

    python report.py junit.xml [more.xml ...] [--baseline upstream_junit.xml [...]]

With --baseline (the same tests run against DeepSpeed itself), the table also gives, per file,
how many of the tests that pass there pass here: the number the compatibility target is about.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def outcomes(path: str) -> dict[str, str]:
    """test id (file::name) -> passed | failed | error | skipped."""
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        parts = classname.split(".") if classname else []
        while parts and parts[-1][:1].isupper():   # test classes (TestX, TestX.TestY): keep the module
            parts.pop()
        if not parts and "." in case.get("name", ""):   # a collection error: name is the dotted module
            parts = case.get("name", "").split(".")
        file = case.get("file") or ("/".join(parts) + ".py" if parts else case.get("name", "?"))
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed"}.get(child.tag, child.tag)
                break
        result[f"{file}::{classname}::{case.get('name')}"] = status   # classes may share test names
    return result


def merged(paths: list[str]) -> dict[str, str]:
    result: dict[str, str] = {}
    for path in paths:
        try:
            result.update(outcomes(path))
        except ET.ParseError:   # a pytest that died before writing its XML: its folder counts nothing
            print(f"(unreadable, skipped: {path})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("junit", nargs="+", help="junit XML files (one per folder run); merged")
    parser.add_argument("--baseline", nargs="+")
    args = parser.parse_args()
    ours = merged(args.junit)
    base = merged(args.baseline) if args.baseline else None
    rows: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for test, status in ours.items():
        file = test.split("::")[0]
        rows[file][status] += 1
        if base is not None and base.get(test) == "passed":
            rows[file]["base"] += 1
            rows[file]["both"] += status == "passed"
    header = "| file | passed | failed | error | skipped |" + (" passes of upstream's passes |" if base else "")
    print(header)
    print("|---|---|---|---|---|" + ("---|" if base else ""))
    total: collections.Counter = collections.Counter()
    for file in sorted(rows):
        c = rows[file]
        total.update(c)
        extra = f" {c['both']}/{c['base']} |" if base else ""
        print(f"| {file} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} |{extra}")
    extra = f" {total['both']}/{total['base']} |" if base else ""
    print(f"| **total** | {total['passed']} | {total['failed']} | {total['error']} | {total['skipped']} |{extra}")


if __name__ == "__main__":
    main()
