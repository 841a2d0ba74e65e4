"""Which launch config each kernel gets on GPUs we do not have: ``python -m course_lib.measure.reach``.

Triton compiles for any NVIDIA GPU without one: the compiler only needs the target's compute
capability. This module gives Triton the stand-in driver of :mod:`course_lib.platform.stand_in` for
a target (A100 = sm_80; A10 / RTX 3090 = sm_86; L4 / RTX 4090 = sm_89; H100 = sm_90; Blackwell: B200
= sm_100, RTX 50xx / RTX PRO 6000 / Colab's G4 = sm_120, compiled by the Blackwell ``ptxas`` Triton
3.7+ bundles for arch >= 100), calls the library's real launchers on CPU tensors,
and lets :func:`course_lib.kernels.fit.choose` pick each config exactly as it does on a real GPU:
compile, "load" (the stand-in reports the target's shared-memory limit, and the registers and
spills that the bundled ``cuobjdump`` reads from the compiled binary), keep the first candidate
that fits without spilling. The launch itself does nothing.

It prints one row per kernel launch: target, kernel, dtype, head dim, causal, N, the chosen config,
its shared memory against the limit, registers, spilled bytes, compile time, and whether the
choice is the H100 table's. ``--check`` exits 1 when a launch does not fit or spills where the
H100 choice (on sm_90) does not; a test runs it on a subset (tests/test_reach.py). Spills of a
launch the survey did not compile for sm_90 cannot be judged so: they are listed as NOT CHECKED.

    python -m course_lib.measure.reach                       # every target, dtype and head dim (minutes)
    python -m course_lib.measure.reach --targets 86 --dtypes float16 --head-dims 128 --check
    python -m course_lib.measure.reach --targets 80,86,89,90,100,120 --check --jobs 2   # the issue's check
    python -m course_lib.measure.reach --targets 90 --dtypes float32 --head-dims 256 --families attention --causal 0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from course_lib.platform.hardware import COMPUTE_TARGETS
from course_lib.platform.stand_in import StandInDriver, resource_usage

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (16, 32, 64, 128, 256)
# attention: forward (and its TMA variant) + backward; decode: split-KV; masked: chapter 10's three
# kernels (a sliding window through the API, forward and backward)
FAMILIES = ("attention", "decode", "masked")
SEQ_LENS = {"short": 1024, "long": 16384}  # the tables pick by sequence length (tuning.py)
DECODE_CACHE_LEN = 16384
DECODE_HEADS = (8, 2)  # query heads, K/V heads: a GQA group of 4, so the grouped kernel runs too


# ----------------------------------------------------------------------------------------------
# The launches


def _launches(dtypes, head_dims, arch: int, families=FAMILIES, causals=(False, True)):
    """Yield (kernel family, dtype, d, causal, N, thunk) for every launch the library makes (of
    ``families``, with the masks ``causals``)."""
    import torch

    from course_lib.kernels import backward, decoding, forward, hopper, tuning

    target = COMPUTE_TARGETS[arch]
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        for d in head_dims:
            for causal in causals if "attention" in families else ():
                for label, n in SEQ_LENS.items():
                    q = torch.zeros(1, 1, n, d, dtype=dtype)

                    def attention(q=q, causal=causal):
                        o, lse = forward.attention_forward(q, q, q, causal, 0.125)
                        backward.attention_backward(q, q, q, q, o, lse, causal, 0.125)

                    yield "attention", dtype_name, d, causal, n, attention
                    # the descriptor forward is the library's on Hopper only (hopper.library_uses_tma):
                    # Blackwell has TMA too, but keeps chapter 06's kernel
                    if (target.wgmma and d in tuning.TMA_HEAD_DIMS and dtype.itemsize == 2):
                        def tma(q=q, causal=causal):
                            blocks = hopper.default_blocks(d, 2, n, causal)
                            hopper.attention_forward_tma(q, q, q, causal, 0.125, blocks=blocks)

                        yield "attention_tma", dtype_name, d, causal, n, tma
            for causal in causals if "masked" in families else ():
                n = SEQ_LENS["long"]

                def masked(dtype=dtype, d=d, causal=causal, n=n):
                    from course_lib.kernels import api

                    x = torch.zeros(1, 1, n, d, dtype=dtype, requires_grad=True)
                    o = api.flash_attention(x, x, x, causal=causal, window=(n // 4, 0))
                    o.backward(torch.zeros_like(o))  # a real dO: an expanded one would change the code

                yield "masked", dtype_name, d, causal, n, masked
            if "decode" not in families:
                continue
            q = torch.zeros(1, DECODE_HEADS[0], d, dtype=dtype)
            kv = torch.zeros(1, DECODE_HEADS[1], DECODE_CACHE_LEN, d, dtype=dtype)
            for grouped in (False, True):
                def decode(grouped=grouped):
                    decoding.flash_decode_triton(q, kv, kv, splits=8, grouped=grouped)  # splits: no SM count to ask

                yield "decode" + ("_grouped" if grouped else ""), dtype_name, d, False, DECODE_CACHE_LEN, decode


def _use_stand_in(arch: int) -> None:
    """In a fresh child process: GPU mode with :class:`StandInDriver` for ``arch``; the descriptor
    kernels take CPU tensors and allocate nothing (nothing launches)."""
    os.environ["TRITON_INTERPRET"] = "0"
    from triton.runtime import driver

    from course_lib.platform import runtime

    runtime.use_stand_in_gpu(f"sm_{arch} ({COMPUTE_TARGETS[arch].examples})")
    driver.set_active(StandInDriver(arch))
    from course_lib.kernels import hopper

    hopper.ensure_descriptor_allocator = lambda: None  # nothing is allocated: nothing launches
    hopper.tma_unsupported_reason = lambda *tensors: None  # CPU tensors stand in for the GPU's


def _child(arch: int, dtypes, head_dims, families=FAMILIES, causals=(False, True)) -> None:
    """Run in a fresh process: compile every launch for ``arch``; print one JSON line each."""
    _use_stand_in(arch)
    from course_lib.kernels import fit

    seen = set()
    for family, dtype, d, causal, n, launch in _launches(dtypes, head_dims, arch, families, causals):
        error = None
        start = time.perf_counter()
        try:
            launch()
        except fit.NoConfigFits as exc:
            error = str(exc)
        if error is not None:
            print(json.dumps({"target": arch, "family": family, "kernel": family, "dtype": dtype, "d": d,
                              "causal": causal, "n": n, "error": error}), flush=True)
        for key, choice in fit.CHOICES.items():
            if key in seen:
                continue
            seen.add(key)
            c = choice.chosen
            print(json.dumps({
                "target": arch, "family": family, "kernel": choice.kernel, "dtype": dtype, "d": d,
                "causal": causal, "n": n,
                "config": [c.blocks.block_m, c.blocks.block_n, c.blocks.num_warps, c.blocks.num_stages],
                "table": list(_astuple(choice.tried[0].blocks)), "shared": c.shared, "limit": c.limit,
                "registers": c.registers, "spill_bytes": c.spill_bytes,
                "compile_s": round(sum(t.compile_s for t in choice.tried), 2),
                "tried": [[list(_astuple(t.blocks)), t.shared, t.spill_bytes] for t in choice.tried],
                "grouped": bool(choice.meta.get("GROUPED", False))}), flush=True)
        _record_fixed(arch, family, dtype, d, causal, n, seen)


def _astuple(blocks):
    return blocks.block_m, blocks.block_n, blocks.num_warps, blocks.num_stages


def _record_fixed(arch, family, dtype, d, causal, n, seen) -> None:
    """Launches with a fixed config (the TMA forward, the decode combine) do not go through
    fit.choose; report what they compiled to."""
    from course_lib.kernels import decoding, hopper

    for kernel in (hopper.attention_forward_tma_kernel, decoding.combine_kernel):
        for device_cache in kernel.device_caches.values():
            for compiled in device_cache[0].values():
                if id(compiled) in seen:
                    continue
                seen.add(id(compiled))
                registers, local_bytes = resource_usage(compiled.asm["cubin"])
                meta = compiled.metadata
                print(json.dumps({
                    "target": arch, "family": family, "kernel": kernel.fn.__name__, "dtype": dtype, "d": d,
                    "causal": causal, "n": n, "config": [None, None, meta.num_warps, meta.num_stages],
                    "table": None, "shared": meta.shared,
                    "limit": COMPUTE_TARGETS[arch].max_shared_bytes_per_block,
                    "registers": registers, "spill_bytes": local_bytes, "compile_s": None, "tried": []}),
                    flush=True)


# ----------------------------------------------------------------------------------------------
# What the tensor cores are asked to do on each target (chapter 09, "Blackwell and FlashAttention-4")

# PTX instructions that say what a compiled kernel uses, by what they are named in the chapter.
PTX_INSTRUCTIONS = {
    "wgmma": r"wgmma\.mma_async",  # Hopper's warpgroup matmul, accumulator in registers
    "tcgen05.mma": r"tcgen05\.mma",  # Blackwell (sm_100): one thread issues it, accumulator in tensor memory
    "tensor memory": r"tcgen05\.(?:ld|st|alloc)",  # moving accumulators between tensor memory and registers
    "mma.sync": r"\bmma\.sync\.aligned",  # Ampere's warp-level matmul (sm_80-89, and sm_120)
    "TMA copy": r"cp\.async\.bulk\.tensor",  # a tile copied by the Tensor Memory Accelerator
}
PTX_FACT_KERNELS = ("attention_forward_kernel", "attention_forward_tma_kernel")  # chapters 06 and 09


def _ptx_facts_child(arch: int, head_dim: int) -> None:
    """Run in a fresh process: compile chapter 06's forward and chapter 09's descriptor forward
    (fp16, causal, N = 1024, the H100 table's tiles) for ``arch``; print one JSON line each."""
    _use_stand_in(arch)
    import torch

    from course_lib.kernels import forward, hopper, tuning

    n, causal = SEQ_LENS["short"], True
    q = torch.zeros(1, 1, n, head_dim, dtype=torch.float16)
    # the H100 tables' tiles on every target: one compile each (fit.choose would try several)
    forward.attention_forward(q, q, q, causal, head_dim ** -0.5,
                              blocks=tuning.gpu_default("forward", head_dim, 2, n, causal))
    hopper.attention_forward_tma(q, q, q, causal, head_dim ** -0.5, blocks=hopper.default_blocks(head_dim, 2, n, causal))
    for kernel in (forward.attention_forward_kernel, hopper.attention_forward_tma_kernel):
        for device_cache in kernel.device_caches.values():
            for compiled in list(device_cache[0].values())[:1]:
                ptx = compiled.asm["ptx"]
                registers, local_bytes = resource_usage(compiled.asm["cubin"])
                print(json.dumps({"target": arch, "kernel": kernel.fn.__name__, "shared": compiled.metadata.shared,
                                  "registers": registers, "spill_bytes": local_bytes,
                                  **{name: len(re.findall(pattern, ptx)) for name, pattern in PTX_INSTRUCTIONS.items()}}),
                      flush=True)


def ptx_facts(targets=(90, 100, 120), head_dim: int = 128) -> list[dict]:
    """Chapter 06's and chapter 09's forward kernels cross-compiled for each target (one child
    process each; no GPU needed): one row per (target, kernel) with how many of each
    :data:`PTX_INSTRUCTIONS` its PTX holds, its shared memory, registers and spilled bytes."""
    unknown = [t for t in targets if t not in COMPUTE_TARGETS]
    if unknown:
        raise ValueError(f"targets must be among {sorted(COMPUTE_TARGETS)}, got {unknown}")
    rows = []
    for arch in targets:
        proc = subprocess.Popen([sys.executable, "-m", "course_lib.measure.reach", "--ptx-facts", str(arch),
                                 "--head-dims", str(head_dim)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        rows += _collect(proc)
    return rows


def format_ptx_facts(rows: list[dict]) -> str:
    """One line per (target, kernel): the instruction counts, shared memory, registers, spills."""
    head = f"{'target':<7} {'kernel':<29}" + "".join(f"{name:>14}" for name in PTX_INSTRUCTIONS) + \
        f"{'shared KiB':>11}{'regs':>6}{'spills B':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"sm_{r['target']:<4} {r['kernel']:<29}" + "".join(f"{r[name]:>14}" for name in PTX_INSTRUCTIONS)
                     + f"{r['shared'] / 1024:>11.1f}{r['registers']:>6}{r['spill_bytes']:>9}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The parent: one child per target, the table, the checks


def survey(targets=tuple(COMPUTE_TARGETS), dtypes=DTYPES, head_dims=HEAD_DIMS, jobs: int = 1,
           families=FAMILIES, causals=(False, True)) -> list[dict]:
    """Compile every launch for each target (one child process per target) and return the rows."""
    cmds = [[sys.executable, "-m", "course_lib.measure.reach", "--child", str(arch), "--dtypes", ",".join(dtypes),
             "--head-dims", ",".join(map(str, head_dims)), "--families", ",".join(families),
             "--causal", ",".join(str(int(c)) for c in causals)] for arch in targets]
    rows, running = [], []
    for cmd in cmds:
        running.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        if len(running) >= jobs:
            rows += _collect(running.pop(0))
    for proc in running:
        rows += _collect(proc)
    return rows


def _collect(proc) -> list[dict]:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"compiling for a target failed:\n{err[-3000:]}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# The target whose spills every other target's are compared with: the H100 the tables were measured
# on (kernels.tuning.TABLE_ARCH), where a config keeps whatever it spills.
SPILLS_COMPARED_WITH = 90


def problems(rows: list[dict]) -> list[str]:
    """Launches that do not fit their target, and spills where the sm_90 choice of the same
    launch does not spill (spills are compared only where the rows hold that launch on sm_90:
    :func:`unchecked_spills` lists the others)."""
    found = [f"sm_{r['target']} {_name(r)} {r['dtype']} d={r['d']}: {r['error']}" for r in rows if "error" in r]
    found += [f"sm_{r['target']} {_name(r)} {r['dtype']} d={r['d']}: needs {r['shared']} B of shared "
              f"memory, the limit is {r['limit']} B" for r in rows if "error" not in r and r["shared"] > r["limit"]]
    on_h100 = _h100_spills(rows)
    for r in rows:
        if "error" in r or r["target"] == SPILLS_COMPARED_WITH or not r["spill_bytes"]:
            continue
        h100 = on_h100.get(_launch_key(r))
        if h100 is not None and h100 == 0:
            found.append(f"sm_{r['target']} {_name(r)} {r['dtype']} d={r['d']} causal={r['causal']} "
                         f"N={r['n']}: spills {r['spill_bytes']} B where the H100 choice does not")
    return found


def _h100_spills(rows: list[dict]) -> dict:
    """Spilled bytes of each launch compiled for sm_90, by :func:`_launch_key`."""
    return {_launch_key(r): r["spill_bytes"] for r in rows
            if r["target"] == SPILLS_COMPARED_WITH and "error" not in r}


def unchecked_spills(rows: list[dict]) -> list[dict]:
    """Rows that spill on a target other than sm_90 with no sm_90 row of the same launch to compare
    with (a survey without sm_90 in its targets): :func:`problems` cannot judge them."""
    on_h100 = _h100_spills(rows)
    return [r for r in rows if "error" not in r and r["target"] != SPILLS_COMPARED_WITH and r["spill_bytes"]
            and _launch_key(r) not in on_h100]


def _launch_key(r: dict) -> tuple:
    return _name(r), r["dtype"], r["d"], r["causal"], r["n"]


def _name(r: dict) -> str:
    return r["kernel"] + (" (grouped)" if r.get("grouped") else "")


def format_table(rows: list[dict], verbose: bool = False) -> str:
    head = (f"{'target':<7} {'kernel':<26} {'dtype':<9} {'d':>4} {'causal':<6} {'N':>6}  "
            f"{'config (M, N, warps, stages)':<28} {'shared KiB':>10} {'limit':>6} {'regs':>5} "
            f"{'spills B':>8} {'compile s':>9}  choice")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"sm_{r['target']:<4} {_name(r):<26} {r['dtype']:<9} {r['d']:>4} "
                         f"{str(r['causal']):<6} {r['n']:>6}  DOES NOT FIT: {r['error']}")
            continue
        config = "fixed" if r["table"] is None else str(tuple(r["config"]))
        choice = ("" if r["table"] is None else
                  "H100 table" if r["config"] == r["table"] else f"fitted (table {tuple(r['table'])})")
        compile_s = "" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        lines.append(f"sm_{r['target']:<4} {_name(r):<26} {r['dtype']:<9} {r['d']:>4} {str(r['causal']):<6} "
                     f"{r['n']:>6}  {config:<28} {r['shared'] / 1024:>10.1f} {r['limit'] / 1024:>6.0f} "
                     f"{r['registers']:>5} {r['spill_bytes']:>8} {compile_s:>9}  {choice}")
        if verbose and len(r["tried"]) > 1:
            lines += [f"{'':>12}tried {tuple(c)}: {shared / 1024:.1f} KiB, "
                      + ("does not fit" if spills is None else f"{spills} B spilled")
                      for c, shared, spills in r["tried"]]
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.measure.reach", description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", type=_ints, default=tuple(COMPUTE_TARGETS),
                        help="compute capabilities as Triton numbers, e.g. 80,86,89,90,100,120 (default: all)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="e.g. float16,bfloat16,float32")
    parser.add_argument("--head-dims", type=_ints, default=HEAD_DIMS, help="padded head dims, e.g. 64,128")
    parser.add_argument("--families", default=",".join(FAMILIES), help="attention, decode, masked (default: all)")
    parser.add_argument("--causal", type=_ints, default=(0, 1), help="masks of the attention launches: 0, 1 or 0,1")
    parser.add_argument("--jobs", type=int, default=1, help="targets compiled at once (one process each)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a launch does not fit or spills where the H100 choice does not")
    parser.add_argument("--verbose", action="store_true", help="also list every candidate tried")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ptx-facts", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dtypes = tuple(args.dtypes.split(","))
    families = tuple(args.families.split(","))
    unknown = [t for t in args.targets if t not in COMPUTE_TARGETS]
    if unknown or not set(dtypes) <= set(DTYPES):
        parser.error(f"targets must be among {sorted(COMPUTE_TARGETS)} and dtypes among {DTYPES}")
    if not set(families) <= set(FAMILIES) or not set(args.causal) <= {0, 1}:
        parser.error(f"families must be among {FAMILIES} and --causal among 0, 1")
    causals = tuple(bool(c) for c in args.causal)
    if args.child is not None:
        _child(args.child, dtypes, args.head_dims, families, causals)
        return 0
    if args.ptx_facts is not None:
        _ptx_facts_child(args.ptx_facts, args.head_dims[0])
        return 0
    rows = survey(args.targets, dtypes, args.head_dims, args.jobs, families, causals)
    print(format_table(rows, args.verbose))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    found = problems(rows)
    for line in found:
        print("PROBLEM:", line)
    for r in unchecked_spills(rows):  # said, not hidden: --check cannot judge them
        print(f"NOT CHECKED: sm_{r['target']} {_name(r)} {r['dtype']} d={r['d']} causal={r['causal']} N={r['n']}: "
              f"spills {r['spill_bytes']} B; no sm_{SPILLS_COMPARED_WITH} row of this launch to compare with")
    print(f"{len(rows)} launches compiled for {', '.join(f'sm_{t}' for t in args.targets)}; "
          f"{len(found)} problems")
    return 1 if (args.check and found) else 0


if __name__ == "__main__":
    sys.exit(main())
