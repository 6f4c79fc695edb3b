"""Unpack the Python side of the vllm 0.33.0 wheel into build/vllm033/site (run by `make vllm033`).

Only the files vLLM's Python code reads are taken (.py, .json, .jinja and the .dist-info metadata);
its compiled extensions (.so: vllm._C, flash-attention, ...) and CUDA headers are left in the wheel,
so nothing compiled from vLLM can be imported from this tree even by accident.

    python tests/compat/build_vllm033.py WHEEL SITE_DIR
"""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

KEEP_SUFFIXES = (".py", ".json", ".jinja", ".typed")


def wanted(name: str) -> bool:
    top = name.split("/", 1)[0]
    if top.endswith(".dist-info"):
        return not name.endswith("/RECORD")  # RECORD would list files that are not here
    return top == "vllm" and name.endswith(KEEP_SUFFIXES)


def main(wheel: str, site: str) -> int:
    wheel_path, site_path = Path(wheel), Path(site)
    if not wheel_path.is_file():
        print(f"build_vllm033: wheel not found: {wheel_path}", file=sys.stderr)
        return 2
    tmp = site_path.with_name(site_path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    count = 0
    with zipfile.ZipFile(wheel_path) as zf:
        for info in zf.infolist():
            if info.is_dir() or not wanted(info.filename):
                continue
            target = tmp / info.filename
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            count += 1
    if not (tmp / "vllm" / "distributed" / "weight_transfer" / "base.py").is_file():
        print(f"build_vllm033: {wheel_path} has no vllm/distributed/weight_transfer/base.py", file=sys.stderr)
        return 2
    shutil.rmtree(site_path, ignore_errors=True)
    tmp.rename(site_path)  # whole or not at all
    print(f"build_vllm033: {count} files from {wheel_path.name} -> {site_path}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
