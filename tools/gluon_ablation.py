"""Ablation of FlashAttention-4's two tricks and of head dim 64 in the Gluon forward, on a Hopper GPU (issue 35).

One call, about 5-6 minutes on an H100 (``--budget-s`` bounds it; what does not fit is listed as skipped):

    PYTHONPATH=. python tools/gluon_ablation.py --out $OUT/ablation.json

The switches are constexprs of :mod:`course_lib.kernels.gluon_hopper`'s forward (defaults off):
``rescale_tau`` (conditional rescaling: the running max moves only when a tile's max exceeds it by
more than tau, log2 units; acc and l are rescaled only when some row of the partition moved) and
``exp2_emulated`` (of every 4 exponentials of P, how many are computed on the FMA units by
:mod:`course_lib.attention.fp_emulation`'s polynomial instead of the special-function unit). The configs
(:data:`CONFIGS`): baseline, conditional rescaling tau = 8, exp2 emulated 1/4 and 1/2, both (with the
fraction that timed faster), and a degree-5 polynomial (for lse's accuracy).

The variants: the one the library runs at d = 128 (:data:`course_lib.kernels.tuning.GLUON_VARIANT`,
ping-pong) at d = 128 and d = 64, and one other design at d = 64 (:data:`OTHER_D64_VARIANT`). Today
the library keeps chapter 06's Triton forward at d = 64; it is timed beside them.

1. **Checks** (every config, children in parallel): what the compiled kernel holds (registers,
   spills, ``ex2.approx`` count, the polynomial's FMAs, the guarded rescale), and its error on
   ragged and aligned shapes, fp16 and bf16, causal or not, ordinary inputs and a fuzz whose
   logits reach ±:data:`FUZZ_LOGIT`: max |o - o_ref| and |lse - lse_ref| against float64, beside
   SDPA's FlashAttention-2 backend on the same inputs. A config passes a case iff both errors are at
   most :data:`SDPA_ERROR_FACTOR` × SDPA's (FlashAttention's rule). With conditional rescaling, the
   fraction of (partition, tile) steps whose rescale is skipped, replayed on the host from the same
   scores by the kernel's rule (not counted inside the kernel).
2. **Speed** (children one after another, the GPU to themselves): forward time by CUDA-graph
   replay (``course_lib.measure.bench``'s timer and FLOP count) on the bench grid's cells (batch·N = 16k
   tokens, heads·d = 2048, N in ``--seq-lens``), TFLOP/s and the ratio to SDPA's cuDNN backend in
   the same cell.

Each child runs with a time limit and is killed if silent (a kernel waiting on a barrier that
never completes), by ``tools/gluon_forward.py``'s child runner.

The full output (``--out``, ~140 KB: every case's errors) stays out of the repository. What
chapter 09 shows is a trimmed record of it, made on any machine without a GPU:

    python tools/gluon_ablation.py --record ablation.json   # writes course_lib/data/benchmarks/h100_fa4_ablation.json

(:func:`record`: the meta, the compiled kernels' facts, the timed cells, the speed and accuracy
summaries; :mod:`course_lib.measure.hopper_results` reads and prints it.)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import gluon_forward  # noqa: E402  (tools/: the child runner and the cell timer)

from course_lib.measure import bench, hopper_results  # noqa: E402
from course_lib import constants
from course_lib.kernels import gluon_hopper, tuning  # noqa: E402

TAU = gluon_hopper.MAX_RESCALE_TAU  # 8 (log2 units): the largest threshold the kernel allows, the most skipping
CONFIGS = {  # name -> switches of gluon_hopper.attention_forward_gluon
    "baseline": {},
    "rescale_tau8": {"rescale_tau": TAU},
    "exp2_emu_1of4": {"exp2_emulated": 1},
    "exp2_emu_2of4": {"exp2_emulated": 2},
    "both_1of4": {"rescale_tau": TAU, "exp2_emulated": 1},
    "both_2of4": {"rescale_tau": TAU, "exp2_emulated": 2},
    "exp2_emu_2of4_deg5": {"exp2_emulated": 2, "exp2_degree": 5},
}
EMULATION_CONFIGS = {"exp2_emu_1of4": "both_1of4", "exp2_emu_2of4": "both_2of4"}  # alone -> with rescaling
OTHER_D64_VARIANT = "ws"  # the second design tried at d = 64 (warp-specialized, two cooperative warpgroups)
GROUPS = [(tuning.GLUON_VARIANT, 128), (tuning.GLUON_VARIANT, 64), (OTHER_D64_VARIANT, 64)]
CHECK_CONFIGS = {GROUPS[0]: list(CONFIGS), GROUPS[1]: list(CONFIGS),
                 GROUPS[2]: ["baseline", "both_1of4", "both_2of4"]}
FIRST_TIMED = ["baseline", "rescale_tau8", "exp2_emu_1of4", "exp2_emu_2of4"]  # then "both" with the faster fraction
LAST_TIMED = "exp2_emu_2of4_deg5"  # timed last, if the budget allows

DTYPES = ("float16", "bfloat16")
SEQ_LENS = (1024, 4096, 16384)
# Checks: a ragged shape (N not a multiple of 16 or of the 128-key tile, H not of 16) and an
# aligned one that compiles the same specialisation as the timed cells (N, H multiples of 16), so
# the speed children find every kernel in Triton's cache.
CHECK_SHAPES = ((2, 3, 1000), (2, 16, 1024))  # (B, H, N); d from the group
INPUT_KINDS = ("ordinary", "fuzz")
FACTS_CASE = ("float16", True, CHECK_SHAPES[1][2])  # the compiled kernel whose facts are kept: a timed specialisation
FUZZ_LOGIT = 500.0  # the fuzz scales q and k so that the largest |scale · q·k| is this
SDPA_ERROR_FACTOR = 2.0  # FlashAttention's rule: at most twice the reference kernel's error in the same precision
SEED = 0
TINY = 1e-30  # a floor for SDPA's error when dividing by it (an exact SDPA result would divide by 0)

BUDGET_S = 330  # seconds for the whole run: the work is planned to end within 6 minutes on an H100
PARALLEL_CHECKS = 12  # check children at once (compiles are CPU work, 16 cores; the GPU work is small)
CHECK_TIMEOUT_S, CHECK_SILENCE_S = 150, 90  # one config's 8 compiles and 32 runs, 12 children at a time
SPEED_SILENCE_S = 60  # a timed cell prints within seconds; compiles were done by the checks
CELL_S = 1.3  # first estimate of one timed cell (bench's timer: 10 replays of >= 100 ms, plus capture)
CHILD_START_S = 6.0  # a child's import of torch, Triton and the library, and CUDA's start


# ----------------------------------------------------------------------------------------------
# Children (one process each)


def _make_inputs(b: int, h: int, n: int, d: int, dtype, kind: str, gen):
    """q, k, v ``(b, h, n, d)`` in ``dtype`` on the GPU: standard normal, or (``kind="fuzz"``) q and
    k scaled so that the largest |logit| (scale · q·k) is :data:`FUZZ_LOGIT`."""
    import torch

    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen) for _ in range(3))
    if kind == "fuzz":
        logit_max = ((q @ k.transpose(-1, -2)) * d**-0.5).abs().max()
        factor = (FUZZ_LOGIT / logit_max).sqrt()
        q, k = q * factor, k * factor
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _sdpa_flash(q, k, v, causal: bool):
    """``(o, lse)`` of SDPA's FlashAttention-2 backend (lse: natural log, float32, ``(B, H, N)``)."""
    import torch

    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=q.shape[-1] ** -0.5)
    return out[0], out[1][..., :q.shape[-2]]


