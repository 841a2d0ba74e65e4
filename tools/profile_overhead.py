"""Where the per-call time of ``course_lib.flash_attention`` goes on the host (issue 33, item 2).

    python tools/profile_overhead.py                       # CPU: the interpreter, launches as no-ops, then real
    python tools/profile_overhead.py --launches both       # GPU: no-ops (host work alone), then real launches
    python tools/profile_overhead.py --json out.json --top 20
    python tools/profile_overhead.py --stand-in 90         # CPU: the GPU path's host work, compiled for sm_90
    PYTHONPATH=/path/to/other/checkout python tools/profile_overhead.py   # time another version of course_lib

At a tiny shape (default B=1, H=4, N=128, d=64, causal) it times, per pass (forward alone under
``torch.no_grad``, and forward+backward with ``o.backward(do)``, gradients set to None after each
step as ``zero_grad(set_to_none=True)`` would), the library's eager call as users make it: a loop
of ``--calls`` calls after ``--warmup`` calls, wall clock, ``torch.cuda.synchronize()`` only before
and after the loop on a GPU. Then it runs the same loop under cProfile and prints the functions with
the most *own* time (``tottime``: time inside the function itself, not its callees).

``--launches noop`` replaces every Triton kernel launch by a no-op (:func:`no_launches`): what is
left is the host work (the library's validation, dispatch, allocations and argument packing,
Triton's argument binding, autograd; torch's own operations, such as the zero fill of dQ's fp32
buffer and the casts, still run). ``real`` launches the kernels (in Triton's interpreter on a CPU, so
there the kernels' Python execution dominates). ``both`` (the default on CPU) does one then the
other. Prints one line per (launches, pass) with microseconds per call, then the leaders.

``--stand-in 90`` (CPU only) takes the GPU path without a GPU: kernels are compiled for that compute
capability by :class:`course_lib.platform.stand_in.StandInDriver` and every launch does nothing, so
what is timed is the host work of GPU mode with Triton's compiled-kernel launches (argument binding,
``fit.choose``, launches by handle), on CPU tensors: the Hopper-only Gluon and TMA paths, which
need CUDA tensors, are not taken.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
from pathlib import Path

# Default shape: the (B=1, H=4, N=128, d=64, causal): small enough that a call is all overhead.
SHAPE = (1, 4, 128, 64)
CALLS = 300
WARMUP = 20
TOP = 15
# The loop is timed this many times; the fastest is reported (the others are the same work plus
# whatever else the machine did meanwhile), with the median beside it.
REPEATS = 7
PASSES = ("fwd", "fwd+bwd")


@contextlib.contextmanager
def no_launches():
    """Within it, every Triton kernel launch returns at once without running anything: on a GPU at
    the compiled kernel's launcher (``CompiledKernel.run``, what both Triton's ``JITFunction.run``
    and a launch by handle call last, so Triton's own per-call work still counts), in the
    interpreter at ``InterpretedFunction.run`` (which would run the kernel in Python)."""
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.interpreter import InterpretedFunction

    def run(self, *args, **kwargs):  # an interpreted launch
        return None

    def launcher(self):  # a compiled kernel's launcher
        return lambda *args, **kwargs: None

    saved = [(cls, name, cls.__dict__[name]) for cls, name in ((InterpretedFunction, "run"), (CompiledKernel, "run"))]
    from course_lib.kernels import plan

    # the plans' launches keep the launcher they were made with (launch.py): make them again inside
    plan.clear()
    InterpretedFunction.run = run
    CompiledKernel.run = property(launcher)
    try:
        yield
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)
        plan.clear()


def bench_module():
    """``course_lib.measure.bench`` (its eager timer and its steps), from the course_lib being timed, or this
    checkout's ``course_lib/measure/bench.py`` when that one is older than the eager timer (timing an older
    version of the library: the step still calls the older library's ``flash_attention``)."""
    from course_lib.measure import bench

    if hasattr(bench, "time_eager_loops"):
        return bench
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_bench_of_this_checkout", Path(__file__).resolve().parents[1] / "course_lib" / "measure" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def own_time_leaders(step, calls: int, top: int, grads=()) -> list[dict]:
    """The ``top`` functions by own time over ``calls`` calls under cProfile (µs per call)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
        for x in grads:
            x.grad = None
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{name} ({_short(path)}:{line})", "calls_per_step": ncalls / calls,
                     "own_us": tottime / calls * 1e6, "cum_us": cumtime / calls * 1e6})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


def kineto_table(step, calls: int, grads=()) -> str:
    """torch.profiler's table of ``calls`` calls (CPU and CUDA activity), sorted by device time: each
    kernel's time on the GPU against the wall time of the whole loop."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            step()
            for x in grads:
                x.grad = None
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / calls * 1e6
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60)
    return f"  torch.profiler over {calls} calls ({wall:.1f} µs per call under the profiler):\n{table}"


