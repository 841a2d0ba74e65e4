"""Check and time the Gluon forward (course_lib/kernels/gluon_hopper.py) on a Hopper GPU.

One call, a few minutes on an H100:

    PYTHONPATH=. python tools/gluon_forward.py --out gluon.json

For each variant of :data:`course_lib.kernels.gluon_hopper.VARIANTS` it prints and saves

1. what the compiled kernel uses: registers per thread, spilled bytes, shared memory, and the PTX
   evidence of the design (``wgmma.wait_group.sync.aligned 1``: a product left running across the
   softmax; ``setmaxnreg``: per-partition register budgets);
2. its error against a float64 reference (max |o - o_ref| and max |lse - lse_ref|) on ragged
   shapes, causal and not, fp16 and bf16, next to the TMA forward's error on the same inputs;
3. its speed in TFLOP/s (the median of a CUDA-graph replay, ``course_lib.measure.bench``'s timer and FLOP
   count) on the bench grid's cells at d=128, next to our TMA forward
   (:func:`course_lib.kernels.hopper.attention_forward_tma`) and SDPA's cuDNN backend.

Each variant (and the two baselines) runs in its own child process with a time limit: a variant
that fails to compile, crashes, or hangs on a barrier is reported and the script goes on (killing
the child frees the GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from course_lib.measure import bench
from course_lib.attention.reference import naive_attention_torch

CHECK_SHAPES = [(2, 3, 1000, 128), (2, 3, 2111, 128), (2, 3, 1000, 64)]
SPEED_SEQ_LENS = (1024, 4096, 16384)
SPEED_D = 128  # heads from bench.problem_shape: H·d = 2048, so H = 16
CHILD_TIMEOUT_S = 120  # one variant: compile, 16 error checks, 12 timed cells (about 30-60 s expected)
SILENCE_S = 40  # a child that prints nothing this long is stuck (each step prints within seconds)
DTYPES = ("float16", "bfloat16")
# Max abs error allowed (o in its dtype's precision; lse is float32), against float64.
O_TOL = {"float16": 4e-3, "bfloat16": 3e-2}
LSE_TOL = 1e-3


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}"
    return " ".join(text.split())[:300]


def compile_facts(gh, variant: str) -> dict:
    """Registers, spills, shared memory and PTX evidence of one variant (fp16, d=128, causal)."""
    q = torch.randn(1, 1, 256, 128, device="cuda", dtype=torch.float16)
    gh.attention_forward_gluon(q, q, q, True, variant=variant)
    torch.cuda.synchronize()
    return gh.kernel_facts(gh.attention_forward_gluon.last_kernel)


def check_errors(gh, hopper, variant: str) -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in CHECK_SHAPES:
        for dtype in DTYPES:
            for causal in (False, True):
                for layout in ("contiguous", "bnhd") if shape[2] == 1000 and shape[3] == 128 else ("contiguous",):
                    b, h, n, d = shape
                    if layout == "bnhd":  # (B, N, H, d) storage seen as (B, H, N, d): strided rows
                        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=getattr(torch, dtype),
                                               generator=gen).transpose(1, 2) for _ in range(3))
                    else:
                        q, k, v = (torch.randn(shape, device="cuda", dtype=getattr(torch, dtype), generator=gen)
                                   for _ in range(3))
                    o_ref, lse_ref = naive_attention_torch(q.double(), k.double(), v.double(), causal=causal)
                    row = {"variant": variant, "shape": list(shape), "dtype": dtype, "causal": causal,
                           "layout": layout}
                    try:
                        o, lse = gh.attention_forward_gluon(q, k, v, causal, variant=variant)
                        torch.cuda.synchronize()
                        row["o_err"] = (o.double() - o_ref).abs().max().item()
                        row["lse_err"] = (lse.double() - lse_ref).abs().max().item()
                        row["ok"] = bool(row["o_err"] <= O_TOL[dtype] and row["lse_err"] <= LSE_TOL)
                    except Exception as err:  # noqa: BLE001 - report and go on
                        row["error"] = _short(err)
                        row["ok"] = False
                    try:
                        o_t, lse_t = hopper.attention_forward_tma(q, k, v, causal, d ** -0.5)
                        row["tma_o_err"] = (o_t.double() - o_ref).abs().max().item()
                        row["tma_lse_err"] = (lse_t.double() - lse_ref).abs().max().item()
                    except Exception as err:  # noqa: BLE001
                        row["tma_error"] = _short(err)
                    rows.append(row)
                    print(f"  {variant:8} {str(shape):18} {dtype:9} causal={causal!s:5} {layout:10} "
                          + (f"o_err {row['o_err']:.2e} lse_err {row['lse_err']:.2e}" if "o_err" in row
                             else f"ERROR {row['error']}")
                          + (f"   (TMA: {row['tma_o_err']:.2e} {row['tma_lse_err']:.2e})" if "tma_o_err" in row else "")
                          + ("" if row["ok"] else "   <-- FAIL"), flush=True)
    return rows


def time_cell(fn, dtype: str, n: int, causal: bool, d: int = SPEED_D) -> float:
    """TFLOP/s of ``fn(q, k, v, causal)`` on one bench cell (B·N = 16k tokens, H·d = 2048; d=128
    unless ``d`` says otherwise: H=16)."""
    batch, heads = bench.problem_shape(n, d)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", dtype=getattr(torch, dtype), generator=gen)
               for _ in range(3))

    def step():
        with torch.no_grad():
            fn(q, k, v, causal)

    step()  # compile and warm up
    torch.cuda.synchronize()
    ms, _ = bench._time_ms(step, "cudagraph", None)
    return bench.flops(batch, heads, n, d, causal, "fwd") / (ms * 1e-3) / 1e12


def child(variant: str, speed: bool) -> dict:
    """Everything for one variant ("baselines": the TMA forward and cuDNN) in this process."""
    from course_lib.kernels import gluon_hopper as gh
    from course_lib.kernels import hopper

    out = {"compile": {}, "errors": [], "speed": []}
    if variant == "baselines":
        impls = {"tma": lambda q, k, v, c: hopper.attention_forward_tma(q, k, v, c, q.shape[-1] ** -0.5),
                 "sdpa_cudnn": bench._attention_fn("sdpa_cudnn")}
    else:
        if not gh.available():
            out["compile"][variant] = {"error": gh.GLUON_IMPORT_ERROR}
            return out
        try:
            out["compile"][variant] = compile_facts(gh, variant)
        except Exception as err:  # noqa: BLE001
            traceback.print_exc(limit=2)
            out["compile"][variant] = {"error": _short(err)}
            return out
        print(f"  {variant:8} {out['compile'][variant]}", flush=True)
        out["errors"] = check_errors(gh, hopper, variant)
        impls = {f"gluon_{variant}": lambda q, k, v, c: gh.attention_forward_gluon(q, k, v, c, variant=variant)}
    if speed:
        for dtype in DTYPES:
            for n in SPEED_SEQ_LENS:
                for causal in (False, True):
                    for name, fn in impls.items():
                        try:
                            tflops = round(time_cell(fn, dtype, n, causal), 1)
                        except Exception as err:  # noqa: BLE001
                            print(f"  {name} {dtype} N={n} causal={causal}: {_short(err)}", flush=True)
                            tflops = None
                        torch.cuda.empty_cache()
                        out["speed"].append({"impl": name, "dtype": dtype, "N": n, "causal": causal, "tflops": tflops})
                        print(f"  {name:14} {dtype:9} N={n:<6} causal={causal!s:5} {tflops} TFLOP/s", flush=True)
    return out


def run_child(variant: str, speed: bool, script: str | None = None, timeout_s: float = CHILD_TIMEOUT_S,
              silence_s: float = SILENCE_S) -> dict:
    """Run :func:`child` in a fresh process and relay its output; kill it when it prints nothing
    for ``silence_s`` seconds (a kernel waiting on a barrier that never completes) or runs past
    ``timeout_s``. Returns its results, or its failure as a result.

    ``script``: another tool whose ``--child VARIANT --out PATH [--no-speed]`` runs its own child
    and writes a JSON object with the keys ``compile``, ``errors`` and ``speed``
    (``tools/gluon_ablation.py``); None: this file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "child.json")
        cmd = [sys.executable, "-u", os.path.abspath(script or __file__), "--child", variant, "--out", path]
        if not speed:
            cmd.append("--no-speed")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        start = last = time.monotonic()
        why = None
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if not line:  # the child closed its output: it is ending
                    break
                print(line, end="", flush=True)
                last = time.monotonic()
            now = time.monotonic()
            if now - last > silence_s or now - start > timeout_s:
                why = (f"silent for {silence_s} s (a hang on a barrier?)" if now - last > silence_s
                       else f"still running after {timeout_s} s") + ": killed"
                proc.kill()
                break
        proc.wait()
        if why is None:
            if proc.returncode == 0 and os.path.exists(path):
                with open(path) as f:
                    return json.load(f)
            why = f"child exited with status {proc.returncode}"
        print(f"  {variant}: {why}", flush=True)
        return {"compile": {variant: {"error": why}}, "errors": [], "speed": []}