def rescale_skip_fraction(q, k, causal: bool, tau: float, partition_rows: int, block_m: int, block_n: int) -> float:
    """The fraction of rescale steps (tiles after a partition's first) that conditional rescaling
    skips on these inputs: the kernel's rule replayed on float32 scores (log2 units). A partition of
    ``partition_rows`` query rows rescales on a tile when some row's tile max exceeds its running max
    by more than ``tau``; the running max moves only then. Causal programs visit the tiles up to
    their diagonal (both ping-pong partitions the same ones)."""
    import torch

    batch, heads, n, d = q.shape
    s = (q.float() @ k.float().transpose(-1, -2)) * (d**-0.5 * constants.LOG2_E)  # (B, H, N, N)
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    n_tiles = math.ceil(n / block_n)
    s = torch.nn.functional.pad(s, (0, n_tiles * block_n - n), value=float("-inf"))
    tile_max = s.view(batch, heads, n, n_tiles, block_n).amax(-1)  # (B, H, N, T)
    rows = torch.arange(n, device=s.device)
    kv_end = torch.clamp((rows // block_m + 1) * block_m, max=n) if causal else torch.full_like(rows, n)
    visited = (kv_end + block_n - 1) // block_n  # (N,) tiles the row's program visits
    pad_rows = -n % partition_rows
    m = torch.full((batch, heads, n), float("-inf"), device=s.device)
    done = steps = 0
    for t in range(n_tiles):
        moved = tile_max[..., t] > m + tau
        m = torch.where(moved, tile_max[..., t], m)
        if t == 0:
            continue
        live = torch.nn.functional.pad(t < visited, (0, pad_rows)).view(-1, partition_rows).any(-1)  # (groups,)
        moved_groups = torch.nn.functional.pad(moved, (0, pad_rows)).view(batch, heads, -1, partition_rows).any(-1)
        done += int((moved_groups & live).sum())
        steps += int(live.sum()) * batch * heads
    return 1.0 - done / steps if steps else float("nan")


def gluon_fn(variant: str, config: str):
    """``fn(q, k, v, causal) -> (o, lse)``: the Gluon forward with one config's switches. Raises if
    the kernel did not compile (the launcher would have run the Triton forward in its place and
    turned Gluon off, :class:`course_lib.kernels.compat.FallBack`: numbers of the wrong kernel)."""
    from course_lib.kernels import compat

    switches = CONFIGS[config]

    def run(q, k, v, causal):
        out = gluon_hopper.attention_forward_gluon(q, k, v, causal, variant=variant, **switches)
        if compat.gluon_failure():
            raise RuntimeError(f"the Gluon forward did not compile: {compat.gluon_failure()}")
        return out

    return run


def check_child(variant: str, d: int, config: str) -> dict:
    """Compile facts, errors (beside SDPA's) and rescale-skip fractions of one config."""
    import torch

    from course_lib.attention.reference import naive_attention_torch

    name = f"{variant}/{d}/{config}"
    switches = CONFIGS[config]
    out = {"compile": {}, "errors": [], "speed": []}
    cfg = gluon_hopper.config(variant, d)
    forward = gluon_fn(variant, config)
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    for b, h, n in CHECK_SHAPES:
        for dtype in DTYPES:
            for causal in (False, True):
                for kind in INPUT_KINDS:
                    row = {"variant": variant, "d": d, "config": config, "shape": [b, h, n, d], "dtype": dtype,
                           "causal": causal, "inputs": kind}
                    q, k, v = _make_inputs(b, h, n, d, getattr(torch, dtype), kind, gen)
                    o_ref, lse_ref = naive_attention_torch(q.double(), k.double(), v.double(), causal=causal)
                    try:
                        o, lse = forward(q, k, v, causal)
                        torch.cuda.synchronize()
                    except Exception as err:  # noqa: BLE001 - report and go on (the config is not timed)
                        row.update(error=gluon_forward._short(err), ok=False)
                        out["errors"].append(row)
                        print(f"  {name:32} {dtype:9} N={n:<5} causal={causal!s:5} {kind:8} ERROR {row['error']}",
                              flush=True)
                        continue
                    if (dtype, causal, n) == FACTS_CASE and name not in out["compile"]:
                        kernel = gluon_hopper.attention_forward_gluon.last_kernel
                        out["compile"][name] = {**gluon_hopper.kernel_facts(kernel),
                                                "variant": variant, "d": d, "config": config}
                        print(f"  {name:32} {out['compile'][name]}", flush=True)
                    row["o_err"] = (o.double() - o_ref).abs().max().item()
                    row["lse_err"] = (lse.double() - lse_ref).abs().max().item()
                    try:
                        o_s, lse_s = _sdpa_flash(q, k, v, causal)
                        row["sdpa_o_err"] = (o_s.double() - o_ref).abs().max().item()
                        row["sdpa_lse_err"] = (lse_s.double() - lse_ref).abs().max().item()
                        row["ok"] = bool(row["o_err"] <= SDPA_ERROR_FACTOR * row["sdpa_o_err"]
                                         and row["lse_err"] <= SDPA_ERROR_FACTOR * row["sdpa_lse_err"])
                    except Exception as err:  # noqa: BLE001 - no yardstick: the case is not judged
                        row.update(sdpa_error=gluon_forward._short(err), ok=None)
                    if switches.get("rescale_tau", 0) > 0:
                        row["rescale_skipped"] = rescale_skip_fraction(q, k, causal, switches["rescale_tau"],
                                                                       cfg["Q_ROWS"], cfg["BLOCK_M"], cfg["BLOCK_N"])
                    out["errors"].append(row)
                    yardstick = (f"(SDPA {row['sdpa_o_err']:.2e})", f"(SDPA {row['sdpa_lse_err']:.2e})") \
                        if "sdpa_o_err" in row else ("", f"(no SDPA: {row['sdpa_error']})")
                    print(f"  {name:32} {dtype:9} N={n:<5} causal={causal!s:5} {kind:8} o {row['o_err']:.2e} "
                          f"{yardstick[0]} lse {row['lse_err']:.2e} {yardstick[1]}"
                          + (f" skipped {row['rescale_skipped']:.3f}" if "rescale_skipped" in row else "")
                          + ("   <-- over 2x SDPA" if row["ok"] is False else ""), flush=True)
    return out


def _impl(item: str):
    """``(label, fn(q, k, v, causal), d)`` of one timed item: ``variant/d/config``, or
    ``sdpa_cudnn/d`` / ``course/d`` (the library as users call it)."""
    parts = item.split("/")
    if len(parts) == 2:
        return item, bench._attention_fn(parts[0]), int(parts[1])
    return item, gluon_fn(parts[0], parts[2]), int(parts[1])


def speed_child(deadline: float, items: list[str], seq_lens: list[int]) -> dict:
    """TFLOP/s of each item on each cell, until the wall-clock ``deadline`` (epoch seconds)."""
    import torch

    out = {"compile": {}, "errors": [], "speed": []}
    for item in items:
        label, fn, d = _impl(item)
        for dtype in DTYPES:
            for n in seq_lens:
                for causal in (False, True):
                    row = {"impl": label, "d": d, "dtype": dtype, "N": n, "causal": causal}
                    if time.time() > deadline:
                        row["skipped"] = "out of time"
                    else:
                        try:
                            row["tflops"] = round(gluon_forward.time_cell(fn, dtype, n, causal, d), 1)
                        except Exception as err:  # noqa: BLE001
                            row["error"] = gluon_forward._short(err)
                        torch.cuda.empty_cache()
                    out["speed"].append(row)
                    print(f"  {label:32} {dtype:9} N={n:<6} causal={causal!s:5} "
                          f"{row.get('tflops', row.get('skipped', row.get('error')))}", flush=True)
    return out


def child(spec: str) -> dict:
    """``check:VARIANT:D:CONFIG`` or ``speed:DEADLINE:SEQ_LENS:ITEM,ITEM,...`` (see :func:`main`)."""
    kind, *rest = spec.split(":")
    if kind == "check":
        variant, d, config = rest
        return check_child(variant, int(d), config)
    deadline, seq_lens, items = rest
    return speed_child(float(deadline), items.split(","), [int(n) for n in seq_lens.split(",")])


# ----------------------------------------------------------------------------------------------
# The parent: plan, run, summarise


def _merge(result: dict, part: dict) -> None:
    result["compile"].update(part["compile"])
    result["errors"] += part["errors"]
    result["speed"] += part["speed"]


def faster_fraction(rows: list[dict], variant: str, d: int) -> str:
    """Which emulated fraction (config name) timed faster at ``(variant, d)``: the higher median ratio
    to the baseline; the first when neither was timed."""
    medians = {}
    for config in EMULATION_CONFIGS:
        r = hopper_results.fa4_ratios(rows, f"{variant}/{d}/{config}", f"{variant}/{d}/baseline")
        if r:
            medians[config] = statistics.median(r)
    return max(medians, key=medians.get) if medians else next(iter(EMULATION_CONFIGS))


def speed_plan(rows: list[dict], excluded: set) -> list[list[str]]:
    """The speed children, in order of priority, given the rows timed so far: the baselines, then
    d = 64 (where the exponential is a co-bottleneck) before d = 128, each group's "both" with its
    faster fraction (the second d = 64 design takes the ping-pong one's), the degree-5 polynomial
    last. Configs whose check crashed (``excluded``) are left out."""
    (v128, d128), (v64, d64), (other_v, other_d) = GROUPS
    both_64 = EMULATION_CONFIGS[faster_fraction(rows, v64, d64)]
    plan = [[f"sdpa_cudnn/{d}" for d in (d64, d128)] + [f"course/{d64}"],
            [f"{v64}/{d64}/{c}" for c in FIRST_TIMED],
            [f"{v64}/{d64}/{both_64}", f"{other_v}/{other_d}/baseline", f"{other_v}/{other_d}/{both_64}"],
            [f"{v128}/{d128}/{c}" for c in FIRST_TIMED],
            [f"{v128}/{d128}/{EMULATION_CONFIGS[faster_fraction(rows, v128, d128)]}"],
            [f"{v}/{d}/{LAST_TIMED}" for v, d in (GROUPS[1], GROUPS[0])]]
    return [[item for item in items if item not in excluded] for items in plan]


def _accuracy(rows: list[dict]) -> dict:
    """Cases passed, cases, and the worst o and lse errors as multiples of SDPA's, over ``rows``."""
    judged = [r for r in rows if "sdpa_o_err" in r]
    worst = lambda key: round(max((r[key] / max(r["sdpa_" + key], TINY) for r in judged), default=0.0), 2)  # noqa: E731
    return {"passed": sum(bool(r.get("ok")) for r in rows), "cases": len(rows),
            "worst_o_x_sdpa": worst("o_err"), "worst_lse_x_sdpa": worst("lse_err")}


def summary(result: dict) -> dict:
    """Per timed impl: median and min ratio to cuDNN and median ratio to its group's baseline
    (:func:`course_lib.measure.hopper_results.fa4_speed_summary`); per checked config: cases passed and
    the worst error ratios to SDPA, overall and by input kind, and with conditional rescaling the
    fraction of rescales skipped per input kind (min, median, max over the cases)."""
    by_config: dict = {}
    for r in result["errors"]:
        by_config.setdefault(f"{r['variant']}/{r['d']}/{r['config']}", []).append(r)
    accuracy = {}
    for name, rows in by_config.items():
        kinds = list(dict.fromkeys(r["inputs"] for r in rows))
        a = {**_accuracy(rows), "by_inputs": {k: _accuracy([r for r in rows if r["inputs"] == k]) for k in kinds}}
        skipped = {k: [r["rescale_skipped"] for r in rows if r["inputs"] == k and "rescale_skipped" in r]
                   for k in kinds}
        if any(skipped.values()):
            a["rescale_skipped"] = {k: {"min": round(min(v), 4), "median": round(statistics.median(v), 4),
                                        "max": round(max(v), 4)} for k, v in skipped.items() if v}
        accuracy[name] = a
    return {"speed": hopper_results.fa4_speed_summary(result["speed"]), "accuracy": accuracy}


# What the record keeps of each compiled kernel's facts (gluon_hopper.kernel_facts): enough to see
# each switch in the PTX (ex2.approx count, the polynomial's FMAs, the guarded rescale) and the cost
# in registers, spills and shared memory; or the error of a config that did not compile.
RECORD_COMPILE_KEYS = ("registers", "spill_bytes", "shared_bytes", "ex2", "poly_fma", "guarded_mul_f32", "triton",
                       "error")


def record(full: dict) -> dict:
    """The trimmed record of one full run (``--out``'s JSON): what
    ``course_lib/data/benchmarks/h100_fa4_ablation.json`` holds and :mod:`course_lib.measure.hopper_results` reads.

    Keeps the meta (with the grid's tokens and model width and the exp2 pack size of the kernel
    that ran, for runs whose meta predates them), the compiled kernels' facts of
    :data:`RECORD_COMPILE_KEYS`, the timed cells as columns (``speed["cells"]``: ``[dtype, N,
    causal]``; ``speed["tflops"]``: impl -> one value per cell, None where not timed), the summary
    recomputed from the full run's rows (:func:`summary`), and the lists of what was skipped,
    failed or excluded. Drops the per-case errors (the summary keeps their verdicts).
    """
    cells = list(dict.fromkeys((r["dtype"], r["N"], r["causal"]) for r in full["speed"]))
    timed = hopper_results.fa4_cells(full["speed"])
    impls = list(dict.fromkeys(r["impl"] for r in full["speed"]))
    meta = {**full["meta"]}
    meta.setdefault("tokens", bench.TOKENS)
    meta.setdefault("model_dim", bench.MODEL_DIM)
    meta.setdefault("exp2_pack", gluon_hopper.EXP2_PACK)
    meta["record"] = "trimmed from the full run by tools/gluon_ablation.py --record"
    return {"meta": meta,
            "compile": {name: {k: facts[k] for k in RECORD_COMPILE_KEYS if k in facts}
                        for name, facts in full["compile"].items()},
            "speed": {"cells": [list(c) for c in cells],
                      "tflops": {impl: [timed.get((impl, *c)) for c in cells] for impl in impls}},
            "summary": summary(full),
            **{key: full.get(key, []) for key in ("skipped", "failed", "excluded")}}


def write_record(full_path: Path | str, out: Path | str = hopper_results.FA4_FILE, trim=None,
                 tool: str = "tools/gluon_ablation.py") -> dict:
    """Read a full run's JSON at ``full_path``, write its trimmed record to ``out``, return it.

    Args:
        trim: ``full dict -> record dict``; None: this tool's :func:`record`.
            ``tools/gluon_bwd_ablation.py`` passes its own, with its name as ``tool``.
        tool: the tool whose ``--out`` made ``full_path``, named in the error.
    Raises ValueError naming ``full_path`` when it is not a full run (a key of it missing)."""
    full = json.loads(Path(full_path).read_text())
    missing = {"meta", "compile", "errors", "speed"} - set(full)
    if missing:
        raise ValueError(f"full_path must be a full run of {tool} (--out), {full_path} lacks {sorted(missing)}")
    data = (trim or record)(full)
    Path(out).write_text(json.dumps(data, indent=1) + "\n")
    return data


def report(data: dict) -> str:
    """What a run found, as chapter 09 shows it: the summary, each group's cells, the accuracy."""
    tables = [hopper_results.fa4_summary_table(data)]
    tables += [hopper_results.fa4_cell_table(data, v, d) for v, d in data["meta"]["groups"]
               if f"{v}/{d}/baseline" in data["speed"]["tflops"]]
    return "\n\n".join(tables + [hopper_results.fa4_accuracy_table(data)])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here (with --record: the record, by default "
                                          f"{hopper_results.FA4_FILE.relative_to(ROOT)})")
    parser.add_argument("--record", metavar="FULL_JSON", help="no GPU work: trim a full run's JSON (an earlier "
                                                               "--out) into chapter 09's record and print its tables")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="stop starting work after this many seconds")
    parser.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)), help="N of the timed cells")
    parser.add_argument("--no-speed", action="store_true", help="checks only")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        out = child(args.child)
        with open(args.out, "w") as f:
            json.dump(out, f)
        return out

    if args.record:
        data = write_record(args.record, args.out or hopper_results.FA4_FILE)
        print(report(data))
        print("wrote", args.out or hopper_results.FA4_FILE)
        return data

    import torch

    if not torch.cuda.is_available():
        sys.exit("tools/gluon_ablation.py needs a Hopper GPU; without one, tests/test_gluon_hopper.py "
                 "cross-compiles the switches and tests/test_fp_emulation.py checks the exp2 emulation")
    start = time.monotonic()
    seq_lens = [int(n) for n in args.seq_lens.split(",")]
    result = {"meta": {**bench.machine_meta(), "timer": "cudagraph", "seq_lens": seq_lens, "budget_s": args.budget_s,
                       "tokens": bench.TOKENS, "model_dim": bench.MODEL_DIM, "exp2_pack": gluon_hopper.EXP2_PACK,
                       "configs": CONFIGS, "groups": [list(g) for g in GROUPS], "fuzz_logit": FUZZ_LOGIT,
                       "rule": f"ok iff o_err and lse_err <= {SDPA_ERROR_FACTOR} x SDPA flash's (float64 reference)"},
              "compile": {}, "errors": [], "speed": [], "skipped": [], "failed": []}
    print(result["meta"], flush=True)

    print("\n== checks (children in parallel) ==", flush=True)
    specs = [f"check:{v}:{d}:{c}" for (v, d), configs in CHECK_CONFIGS.items() for c in configs]
    script = str(Path(__file__).resolve())

    def check(spec: str) -> dict:
        return gluon_forward.run_child(spec, False, script=script, timeout_s=CHECK_TIMEOUT_S, silence_s=CHECK_SILENCE_S)

    with ThreadPoolExecutor(PARALLEL_CHECKS) as pool:
        parts = list(pool.map(check, specs))
    excluded = set()  # configs that crashed, hung or raised in their checks: not timed (a crash would end a child)
    for spec, part in zip(specs, parts):
        name = "/".join(spec.split(":")[1:])
        if spec in part["compile"]:  # the runner's record of a child that failed
            part["compile"][name] = part["compile"].pop(spec)
        if "error" in part["compile"].get(name, {}) or any("error" in r for r in part["errors"]):
            excluded.add(name)
        _merge(result, part)
    result["excluded"] = sorted(excluded)
    print(f"  checks done at {time.monotonic() - start:.0f} s; crashed: {sorted(excluded) or 'none'}", flush=True)

    cell_s = CELL_S
    if not args.no_speed:
        step = 0
        while True:
            plan = speed_plan(result["speed"], excluded)
            if step >= len(plan):
                break
            items = plan[step]
            step += 1
            left = args.budget_s - (time.monotonic() - start)
            if not items:
                continue
            if left < CHILD_START_S + cell_s * len(DTYPES) * 2:  # not even one item's cells
                result["skipped"] += items
                print(f"\n== skipped (budget): {items} ==", flush=True)
                continue
            print(f"\n== speed: {items} ({left:.0f} s left) ==", flush=True)
            t0, before = time.monotonic(), len(result["speed"])
            deadline = time.time() + left - CHILD_START_S
            spec = f"speed:{deadline}:{','.join(map(str, seq_lens))}:{','.join(items)}"
            part = gluon_forward.run_child(spec, True, script=script, timeout_s=left + CHILD_START_S,
                                           silence_s=SPEED_SILENCE_S)
            if spec in part["compile"]:  # the child crashed or hung: what it printed is above
                result["failed"].append({"items": items, **part["compile"].pop(spec)})
            _merge(result, part)
            timed = sum("tflops" in r for r in result["speed"][before:])
            if timed:
                cell_s = max(CELL_S / 2, (time.monotonic() - t0 - CHILD_START_S) / timed)
            result["skipped"] += sorted({r["impl"] for r in result["speed"][before:] if "skipped" in r})

    result["summary"] = summary(result)
    result["meta"]["wall_s"] = round(time.monotonic() - start, 1)
    print("\n== compiled kernels (fp16, causal, N=1024, H=16) ==")
    for name, facts in result["compile"].items():
        print(f"  {name:32} {facts}")
    print()
    print(report(record(result)))
    if result["skipped"] or result["failed"]:
        print(f"\n  not timed (budget): {result['skipped']}; failed: {result['failed']}")
    print(f"\n  wall time {result['meta']['wall_s']} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", args.out)
    return result


if __name__ == "__main__":
    main()
