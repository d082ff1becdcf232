#!/usr/bin/env python3
"""Makes torch-sys's C++ wrapper compile against an older libtorch (the GPU machine's).

tch 0.26 generates a C function for every ATen op of libtorch 2.13; libtorch 2.11 lacks a few
of them (and changed one signature). This compiles the generated file against the given
libtorch with `-fsyntax-only`, and replaces the body of every function that fails with a
`throw`, which the wrapper's PROTECT turns into an error returned to Rust. The functions stay,
so the Rust side links unchanged; rtrun calls none of them. Repeats until the file compiles.

Usage: patch_torch_sys.py <torch-sys source copy> <libtorch dir (…/torch)>
"""
import re
import subprocess
import sys
from pathlib import Path


def errors(src: Path, libtorch: Path) -> set[int]:
    cmd = [
        "g++", "-std=c++17", "-fsyntax-only", "-D_GLIBCXX_USE_CXX11_ABI=1",
        "-DGLOG_USE_GLOG_EXPORT", f"-I{libtorch}/include",
        f"-I{libtorch}/include/torch/csrc/api/include", str(src / "libtch/torch_api_generated.cpp"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    lines = set()
    for m in re.finditer(r"torch_api_generated\.cpp:(\d+):\d+: error:", out.stderr):
        lines.add(int(m.group(1)))
    if out.returncode != 0 and not lines:
        sys.exit(f"patch_torch_sys: g++ failed without errors in the generated file:\n{out.stderr[-4000:]}")
    return lines


def stub(path: Path, bad_lines: set[int]) -> int:
    text = path.read_text().split("\n")
    stubbed = 0
    done = set()
    # Bottom up, so the line numbers of the errors above stay valid.
    for line in sorted(bad_lines, reverse=True):
        i = line - 1
        start = i
        while start >= 0 and not text[start].strip().startswith("PROTECT("):
            start -= 1
        end = i
        while end < len(text) and text[end].strip() != ")":
            end += 1
        if start < 0 or end >= len(text) or start in done:
            continue
        head = start
        while head >= 0 and not re.match(r"^\S.*\{\s*$", text[head]):
            head -= 1
        name = re.search(r"(\w+)\s*\(", text[head]).group(1) if head >= 0 else "function"
        text[start + 1:end] = [f'    throw std::runtime_error("{name}: not in this libtorch");']
        done.add(start)
        stubbed += 1
    path.write_text("\n".join(text))
    return stubbed


def main() -> None:
    src, libtorch = Path(sys.argv[1]), Path(sys.argv[2])
    generated = src / "libtch/torch_api_generated.cpp"
    total = 0
    for _ in range(20):
        bad = errors(src, libtorch)
        if not bad:
            print(f"patch_torch_sys: {total} wrapper functions stubbed", file=sys.stderr)
            return
        if stub(generated, bad) == 0:
            sys.exit(f"patch_torch_sys: cannot stub the errors at lines {sorted(bad)}")
        total += len(bad)
    sys.exit("patch_torch_sys: too many failing functions")


if __name__ == "__main__":
    main()
