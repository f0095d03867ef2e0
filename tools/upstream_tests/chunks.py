"""Split a selection of upstream tests into one pytest argument file per test file.

    python chunks.py OUT_DIR [PATH_OR_NODE_ID ...] [--ids FILE]

Paths (folders or files, relative to upstream's tests/) expand to their test_*.py files; node ids
(file::Class::test[param]) and the lines of --ids keep only those tests. Writes OUT_DIR/<name>.args,
one argument per line, for `pytest @file` (node ids may hold spaces and quotes)."""

from __future__ import annotations

import argparse
import collections
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out")
    parser.add_argument("select", nargs="*")
    parser.add_argument("--ids")
    args = parser.parse_args()
    items = list(args.select)
    if args.ids:
        with open(args.ids) as f:
            items += [line.strip() for line in f if line.strip()]
    by_file: dict[str, list[str]] = collections.defaultdict(list)
    for item in items:
        if "::" in item:
            by_file[item.split("::")[0]].append(item)
        elif os.path.isfile(item):
            by_file[item] = []
        else:
            for root, _, files in os.walk(item):
                for name in files:
                    if name.startswith("test_") and name.endswith(".py"):
                        by_file[os.path.join(root, name)] = []
    os.makedirs(args.out, exist_ok=True)
    for file, ids in sorted(by_file.items()):
        with open(os.path.join(args.out, file.replace("/", "_") + ".args"), "w") as f:
            f.write("\n".join(sorted(set(ids)) or [file]) + "\n")


if __name__ == "__main__":
    main()
