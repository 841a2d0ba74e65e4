"""Ablation of the Gluon backward's overlap and persistent grid (issue 35) on a Hopper GPU: checks, then speed.

One call, about 5 minutes on an H100 (``--budget-s`` bounds it; what does not fit is listed as skipped):

    PYTHONPATH=. python tools/gluon_bwd_ablation.py --out $OUT/bwd.json

The switches are ``CONFIG["PIPELINE"]`` and ``CONFIG["PERSISTENT"]`` of
:mod:`course_lib.kernels.gluon_backward` (the dense kernel; both off by default). The configs
(:data:`CONFIGS`): ``baseline`` (the library's: each step adds its dQ after all five of its
products), ``overlap`` (the next step's Sᵀ and dPᵀ issued before the previous step's dQ atomics; Sᵀ
alone on the diagonal's masked steps), ``overlap_st`` (Sᵀ alone everywhere), ``persistent`` (one
program per SM walking the (key tile, batch·head) items, where N <= 2048) and ``persistent_overlap``
(both), each at d = 64 and d = 128. The persistent configs are timed only on cells with
N <= :data:`~course_lib.kernels.gluon_backward.PERSISTENT_MAX_N` (elsewhere they are the baseline's grid).

1. **Checks** (one child per config and head dim, in parallel): what the compiled kernel holds
   (registers, spills, shared memory, how many products are in flight at each run of dQ atomics,
   :func:`~course_lib.kernels.gluon_backward.dq_overlap`), and the error of dq, dk and dv against
   float64 on ragged and aligned shapes, fp16 and bf16, causal or not, ordinary inputs and the
   forward ablation's fuzz (logits up to ±500), beside SDPA's FlashAttention-2 backward on the same
   inputs. A case passes iff each gradient's max error is at most twice SDPA's (FlashAttention's rule).
2. **Speed** (one child per head dim, one after another, the GPU to themselves): the backward alone
   (Δ, the kernel and dQ's cast, after the library's forward) and forward+backward, by CUDA-graph
   replay (``course_lib.measure.bench``'s timer and FLOP count: the backward counts 2.5 forwards), on
   the bench grid's cells (batch·N = 16k tokens, heads·d = 2048, N in ``--seq-lens``, causal or not,
   ``--dtypes``), with SDPA's cuDNN backend in the same cell (its backward: forward+backward minus
   forward).

Each child runs with a time limit and is killed if silent (a kernel waiting on a barrier that never
completes), by ``tools/gluon_forward.py``'s child runner; a config whose checks fail to run is not timed.

The full output (``--out``) stays out of the repository; chapter 09's record is a trimmed copy of
it, made on any machine without a GPU:

    python tools/gluon_bwd_ablation.py --record bwd.json  # course_lib/data/benchmarks/h100_gluon_bwd_overlap.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import gluon_ablation  # noqa: E402  (tools/: the inputs, the fuzz and the accuracy rule of the forward's ablation)
import gluon_backward as backward_tool  # noqa: E402  (tools/: the float64 reference gradients)
import gluon_forward  # noqa: E402  (tools/: the child runner)

from course_lib.kernels import gluon_backward as gb  # noqa: E402
from course_lib.measure import bench, hopper_results  # noqa: E402

CONFIGS = {  # name -> entries of gluon_backward.CONFIG (the rest as the library has them)
    "baseline": {},
    "overlap": {"PIPELINE": gb.PIPELINE_ST_DPT},
    "overlap_st": {"PIPELINE": gb.PIPELINE_ST},
    "persistent": {"PERSISTENT": True},
    "persistent_overlap": {"PERSISTENT": True, "PIPELINE": gb.PIPELINE_ST_DPT},
}
BASELINE = hopper_results.FA4_BASELINE  # "baseline": the config name the summary divides by
CUDNN = hopper_results.FA4_CUDNN  # impl prefix of the yardstick: sdpa_cudnn/<d>
IMPL = "bwd"  # impl prefix of this tool's configs: bwd/<d>/<config>
HEAD_DIMS = (128, 64)  # in the order they are timed: d = 128's forward+backward trails cuDNN most (issue 35)
GRADS = ("dq", "dk", "dv")
PASSES = ("bwd", "fwd+bwd")
# Checks: ragged N (not a multiple of 16, nor of the 128-key tile; H and B·H not of 16) and an aligned
# shape that compiles the specialisation the timed cells use (N, H and B·H multiples of 16). (5, 11,
# 1100) has 9 · 55 = 495 items: about 4 per program of the persistent grid on 132 SMs.
CHECK_SHAPES = ((2, 3, 1000), (5, 11, 1100), (2, 16, 1024))  # (B, H, N); d from the child
FACTS_CASE = ("float16", True, CHECK_SHAPES[-1][2])  # the compiled kernel whose facts are kept
SPEED_DTYPES = ("bfloat16",)  # the default; --dtypes float16,bfloat16 doubles the speed part

BUDGET_S = 285  # seconds for the whole run: planned to end within 5 minutes on an H100
CHECK_TIMEOUT_S, CHECK_SILENCE_S = 180, 90  # one child: ~16 compiles (fwd and bwd), 48 cases; 10 at once
SPEED_SILENCE_S = 90  # a timed cell prints within seconds (the first of a shape also compiles)


# ----------------------------------------------------------------------------------------------
# Children (one process each)


def backward_fn(config: str, launch=None):
    """``fn(do, q, k, v, o, lse, causal, scale) -> (dq, dk, dv)``: the Gluon backward with one
    config's switches (or ``launch``, a :class:`~course_lib.kernels.gluon_backward.BackwardLaunch`
    made with them). Raises if the kernel did not compile (the launcher would have run chapter 07's
    Triton backward in its place: numbers of the wrong kernel)."""
    from course_lib.kernels import compat

    def run(do, q, k, v, o, lse, causal, scale):
        grads = gb.attention_backward_gluon(do, q, k, v, o, lse, causal, scale, config=CONFIGS[config], launch=launch)
        if compat.gluon_failure():
            raise RuntimeError(f"the Gluon backward did not compile: {compat.gluon_failure()}")
        return grads

    return run


def _sdpa_flash_grads(q, k, v, do, causal: bool):
    """``(dq, dk, dv)`` of SDPA's FlashAttention-2 backend, in the inputs' precision."""
    import torch

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = bench._attention_fn("sdpa_flash")(*leaves, causal)
    return torch.autograd.grad(o, leaves, do)


def _max_errors(grads, refs, prefix: str = "") -> dict:
    """``{prefix + "dq_err": max |dq - dq_ref|, ...}`` of three gradients against float64 ones."""
    return {f"{prefix}{grad}_err": (g.double() - ref).abs().max().item() for grad, g, ref in zip(GRADS, grads, refs)}


def check_case(backward, q, k, v, do, causal: bool) -> dict:
    """One check: the errors of ``backward``'s dq, dk and dv (after the library's forward) and of
    SDPA flash's against float64, and the verdict ``ok`` (None where SDPA could not run: not judged).
    Raises what the forward or ``backward`` raises."""
    import torch

    from course_lib.kernels.api import _forward

    scale = q.shape[-1] ** -0.5
    refs = backward_tool._grads_ref(q, k, v, do, causal)[1:]
    grads = backward(do, q, k, v, *_forward(q, k, v, causal, scale), causal, scale)
    torch.cuda.synchronize()
    errors = _max_errors(grads, refs)
    try:
        errors.update(_max_errors(_sdpa_flash_grads(q, k, v, do, causal), refs, "sdpa_"))
    except Exception as err:  # noqa: BLE001 - no yardstick: the case is not judged
        return {**errors, "sdpa_error": gluon_forward._short(err), "ok": None}
    factor = gluon_ablation.SDPA_ERROR_FACTOR
    return {**errors, "ok": all(errors[f"{g}_err"] <= factor * errors[f"sdpa_{g}_err"] for g in GRADS)}


def _case_line(row: dict) -> str:
    """A check's row as one line: its case, then each gradient's error (and SDPA's), or the error it raised."""
    name = f"{IMPL}/{row['d']}/{row['config']}"
    case = f"{name:20} {row['dtype']:9} N={row['shape'][2]:<5} causal={row['causal']!s:5} {row['inputs']:8}"
    if "error" in row:
        return f"{case} ERROR {row['error']}"
    judged = row["ok"] is not None
    errors = "".join(f" {g} {row[f'{g}_err']:.2e}" + (f" (SDPA {row[f'sdpa_{g}_err']:.2e})" if judged else "")
                     for g in GRADS)
    return case + errors + ("   <-- over 2x SDPA" if row["ok"] is False else "")


def check_child(d: int, config: str) -> dict:
    """Compile facts and gradient errors (beside SDPA's) of one config at head dim ``d``: every
    shape, dtype, causal or not, and input kind of the forward ablation."""
    import torch

    name = f"{IMPL}/{d}/{config}"
    out = {"compile": {}, "errors": [], "speed": []}
    backward = backward_fn(config)
    gen = torch.Generator(device="cuda").manual_seed(gluon_ablation.SEED)
    cases = [(b, h, n, dtype, causal, kind) for b, h, n in CHECK_SHAPES for dtype in gluon_ablation.DTYPES
             for causal in (False, True) for kind in gluon_ablation.INPUT_KINDS]
    for b, h, n, dtype, causal, kind in cases:
        row = {"config": config, "d": d, "shape": [b, h, n, d], "dtype": dtype, "causal": causal, "inputs": kind}
        q, k, v = gluon_ablation._make_inputs(b, h, n, d, getattr(torch, dtype), kind, gen)
        do = torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype)
        try:
            row.update(check_case(backward, q, k, v, do, causal))
        except Exception as err:  # noqa: BLE001 - report and go on (the config is not timed)
            row.update(error=gluon_forward._short(err), ok=False)
        out["errors"].append(row)
        print(f"  {_case_line(row)}", flush=True)
        if (dtype, causal, n) == FACTS_CASE and "error" not in row and name not in out["compile"]:
            kernel = gb.attention_backward_gluon.last_kernel  # the compiled kernel of the timed specialisation
            out["compile"][name] = {**gb.gluon_hopper.kernel_facts(kernel), "d": d, "config": config,
                                    "dq_overlap": gb.dq_overlap(kernel.asm["ptx"])}
            print(f"  {name} {out['compile'][name]}", flush=True)
    return out


