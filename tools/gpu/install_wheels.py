"""Install the wheels tools/gpu/fetch_wheels.sh put in a folder into target folders (never into
the interpreter's site-packages), with no network and no dependency resolution.

    python tools/gpu/install_wheels.py --wheels .whl --target T/deps --ds-target T/ds --report T/install.json

Every name in <wheels>/manifest.txt goes into --target (which check.sh puts on PYTHONPATH);
the DeepSpeed wheel, if there is one, goes alone into --ds-target, which only the benchmark's
DeepSpeed subprocess puts on its path (the two `deepspeed` packages must never meet in one
process). A name with no wheel for this interpreter is an error that names this interpreter's
tag and the tags the folder holds, so a device image whose Python differs from the one the
wheels were fetched for says so at once. pip installs when the interpreter has it; otherwise
the wheels (zip files) are unpacked, which is what pip does for them minus scripts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import sysconfig
import time
import zipfile

_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)"
                    r"-(?P<plat>[^-]+)\.whl$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _interpreter_tags() -> set[tuple[str, str, str]]:
    try:
        from packaging.tags import sys_tags
        return {(t.interpreter, t.abi, t.platform) for t in sys_tags()}
    except ImportError:   # a plain rule: this CPython's own tag, abi3, or pure Python, on linux x86-64
        cp = f"cp{sys.version_info.major}{sys.version_info.minor}"
        plats = {"any"} | {p for p in (sysconfig.get_platform().replace("-", "_").replace(".", "_"),)} | {
            f"manylinux{v}_x86_64" for v in ("1", "2010", "2014", "_2_5", "_2_12", "_2_17", "_2_28")}
        tags = {(cp, cp, p) for p in plats} | {(cp, "abi3", p) for p in plats} | {(cp, "none", p) for p in plats}
        older = {f"cp3{m}" for m in range(2, sys.version_info.minor + 1)}
        tags |= {(o, "abi3", p) for o in older for p in plats}
        return tags | {(py, "none", p) for py in ("py3", f"py3{sys.version_info.minor}") for p in plats}


def compatible(filename: str, tags: set[tuple[str, str, str]]) -> bool:
    m = _WHEEL.match(filename)
    if not m:
        return False
    return any((py, abi, plat) in tags for py in m["py"].split(".") for abi in m["abi"].split(".")
               for plat in m["plat"].split("."))


def choose(wheels_dir: str, names: list[str], tags) -> tuple[dict[str, str], dict[str, list[str]]]:
    """{name: wheel file} for this interpreter, and {name: [tags held]} for the names with none."""
    files = sorted(f for f in os.listdir(wheels_dir) if f.endswith(".whl"))
    chosen, missing = {}, {}
    for name in names:
        mine = [f for f in files if _norm(_WHEEL.match(f)["name"]) == _norm(name)] if files else []
        ok = [f for f in mine if compatible(f, tags)]
        if ok:
            chosen[name] = ok[-1]
        else:
            missing[name] = sorted({"-".join(f[:-4].split("-")[-3:]) for f in mine}) or ["no wheel at all"]
    return chosen, missing


def top_levels(wheel_path: str) -> list[str]:
    """The importable names a wheel installs (its top-level packages and modules)."""
    with zipfile.ZipFile(wheel_path) as z:
        roots = {n.split("/")[0] for n in z.namelist()}
    names = set()
    for r in roots:
        if r.endswith((".dist-info", ".data")):
            continue
        if r.endswith(".py"):
            names.add(r[:-3])
        elif "." not in r:
            names.add(r)
        elif r.endswith(".so"):
            names.add(r.split(".")[0])
    return sorted(names)


def _has_pip() -> bool:
    return subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0


def install(paths: list[str], target: str) -> str:
    """Install wheel files into target; returns the method used."""
    os.makedirs(target, exist_ok=True)
    if not paths:
        return "none"
    if _has_pip():
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
               "--no-compile", "--upgrade", "--target", target, *paths]
        subprocess.run(cmd, check=True)
        return "pip"
    for p in paths:
        with zipfile.ZipFile(p) as z:
            z.extractall(target)
    return "unzip"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", required=True, help="folder with the wheels and manifest.txt")
    ap.add_argument("--target", required=True, help="folder for everything in manifest.txt")
    ap.add_argument("--ds-target", required=True, help="folder for the DeepSpeed wheel alone")
    ap.add_argument("--report", required=True, help="JSON file written with what was installed")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    report = {"python": sys.version.split()[0], "python_tag": here, "wheels": os.path.abspath(args.wheels),
              "target": args.target, "ds_target": args.ds_target, "installed": {}, "modules": [],
              "deepspeed_wheel": None, "missing": {}}
    manifest = os.path.join(args.wheels, "manifest.txt")
    if not os.path.isdir(args.wheels) or not os.path.isfile(manifest):
        report["error"] = (f"--wheels {args.wheels!r} has no manifest.txt: run tools/gpu/fetch_wheels.sh where "
                           "there is network and carry .whl to the device")
        _write(args.report, report)
        print(report["error"], file=sys.stderr)
        return 2
    names = [n.strip() for n in open(manifest) if n.strip() and not n.startswith("#")]
    tags = _interpreter_tags()
    chosen, missing = choose(args.wheels, names, tags)
    report["missing"] = missing
    if missing:
        report["error"] = (f"no wheel in {args.wheels} for this interpreter (Python {report['python']}, tag {here}): "
                           + "; ".join(f"{n} has {', '.join(t)}" for n, t in missing.items())
                           + f". Fetch them with PY_VERSIONS={sys.version_info.major}.{sys.version_info.minor} "
                           "tools/gpu/fetch_wheels.sh")
        print(report["error"], file=sys.stderr)
    paths = [os.path.join(args.wheels, f) for f in chosen.values()]
    report["method"] = install(paths, args.target)
    report["installed"] = chosen
    report["modules"] = sorted({m for p in paths for m in top_levels(p)} - {"bin"})
    ds, _ = choose(args.wheels, ["deepspeed"], tags)
    if ds:
        install([os.path.join(args.wheels, ds["deepspeed"])], args.ds_target)
        report["deepspeed_wheel"] = ds["deepspeed"]
    report["seconds"] = round(time.perf_counter() - t0, 2)
    _write(args.report, report)
    print(f"installed {len(chosen)} wheels into {args.target} ({report['method']}); "
          f"deepspeed wheel: {report['deepspeed_wheel'] or 'none (the DeepSpeed side-by-side is skipped)'}")
    return 1 if missing else 0


def _write(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
