"""Compile a set of the library's kernels for sm_90 (no GPU needed) and compare their PTX between
two trees: did a change that was meant to move code only (issue 38's layout) change a kernel?

    python tools/ptx_compare.py snapshot --repo /tmp/before --out /tmp/before.json
    python tools/ptx_compare.py snapshot --repo . --out /tmp/after.json
    python tools/ptx_compare.py compare /tmp/before.json /tmp/after.json    # exit 1 on a difference

``snapshot`` copies ``--repo``'s ``course_lib`` to one fixed folder (so both trees compile from the
same absolute path: the PTX's debug information and Triton's hashes of the kernels' globals name
it), runs one child Python process with that copy first on its path, Triton's stand-in driver for
sm_90 (compile and "load", never launch) and a fresh Triton cache (so nothing is read back from an
earlier compile), calls the library's own launchers on CPU tensors, and writes the PTX of every
kernel they compiled, keyed by kernel name and Triton's specialisation key. (One snapshot at a
time: they share the folder.)
The child imports the modules by their pre-layout names (``course_lib.reach``, ``course_lib.primer``),
which the new layout still answers (``course_lib/_moved.py``), so one snapshot code serves both trees.

``compare`` says, per kernel, whether the PTX is identical to the letter, identical once the source
locations are dropped (the ``.file``/``.loc`` lines and the DWARF debug sections name the source
file and line numbers: a moved file or a line added above a kernel changes them, not the code), or
different.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET_ARCH = 90  # H100: every kernel family of the library compiles for it, Gluon included
# The launches: each family once, at the sizes the library's tests cross-compile.
CHILD = r"""
import gc, json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch
from triton.runtime import driver
from triton.runtime.jit import JITFunction
from course_lib import runtime
from course_lib.reach import StandInDriver

arch = int(sys.argv[1])
runtime.use_stand_in_gpu(f"sm_{arch} (PTX comparison)")
driver.set_active(StandInDriver(arch))
from course_lib.kernels import backward, decoding, forward, hopper, teaching, tuning

hopper.ensure_descriptor_allocator = lambda: None  # nothing launches, nothing is allocated
hopper.tma_unsupported_reason = lambda *tensors: None  # CPU tensors stand in for the GPU's
from course_lib import primer

n, scale = 1024, 0.125
for d in (64, 128):
    q = torch.zeros(1, 2, n, d, dtype=torch.float16)
    o, lse = forward.attention_forward(q, q, q, True, scale)
    backward.attention_backward(q, q, q, q, o, lse, True, scale)
teaching.forward(q, q, q, True, scale)
hopper.attention_forward_tma(q, q, q, True, scale, blocks=hopper.default_blocks(128, 2, n, True))
decoding.flash_decode_triton(torch.zeros(1, 8, 128, dtype=torch.float16),
                             torch.zeros(1, 2, 4096, 128, dtype=torch.float16),
                             torch.zeros(1, 2, 4096, 128, dtype=torch.float16), splits=8)
from course_lib.kernels import api

x = torch.zeros(1, 2, n, 64, dtype=torch.float16, requires_grad=True)
out = api.flash_attention(x, x, x, causal=True, window=(n // 4, 0))
out.backward(torch.zeros_like(out))
x = torch.zeros(4096, dtype=torch.float32)
primer.vector_add(x, x)
primer.row_softmax(torch.zeros(64, 100, dtype=torch.float32))
primer.matmul(torch.zeros(64, 32, dtype=torch.float16), torch.zeros(32, 64, dtype=torch.float16))
from course_lib.kernels import gluon_backward, gluon_hopper, gluon_masked

gluon_hopper.cross_compile("pingpong", 128)
gluon_backward.cross_compile(causal=True, head_dim=128)
gluon_masked.cross_compile()
gluon_backward.cross_compile_masked()

found = {}
for fn in gc.get_objects():
    if not isinstance(fn, JITFunction):
        continue
    for cache in fn.device_caches.values():
        for key, compiled in cache[0].items():
            found[f"{fn.__name__} {key}"] = compiled.asm["ptx"]
print(json.dumps(found))
"""


TREE = Path(tempfile.gettempdir()) / "ptx_compare_tree"  # where every snapshot compiles from


def snapshot(repo: Path, out: Path, timeout_s: int) -> int:
    """Write ``{kernel and key: PTX}`` of the launches in :data:`CHILD`, compiled from ``repo``'s
    ``course_lib`` (copied to :data:`TREE` first)."""
    shutil.rmtree(TREE, ignore_errors=True)
    shutil.copytree(repo / "course_lib", TREE / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "TRITON_INTERPRET": "0",
               "PYTHONPATH": os.pathsep.join([str(TREE), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-c", CHILD, str(TARGET_ARCH)], capture_output=True, text=True,
                              cwd=TREE, env=env, timeout=timeout_s)
    if done.returncode:
        print(f"the child process failed:\n{done.stderr[-3000:]}", file=sys.stderr)
        return 2
    kernels = json.loads(done.stdout.strip().splitlines()[-1])
    out.write_text(json.dumps({"repo": str(repo), "arch": TARGET_ARCH, "kernels": kernels}, indent=1))
    print(f"{len(kernels)} compiled kernels from {repo} -> {out}")
    return 0


def without_source_locations(ptx: str) -> str:
    """The PTX without what names the source: the ``.file``/``.loc`` lines and the debug sections."""
    code = re.split(r"\n\s*\.section\s+\.debug", ptx, maxsplit=1)[0]
    return "\n".join(line for line in code.splitlines() if not line.lstrip().startswith((".file", ".loc")))


HASH = re.compile(r"\b[0-9a-f]{64}\b")  # a JIT function passed as a constexpr appears in a key as its hash


def compare(before: dict, after: dict) -> list[str]:
    """One line per kernel: ``identical``, ``identical but source locations`` or what differs; a
    kernel compiled on one side only is a difference. Keys are paired with their hashes blanked (a
    constexpr function's hash covers its file's path and lines)."""
    pair = lambda d: {HASH.sub("<hash>", k): v for k, v in d.items()}  # noqa: E731
    before, after = pair(before), pair(after)
    lines = []
    for key in sorted(set(before) | set(after)):
        name = key.split(" ", 1)[0]
        if key not in before or key not in after:
            lines.append(f"DIFFERENT  {name}: compiled {'after' if key in after else 'before'} only ({key})")
        elif before[key] == after[key]:
            lines.append(f"identical  {name}")
        elif without_source_locations(before[key]) == without_source_locations(after[key]):
            lines.append(f"identical but source locations  {name}")
        else:
            lines.append(f"DIFFERENT  {name}: the instructions differ ({key})")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="compile the kernels from one tree and write their PTX")
    snap.add_argument("--repo", type=Path, required=True, help="the tree whose course_lib is compiled")
    snap.add_argument("--out", type=Path, required=True)
    snap.add_argument("--timeout", type=int, default=3600, help="seconds for the child process")
    cmp_ = sub.add_parser("compare", help="compare two snapshots; exit 1 when a kernel's instructions differ")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "snapshot":
        return snapshot(args.repo.resolve(), args.out, args.timeout)
    before, after = (json.loads(p.read_text())["kernels"] for p in (args.before, args.after))
    lines = compare(before, after)
    print("\n".join(lines))
    different = sum(line.startswith("DIFFERENT") for line in lines)
    print(f"{len(lines)} kernels: {sum(line.startswith('identical  ') for line in lines)} identical, "
          f"{sum(line.startswith('identical but') for line in lines)} identical but source locations, "
          f"{different} different")
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