def _ms_to_tflops(ms: float, batch: int, heads: int, n: int, d: int, causal: bool, pass_: str) -> float:
    """TFLOP/s of a pass that took ``ms``: bench's FLOP count, the backward alone counting
    forward+backward's minus the forward's (2.5 forwards)."""
    work = bench.flops(batch, heads, n, d, causal, "fwd+bwd")
    if pass_ == "bwd":
        work -= bench.flops(batch, heads, n, d, causal, "fwd")
    return work / (ms * 1e-3) / 1e12


def time_config(config: str, dtype: str, n: int, causal: bool, d: int) -> dict:
    """``{pass: TFLOP/s}`` of the library's forward and this config's backward on one bench cell:
    the backward alone (on the forward's saved o and lse) and forward+backward."""
    import torch

    from course_lib.kernels.api import _forward

    batch, heads = bench.problem_shape(n, d)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=getattr(torch, dtype), generator=gen)
                   for _ in range(4))
    scale = d ** -0.5
    o, lse = _forward(q, k, v, causal, scale)
    launch = gb.BackwardLaunch(q, k, v, o, do, lse, causal, CONFIGS[config], cache=True)
    backward = backward_fn(config, launch)
    steps = {"bwd": lambda: backward(do, q, k, v, o, lse, causal, scale),
             "fwd+bwd": lambda: backward(do, q, k, v, *_forward(q, k, v, causal, scale), causal, scale)}
    out = {}
    for pass_, step in steps.items():
        step()  # compile and warm up
        torch.cuda.synchronize()
        ms, _ = bench._time_ms(step, "cudagraph", None)
        out[pass_] = _ms_to_tflops(ms, batch, heads, n, d, causal, pass_)
    return out