def _short(path: str) -> str:
    for marker in ("course_lib/", "triton/", "torch/"):
        if marker in path:
            return marker + path.split(marker, 1)[1]
    return path.rsplit("/", 1)[-1]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default=",".join(map(str, SHAPE)), help="B,H,N,d (default %(default)s)")
    p.add_argument("--dtype", default=None,
                   help="default bfloat16 on a GPU, float16 on CPU (the interpreter computes bf16 in fp32 "
                        "copies, a host path the GPU never takes)")
    p.add_argument("--causal", type=int, default=1, choices=(0, 1))
    p.add_argument("--pass", dest="passes", nargs="+", default=list(PASSES), choices=PASSES)
    p.add_argument("--launches", choices=("noop", "real", "both"), default=None,
                   help="default: real on a GPU, both on CPU")
    p.add_argument("--calls", type=int, default=None, help=f"timed calls (default {CALLS}; 20 with real "
                                                           "launches on CPU)")
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed loops; the fastest is reported")
    p.add_argument("--top", type=int, default=TOP, help="own-time leaders to print (0: none)")
    p.add_argument("--json", type=str, default=None, help="write the numbers here")
    p.add_argument("--impl", default="course", choices=("course", "sdpa_flash", "sdpa_cudnn"),
                   help="what to time: the library, or one of SDPA's backends (the yardstick's own host work)")
    p.add_argument("--kineto", type=int, default=0, metavar="CALLS",
                   help="GPU: also trace CALLS calls with torch.profiler and print the kernels' device time per "
                        "call (is the GPU or the host the bottleneck?)")
    p.add_argument("--stand-in", type=int, default=None, metavar="ARCH",
                   help="CPU only: the GPU path, compiled for this compute capability (e.g. 90), launches "
                        "doing nothing (course_lib.measure.reach's stand-in driver)")
    args = p.parse_args(argv)

    import torch

    from course_lib.platform import runtime

    if args.stand_in is not None:  # before any kernel module is imported, as course_lib.measure.reach does
        import os

        from triton.runtime import driver

        from course_lib.measure.reach import StandInDriver

        os.environ["TRITON_INTERPRET"] = "0"
        rt = runtime.use_stand_in_gpu(f"sm_{args.stand_in} (stand-in: compiles, never launches)")
        driver.set_active(StandInDriver(args.stand_in))
        # The stand-in "loads" a kernel without a module handle, and Triton loads a kernel whose
        # module is None again at every launch (running ptxas, in the stand-in): give it one, as a
        # GPU's driver does, so that a launch costs what it costs there.
        load_binary = driver.active.utils.load_binary
        driver.active.utils.load_binary = lambda *a: ("stand-in module", *load_binary(*a)[1:])
        args.launches = args.launches or "real"  # the stand-in's launches already do nothing
    else:
        rt = runtime.setup(verbose=False)
    dtype = getattr(torch, args.dtype or ("bfloat16" if rt.on_gpu else "float16"))
    shape = tuple(int(x) for x in args.shape.split(","))
    launches = args.launches or ("real" if rt.on_gpu else "both")
    modes = ("noop", "real") if launches == "both" else (launches,)
    print(f"{rt.describe()}\n{args.impl}: shape {shape}, {dtype}, causal={bool(args.causal)}; "
          f"python {sys.version.split()[0]}")
    sync = torch.cuda.synchronize if torch.cuda.is_available() and rt.on_gpu else None
    results = {"runtime": rt.describe(), "shape": shape, "dtype": str(dtype), "causal": bool(args.causal),
               "rows": []}
    for mode in modes:
        calls = args.calls or (CALLS if mode == "noop" or rt.on_gpu else 20)
        for pass_ in args.passes:
            bench = bench_module()
            q, k, v, _, step = bench._inputs_and_step(args.impl, shape, dtype, rt.device, bool(args.causal),
                                                      needs_grad=pass_ == "fwd+bwd")
            grads = (q, k, v) if pass_ == "fwd+bwd" else ()
            step()  # compile (GPU) and make what is kept per call signature, with real launches
            with no_launches() if mode == "noop" else contextlib.nullcontext():
                times = bench.time_eager_loops(step, calls=calls, warmup=args.warmup, repeats=args.repeats,
                                               grads=grads, sync=sync)
                leaders = own_time_leaders(step, calls, args.top, grads) if args.top else []
            us = min(times)
            print(f"\nlaunches={mode:<5} {pass_:<8} {us:9.1f} µs per call (fastest of {len(times)} loops of "
                  f"{calls} calls; median {statistics.median(times):.1f})")
            for r in leaders:
                print(f"  {r['own_us']:8.1f} µs own  {r['cum_us']:8.1f} cum  {r['calls_per_step']:5.1f}x  "
                      f"{r['function']}")
            if args.kineto and mode == "real" and rt.on_gpu:
                print(kineto_table(step, args.kineto, grads))
            results["rows"].append({"launches": mode, "pass": pass_, "us_per_call": round(us, 1),
                                    "us_per_call_median": round(statistics.median(times), 1), "calls": calls,
                                    "leaders": leaders})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