def speed_table(rows: list[dict]) -> str:
    """One line per (dtype, N, causal): TFLOP/s of each implementation."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["dtype"], r["N"], r["causal"]), {})[r["impl"]] = r["tflops"]
    lines = [f"  {'dtype':9} {'N':>6} {'causal':6} " + " ".join(f"{name:>14}" for name in impls)]
    for (dtype, n, causal), by_impl in cells.items():
        lines.append(f"  {dtype:9} {n:>6} {causal!s:6} " + " ".join(
            f"{by_impl[i]:>14.1f}" if by_impl.get(i) is not None else f"{'-':>14}" for i in impls))
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the variants")
    parser.add_argument("--no-speed", action="store_true", help="compile facts and errors only")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one variant, in this process
    args = parser.parse_args(argv)

    if args.child:
        out = child(args.child, not args.no_speed)
        with open(args.out, "w") as f:
            json.dump(out, f)
        return out

    import triton

    from course_lib.kernels import gluon_hopper as gh

    if not torch.cuda.is_available():
        sys.exit("tools/gluon_forward.py needs a CUDA GPU (a Hopper one for the Gluon kernels); "
                 "without one, tests/test_gluon_hopper.py cross-compiles them")
    result = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
              "compile": {}, "errors": [], "speed": []}
    print(result["meta"], flush=True)
    variants = args.variants.split(",") if args.variants else list(gh.VARIANTS)
    for variant in variants + ([] if args.no_speed else ["baselines"]):
        print(f"\n== {variant} ==", flush=True)
        part = run_child(variant, not args.no_speed)
        for key in ("compile", "errors", "speed"):
            if isinstance(result[key], dict):
                result[key].update(part[key])
            else:
                result[key] += part[key]

    print("\n== compiled kernels (fp16, d=128, causal) ==")
    for variant, facts in result["compile"].items():
        print(f"  {variant:8} {facts}")
    bad = [r for r in result["errors"] if not r["ok"]]
    print(f"\n== errors: {len(result['errors']) - len(bad)}/{len(result['errors'])} checks within tolerance "
          f"(o: {O_TOL}, lse: {LSE_TOL}) ==")
    for r in bad:
        print("  FAIL", r)
    if result["speed"]:
        print("\n== forward TFLOP/s, H=16, d=128, B·N=16k tokens (CUDA-graph median) ==")
        print(speed_table(result["speed"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", args.out)
    return result


if __name__ == "__main__":
    main()