def time_cudnn(dtype: str, n: int, causal: bool, d: int) -> dict:
    """``{pass: TFLOP/s}`` of SDPA's cuDNN backend on one bench cell; its backward alone from
    forward+backward's time minus the forward's (same timer)."""
    rows = {p: bench.measure(CUDNN, dtype, d, n, causal, p) for p in ("fwd", "fwd+bwd")}
    if not all(rows.values()):
        raise RuntimeError("cuDNN did not run this cell (see the line above)")
    batch, heads = bench.problem_shape(n, d)
    ms = {p: bench.flops(batch, heads, n, d, causal, p) / (rows[p]["tflops"] * 1e12) * 1e3 for p in rows}
    return {"bwd": _ms_to_tflops(ms["fwd+bwd"] - ms["fwd"], batch, heads, n, d, causal, "bwd"),
            "fwd+bwd": rows["fwd+bwd"]["tflops"]}


def speed_child(deadline: float, dtypes: list[str], seq_lens: list[int], causals: list[bool], items: list[str]) -> dict:
    """TFLOP/s of each item (``bwd/D/CONFIG`` or ``sdpa_cudnn/D``) on each cell, cell by cell (every
    item of a cell before the next cell), until the wall-clock ``deadline`` (epoch seconds)."""
    import torch

    out = {"compile": {}, "errors": [], "speed": []}
    for dtype in dtypes:
        for n in seq_lens:
            for causal in causals:
                for item in items:
                    parts = item.split("/")
                    d = int(parts[1])
                    if parts[0] == IMPL and CONFIGS[parts[2]].get("PERSISTENT") and n > gb.PERSISTENT_MAX_N:
                        continue  # the one-program-per-item grid there: the baseline's numbers
                    base = {"impl": item, "d": d, "dtype": dtype, "N": n, "causal": causal}
                    rows = [{**base, "pass": p} for p in PASSES]
                    if time.time() > deadline:
                        for row in rows:
                            row["skipped"] = "out of time"
                    else:
                        try:
                            tflops = time_cudnn(dtype, n, causal, d) if parts[0] == CUDNN else \
                                time_config(parts[2], dtype, n, causal, d)
                            for row in rows:
                                row["tflops"] = round(tflops[row["pass"]], 1)
                        except Exception as err:  # noqa: BLE001
                            for row in rows:
                                row["error"] = gluon_forward._short(err)
                        torch.cuda.empty_cache()
                    out["speed"] += rows
                    print(f"  {item:20} {dtype:9} N={n:<6} causal={causal!s:5} " + " ".join(
                        f"{r['pass']} {r.get('tflops', r.get('skipped', r.get('error')))}" for r in rows), flush=True)
    return out


def child(spec: str) -> dict:
    """``check:D:CONFIG`` or ``speed:DEADLINE:DTYPES:SEQ_LENS:CAUSALS:ITEM,ITEM,...`` (see :func:`main`;
    CAUSALS as bench's ``--causal``: ``0,1``)."""
    kind, *rest = spec.split(":")
    if kind == "check":
        d, config = rest
        return check_child(int(d), config)
    deadline, dtypes, seq_lens, causals, items = rest
    return speed_child(float(deadline), dtypes.split(","), [int(n) for n in seq_lens.split(",")],
                       [bench._bool(c) for c in causals.split(",")], items.split(","))


# ----------------------------------------------------------------------------------------------
# Summary, record and tables (pure: tests/test_gluon_backward.py runs them on CPU)


def pass_rows(speed: list[dict], pass_: str) -> list[dict]:
    """The timed rows of one pass, as :func:`course_lib.measure.hopper_results.fa4_speed_summary` reads them."""
    return [r for r in speed if r["pass"] == pass_ and r.get("tflops")]


def accuracy(rows: list[dict]) -> dict:
    """Cases passed, cases, and each gradient's worst error as a multiple of SDPA's, over ``rows``."""
    judged = [r for r in rows if r.get("ok") is not None and "dq_err" in r]
    worst = {g: round(max((r[f"{g}_err"] / max(r[f"sdpa_{g}_err"], gluon_ablation.TINY) for r in judged),
                          default=0.0), 2) for g in GRADS}
    return {"passed": sum(bool(r.get("ok")) for r in rows), "cases": len(rows),
            **{f"worst_{g}_x_sdpa": w for g, w in worst.items()}}


def summary(result: dict) -> dict:
    """Per pass and timed impl: median and min ratio to cuDNN and median ratio to the baseline config
    (``hopper_results.fa4_speed_summary``); per checked config: :func:`accuracy`, overall and by input kind."""
    by_config: dict = {}
    for r in result["errors"]:
        by_config.setdefault(f"{IMPL}/{r['d']}/{r['config']}", []).append(r)
    kinds = lambda rows: list(dict.fromkeys(r["inputs"] for r in rows))  # noqa: E731
    return {"speed": {p: hopper_results.fa4_speed_summary(pass_rows(result["speed"], p)) for p in PASSES},
            "accuracy": {name: {**accuracy(rows), "by_inputs": {k: accuracy([r for r in rows if r["inputs"] == k])
                                                                for k in kinds(rows)}}
                         for name, rows in by_config.items()}}


RECORD_FILE = bench.RECORDED_DIR / "h100_gluon_bwd_overlap.json"
# What the record keeps of each compiled kernel's facts: the switch in the PTX, its cost in registers,
# spills and shared memory; or the error of a config that did not compile.
RECORD_COMPILE_KEYS = ("registers", "spill_bytes", "shared_bytes", "dq_overlap", "setmaxnreg", "triton", "error")


def record(full: dict) -> dict:
    """The trimmed record of one full run (``--out``'s JSON): the meta, the compiled kernels' facts
    (:data:`RECORD_COMPILE_KEYS`), the timed cells as columns (``speed["cells"]``: ``[dtype, d, N,
    causal]``; ``speed["tflops"][pass][impl]``: one value per cell, None where not timed), the summary
    recomputed from the full run's rows, and the lists of what was skipped, failed or excluded. Drops
    the per-case errors (the summary keeps their verdicts)."""
    cells = list(dict.fromkeys((r["dtype"], r["d"], r["N"], r["causal"]) for r in full["speed"]))
    impls = list(dict.fromkeys(r["impl"] for r in full["speed"]))
    timed = {(r["pass"], r["impl"], r["dtype"], r["d"], r["N"], r["causal"]): r["tflops"]
             for r in full["speed"] if r.get("tflops")}
    meta = {**full["meta"], "record": "trimmed from the full run by tools/gluon_bwd_ablation.py --record"}
    return {"meta": meta,
            "compile": {name: {k: facts[k] for k in RECORD_COMPILE_KEYS if k in facts}
                        for name, facts in full["compile"].items()},
            "speed": {"cells": [list(c) for c in cells],
                      "tflops": {p: {impl: [timed.get((p, impl, *c)) for c in cells] for impl in impls}
                                 for p in PASSES}},
            "summary": summary(full),
            **{key: full.get(key, []) for key in ("skipped", "failed", "excluded")}}


def write_record(full_path: Path | str, out: Path | str = RECORD_FILE) -> dict:
    """Read a full run's JSON at ``full_path``, write its :func:`record` to ``out``, return it.
    Raises ValueError naming ``full_path`` when it is not a full run (the forward ablation's check)."""
    return gluon_ablation.write_record(full_path, out, trim=record, tool="tools/gluon_bwd_ablation.py")


def _speed_table(speed: dict, pass_: str, d: int) -> list[str]:
    """:func:`report`'s table of one pass at head dim ``d``: a line per cell with cuDNN's and each
    config's TFLOP/s, then each config's ratio to cuDNN's (none where nothing was timed)."""
    impls = [i for i in speed["tflops"][pass_] if int(i.split("/")[1]) == d]
    configs = [i for i in impls if not i.startswith(CUDNN)]
    label = lambda i: "cuDNN" if i.startswith(CUDNN) else i.split("/")[-1]  # noqa: E731
    width = max(len(label(i)) for i in impls) + 2  # a column per impl, then per config's ratio
    head = (f"{'dtype':9} {'N':>6} {'causal':6} |" + "".join(f"{label(i):>{width}}" for i in impls) + " |"
            + "".join(f"{label(i):>{width}}" for i in configs))
    lines = ["", f"{pass_} TFLOP/s, d = {d}; after the second bar, each config ÷ cuDNN", head, "-" * len(head)]
    for c, (dtype, cell_d, n, causal) in enumerate(speed["cells"]):
        values = {i: speed["tflops"][pass_][i][c] for i in impls}
        if cell_d != d or not any(values.values()):
            continue
        cudnn = values.get(f"{CUDNN}/{d}")
        ratios = [f"{values[i] / cudnn:.3f}" if values[i] and cudnn else "-" for i in configs]
        lines.append(f"{dtype:9} {n:>6} {causal!s:6} |" + "".join(f"{values[i] or '-':>{width}}" for i in impls) + " |"
                     + "".join(f"{r:>{width}}" for r in ratios))
    return lines


def report(data: dict) -> str:
    """A record (:func:`record`) as text: per pass and head dim, one line per cell with each impl's
    TFLOP/s and each config's ratio to cuDNN; the speed summary; the accuracy per config; the compiled facts."""
    speed = data["speed"]
    lines = [hopper_results.provenance(data), f"CUDA-graph median, batch·N = {bench.TOKENS} tokens, heads·d = "
             f"{bench.MODEL_DIM}; the backward counts 2.5 forwards (cuDNN's: forward+backward minus forward)"]
    head_dims = list(dict.fromkeys(d for _, d, _, _ in speed["cells"]))
    for p in PASSES:
        for d in head_dims:
            lines += _speed_table(speed, p, d)
    lines += ["", "summary (ratios over the cells both were timed in)"]
    for p, per_impl in data["summary"]["speed"].items():
        for impl, s in per_impl.items():
            lines.append(f"  {p:8} {impl:20} cells {s['cells']:>3}  ÷ cuDNN median {s['median_x_cudnn']} "
                         f"min {s['min_x_cudnn']}  ÷ baseline median {s['median_x_baseline']}")
    lines += ["", f"accuracy: a case passes iff dq, dk and dv are each within "
                  f"{gluon_ablation.SDPA_ERROR_FACTOR:g}x SDPA flash's error (float64 reference)"]
    for name, a in data["summary"]["accuracy"].items():
        lines.append(f"  {name:20} {a['passed']}/{a['cases']} passed; worst × SDPA: "
                     + " ".join(f"{g} {a[f'worst_{g}_x_sdpa']}" for g in GRADS))
    lines += ["", "compiled kernels (fp16, causal, N = 1024)"]
    lines += [f"  {name:20} {facts}" for name, facts in data["compile"].items()]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The parent


def _parser() -> argparse.ArgumentParser:
    """The options: bench's grid options for the timed cells (bf16 by default), the budget, and the
    record mode that trims a full run without a GPU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_grid_arguments(parser)
    parser.set_defaults(dtypes=",".join(SPEED_DTYPES), head_dims=",".join(map(str, HEAD_DIMS)))
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="start no work after this many seconds")
    parser.add_argument("--no-speed", action="store_true", help="the checks alone")
    parser.add_argument("--record", metavar="FULL_JSON",
                        help="no GPU: write chapter 09's record of a full run's JSON (an earlier --out) and print it")
    parser.add_argument("--out", help=f"the results' JSON (with --record: the record; {RECORD_FILE.name} by default)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def run_checks(head_dims: list[int], script: str, result: dict) -> set:
    """The check children (one per config and head dim, in parallel), merged into ``result``; returns
    the configs whose checks crashed, hung or raised (not timed: a crash would end a speed child)."""
    specs = [f"check:{d}:{c}" for d in head_dims for c in CONFIGS]
    with ThreadPoolExecutor(len(specs)) as pool:
        parts = list(pool.map(lambda spec: gluon_forward.run_child(
            spec, False, script=script, timeout_s=CHECK_TIMEOUT_S, silence_s=CHECK_SILENCE_S), specs))
    excluded = set()
    for spec, part in zip(specs, parts):
        name = spec.replace("check:", f"{IMPL}/").replace(":", "/")
        if spec in part["compile"]:  # the runner's record of a child that failed
            part["compile"][name] = part["compile"].pop(spec)
        if "error" in part["compile"].get(name, {}) or any("error" in r for r in part["errors"]):
            excluded.add(name)
        gluon_ablation._merge(result, part)
    return excluded


def run_speed(args, head_dims: list[int], script: str, result: dict, start: float) -> None:
    """The speed children (one per head dim: cuDNN and every config not excluded, cell by cell), one
    after another within the budget, merged into ``result``."""
    for d in head_dims:
        items = [f"{CUDNN}/{d}"] + [f"{IMPL}/{d}/{c}" for c in CONFIGS if f"{IMPL}/{d}/{c}" not in result["excluded"]]
        left = args.budget_s - (time.monotonic() - start)
        if left < gluon_ablation.CHILD_START_S + gluon_ablation.CELL_S * len(PASSES) * len(items):
            result["skipped"] += items
            print(f"\n== skipped (budget): {items} ==", flush=True)
            continue
        print(f"\n== speed: {items} ({left:.0f} s left) ==", flush=True)
        deadline = time.time() + left - gluon_ablation.CHILD_START_S
        spec = ":".join(["speed", str(deadline), args.dtypes, args.seq_lens, args.causal, ",".join(items)])
        part = gluon_forward.run_child(spec, True, script=script, timeout_s=left + gluon_ablation.CHILD_START_S,
                                       silence_s=SPEED_SILENCE_S)
        if spec in part["compile"]:  # the child crashed or hung: what it printed is above
            result["failed"].append({"items": items, **part["compile"].pop(spec)})
        gluon_ablation._merge(result, part)
        result["skipped"] += sorted({r["impl"] for r in part["speed"] if "skipped" in r})


def run(args) -> dict:
    """The whole run on this machine's GPU: the checks, then the speed, the tables; the full result."""
    start = time.monotonic()
    head_dims = [int(d) for d in args.head_dims.split(",")]
    script = str(Path(__file__).resolve())
    rule = f"ok iff dq, dk and dv errors <= {gluon_ablation.SDPA_ERROR_FACTOR} x SDPA flash's (float64 reference)"
    result = {"meta": {**bench.machine_meta(), "timer": "cudagraph", "dtypes": args.dtypes.split(","),
                       "seq_lens": [int(n) for n in args.seq_lens.split(",")], "causal": args.causal,
                       "head_dims": head_dims, "budget_s": args.budget_s, "tokens": bench.TOKENS,
                       "model_dim": bench.MODEL_DIM, "configs": CONFIGS, "fuzz_logit": gluon_ablation.FUZZ_LOGIT,
                       "rule": rule},
              "compile": {}, "errors": [], "speed": [], "skipped": [], "failed": []}
    print(result["meta"], "\n\n== checks (children in parallel) ==", flush=True)
    result["excluded"] = sorted(run_checks(head_dims, script, result))
    print(f"  checks done at {time.monotonic() - start:.0f} s; excluded: {result['excluded'] or 'none'}", flush=True)
    if not args.no_speed:
        run_speed(args, head_dims, script, result, start)
    result["summary"] = summary(result)
    result["meta"]["wall_s"] = round(time.monotonic() - start, 1)
    print(f"\n{report(record(result))}")
    if result["skipped"] or result["failed"]:
        print(f"\n  not timed (budget): {result['skipped']}; failed: {result['failed']}")
    over = sum(r.get("ok") is False for r in result["errors"])
    print(f"\n  {over} of {len(result['errors'])} check cases over the accuracy rule; "
          f"wall time {result['meta']['wall_s']} s")
    return result


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    if args.child:  # one child's work, in this process: gluon_forward.run_child reads its JSON back
        out = child(args.child)
        Path(args.out).write_text(json.dumps(out))
        return out
    if args.record:
        target = args.out or RECORD_FILE
        data = write_record(args.record, target)
        print(f"{report(data)}\nwrote {target}")
        return data
    import torch

    if not torch.cuda.is_available():
        sys.exit("tools/gluon_bwd_ablation.py runs on a Hopper GPU; tests/test_gluon_backward.py cross-compiles "
                 "the switch without one")
    result = run(args)
    if args.out:  # the full run: every case's errors (the record trims it)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
