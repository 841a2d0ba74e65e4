"""Chapter 11's recorded multi-GPU measurements: the course's ring attention on 1, 2 and 4 GPUs and
PyTorch's ``context_parallel`` on the same shapes, beside the chapter's cost model.

The numbers come from one run of ``tools/bench_ring.py`` on a machine with several GPUs and live
in ``course_lib/data/benchmarks/ring_multi_gpu.json``, in that tool's format. This module only
reads, checks, summarises and plots them, so that chapter 11 shows the same results on a CPU
machine. When the file is absent, :func:`recorded` returns None and :func:`status` says so:
nothing here invents a number.

File format (written by ``tools/bench_ring.py``)::

    {"meta": {"gpu", "gpu_count", "driver", "link" (``nvidia-smi topo -m``), "torch", "triton",
              "nccl", "cuda", "python", "date", "env" (the NVLink-multicast switches),
              "config": {"dtype", "d", "heads", "batch", "layout", "repeats", "worlds",
                         "strong_n", "weak_tokens_per_gpu", ...}},
     "rows": [{"impl": "course" | "context_parallel" | "sdpa", "world": W, "N": tokens,
               "causal": bool, "pass": "fwd" | "fwd+bwd", "ms": time per call (slowest rank),
               "tflops_per_gpu": FLOPs / W / time, "peak_mib": [per GPU], "inputs_mib": [per GPU],
               "wait_fraction": share of the ring steps spent waiting for a transfer (course,
               W >= 2; else None), "bytes_per_step": most bytes one rank sent in one step,
               "trace": {"fwd" | "bwd": {"compute_ms", "wait_ms", "wait_fraction",
                                         "bytes_per_step"}}}, ...],
     "skipped": [{"impl", "world", "N", "causal", "pass", "reason"}, ...],
     "correctness": [{"impl", "world", "N", "causal",
                      "max_rel_err": {"o", "dq", "dk", "dv"} or None, "error": str or None}, ...]}

W = 1 is one GPU running the whole sequence: ``course`` is ``course_lib.flash_attention`` (the
ring's own kernel), ``sdpa`` is ``scaled_dot_product_attention`` (what ``context_parallel``
distributes). FLOPs follow :func:`course_lib.measure.bench.flops` (``4·B·H·N²·d``, halved when causal,
×3.5 forward+backward).

Efficiencies (:func:`strong_scaling`, :func:`weak_scaling`): strong, the same ``N`` on ``W``
GPUs, ``t₁ / (W · t_W)``; weak, the same tokens per GPU, TFLOP/s per GPU on ``W`` GPUs over
TFLOP/s on one GPU with ``N / W`` tokens. :func:`model` is the chapter's cost model fed with the
measured one-GPU time: each step lasts the longer of its compute (``t₁ / W²``: the zig-zag ring
splits the work into ``W²`` equal blocks) and its transfer (``ring.step_bytes`` over the link).
"""

from __future__ import annotations

import json
from pathlib import Path

from course_lib.integrations import ring
from course_lib.measure.bench import RECORDED_DIR

RECORDED_FILE = RECORDED_DIR / "ring_multi_gpu.json"

IMPLS = {"course": "the course's ring (W = 1: course_lib.flash_attention)",
         "context_parallel": "PyTorch context_parallel around SDPA",
         "sdpa": "SDPA on one GPU (context_parallel's W = 1)"}
BASELINE_OF = {"course": "course", "context_parallel": "sdpa"}  # each ring's one-GPU time
RING_NAMES = {"course": "course ring", "context_parallel": "context_parallel"}
PASSES = ("fwd", "fwd+bwd")
PASS_NAMES = {"fwd": "forward", "fwd+bwd": "forward + backward"}
GRADS = ("o", "dq", "dk", "dv")
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# The ring's dK/dV accumulators travel in float32 whatever the inputs' dtype (ring._ring_backward).
ACCUMULATOR_BYTES = 4
META_KEYS = ("gpu", "gpu_count", "link", "torch", "triton", "date", "config")
CONFIG_KEYS = ("dtype", "d", "heads", "batch", "layout")
ROW_KEYS = ("impl", "world", "N", "causal", "pass", "ms", "tflops_per_gpu", "peak_mib")
SKIP_KEYS = ("impl", "world", "N", "causal", "pass", "reason")
CHECK_KEYS = ("impl", "world", "N", "causal", "max_rel_err")
NOT_RECORDED = ("No multi-GPU results are recorded yet for chapter 11 "
                "(course_lib/data/benchmarks/ring_multi_gpu.json is absent): the table and the "
                "curves appear once tools/bench_ring.py has been run on a machine with 4 GPUs and "
                "its file committed. Until then the chapter has its cost model only.")
MIB = 2**20


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _validate_row(i: int, row, keys, where: str) -> None:
    if not isinstance(row, dict):
        raise ValueError(f"data['{where}'][{i}] must be a dict, got {type(row).__name__}")
    lacking = [key for key in keys if key not in row]
    if lacking:
        raise ValueError(f"data['{where}'][{i}] lacks {', '.join(lacking)}")
    for key, allowed in (("impl", tuple(IMPLS)), ("pass", PASSES)):
        if key in keys and row[key] not in allowed:
            raise ValueError(f"data['{where}'][{i}]['{key}'] must be one of {', '.join(allowed)}, "
                             f"got {row[key]!r}")
    for key in ("world", "N"):
        if not _positive_int(row[key]):
            raise ValueError(f"data['{where}'][{i}]['{key}'] must be a positive int, got {row[key]!r}")
    if not isinstance(row["causal"], bool):
        raise ValueError(f"data['{where}'][{i}]['causal'] must be true or false, got {row['causal']!r}")


def validate(data) -> dict:
    """``data`` when it has the format above; else ValueError naming what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict):
        raise ValueError("data must be a dict with a 'meta' dict (the provenance header)")
    missing = [key for key in META_KEYS if key not in data["meta"]]
    if missing:
        raise ValueError(f"data['meta'] lacks {', '.join(missing)} (provenance: "
                         f"{', '.join(META_KEYS)})")
    config = data["meta"]["config"]
    lacking = [key for key in CONFIG_KEYS if not isinstance(config, dict) or key not in config]
    if lacking:
        raise ValueError(f"data['meta']['config'] lacks {', '.join(lacking)}")
    _check_choice("data['meta']['config']['dtype']", config["dtype"], tuple(ELEMENT_BYTES))
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise ValueError("data['rows'] must be a non-empty list of measurements")
    for i, row in enumerate(rows):
        _validate_row(i, row, ROW_KEYS, "rows")
        if not (isinstance(row["ms"], (int, float)) and row["ms"] > 0):
            raise ValueError(f"data['rows'][{i}]['ms'] must be a positive time, got {row['ms']!r}")
        if not isinstance(row["peak_mib"], list):
            raise ValueError(f"data['rows'][{i}]['peak_mib'] must be a list (one entry per GPU), "
                             f"got {row['peak_mib']!r}")
        wait = row.get("wait_fraction")
        if wait is not None and not 0 <= wait <= 1:
            raise ValueError(f"data['rows'][{i}]['wait_fraction'] must be in [0, 1] or None, "
                             f"got {wait!r}")
    for i, row in enumerate(data.get("skipped", [])):
        _validate_row(i, row, SKIP_KEYS, "skipped")
    for i, row in enumerate(data.get("correctness", [])):
        _validate_row(i, row, CHECK_KEYS, "correctness")
        errors = row["max_rel_err"]
        if errors is not None and set(errors) - set(GRADS):
            raise ValueError(f"data['correctness'][{i}]['max_rel_err'] has keys "
                             f"{sorted(errors)}; expected some of {', '.join(GRADS)}")
    return data


def load(path: Path | str = RECORDED_FILE) -> dict:
    """The recorded measurements, validated. FileNotFoundError naming ``path`` when absent."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no recorded chapter 11 results at {path}; run "
                                f"tools/bench_ring.py on a machine with several GPUs")
    return validate(json.loads(path.read_text()))


def recorded(path: Path | str = RECORDED_FILE) -> dict | None:
    """:func:`load`, or None when the file is absent (a malformed file still raises)."""
    try:
        return load(path)
    except FileNotFoundError:
        return None


def provenance(data: dict) -> str:
    """One line: which GPUs, how many, versions and date."""
    m = data["meta"]
    driver = f", driver {m['driver']}" if "driver" in m else ""
    nccl = f", NCCL {m['nccl']}" if "nccl" in m else ""
    gpus = f"{m['gpu_count']} × {m['gpu']}" if m["gpu_count"] else m["gpu"]
    partial = " (a partial run: it stopped before the end)" if m.get("partial") else ""
    return (f"{gpus}{driver}, torch {m['torch']}, triton {m['triton']}{nccl}, measured "
            f"{m['date']}{partial}")


def timer_note(data: dict) -> str:
    """One phrase: how ``tools/bench_ring.py`` timed the rows (its own wall-clock loop, none of
    :data:`course_lib.measure.bench.TIMERS`) and the ring steps' trace.

    Args:
        data: the recorded results (``meta["config"]``: ``repeats``, ``device``).

    Returns:
        the phrase that ends :func:`format_table` and the plot's title.
    """
    config = data["meta"]["config"]
    calls = f"{config['repeats']} calls" if config.get("repeats") else "calls"
    on_gpu = config.get("device", "cuda") == "cuda"  # the tool's --cpu run: gloo, the host clock
    return (f"ms timed by the wall clock: {calls} back to back between "
            f"{'torch.cuda.synchronize() and barriers' if on_gpu else 'barriers'}, after a warm-up call "
            f"(the slowest rank's time); wait: {'CUDA events' if on_gpu else 'the host clock'} at each ring step")


def status(path: Path | str = RECORDED_FILE) -> str:
    """One line: where the recorded results come from, or that none are recorded yet."""
    data = recorded(path)
    return NOT_RECORDED if data is None else f"recorded on {provenance(data)}"


def row(data: dict, impl: str, world: int, n: int, causal: bool, pass_: str) -> dict | None:
    """The measurement of ``impl`` at ``(W, N, causal, pass)``, or None when it was not taken."""
    _check_choice("impl", impl, tuple(IMPLS))
    _check_choice("pass_", pass_, PASSES)
    for r in data["rows"]:
        if (r["impl"], r["world"], r["N"], r["causal"], r["pass"]) == (impl, world, n, causal, pass_):
            return r
    return None


def strong_scaling(data: dict, impl: str = "course", causal: bool = True,
                   pass_: str = "fwd+bwd") -> list[dict]:
    """Strong-scaling efficiency ``t₁ / (W · t_W)`` of every ``(W ≥ 2, N)`` measured with its
    one-GPU time (:data:`BASELINE_OF`): ``[{"world", "N", "efficiency"}]`` by N, then W."""
    points = []
    for r in data["rows"]:
        if (r["impl"], r["causal"], r["pass"]) != (impl, causal, pass_) or r["world"] < 2:
            continue
        one = row(data, BASELINE_OF[impl], 1, r["N"], causal, pass_)
        if one is not None:
            points.append({"world": r["world"], "N": r["N"],
                           "efficiency": one["ms"] / (r["world"] * r["ms"])})
    return sorted(points, key=lambda p: (p["N"], p["world"]))


def weak_scaling(data: dict, impl: str = "course", causal: bool = True,
                 pass_: str = "fwd+bwd") -> list[dict]:
    """Weak-scaling efficiency: TFLOP/s per GPU on ``W ≥ 2`` GPUs over one GPU's on ``N / W``
    tokens, for every such pair measured: ``[{"world", "tokens_per_gpu", "N", "efficiency"}]``."""
    points = []
    for r in data["rows"]:
        if (r["impl"], r["causal"], r["pass"]) != (impl, causal, pass_) or r["world"] < 2:
            continue
        tokens = r["N"] // r["world"]
        one = row(data, BASELINE_OF[impl], 1, tokens, causal, pass_)
        if one is not None:
            points.append({"world": r["world"], "tokens_per_gpu": tokens, "N": r["N"],
                           "efficiency": r["tflops_per_gpu"] / one["tflops_per_gpu"]})
    return sorted(points, key=lambda p: (p["tokens_per_gpu"], p["world"]))


def model(data: dict, world: int, n: int, causal: bool, pass_: str = "fwd+bwd",
          link_bytes_per_s: float = ring.NVLINK_H100_BYTES_PER_S) -> dict | None:
    """The chapter's cost model for the course ring at ``(W, N)``, fed with the measured one-GPU
    times at ``N``; None when those were not measured.

    Each ring step lasts ``max(compute, transfer)``: compute ``t₁ / W²`` (forward; the backward
    ``(t₁,fwd+bwd − t₁,fwd) / W²``), transfer ``ring.step_bytes`` over ``link_bytes_per_s``
    (forward: K and V on ``W − 1`` steps; backward: K, V and the float32 dK/dV accumulators,
    the last step dK/dV only).

    Returns:
        ``{"ms", "efficiency", "wait_fraction", "compute_ms", "transfer_ms"}``: the modelled
        call time, ``t₁ / (W · ms)``, the share of it spent waiting for transfers, and one
        forward step's compute and transfer.
    """
    _check_choice("pass_", pass_, PASSES)
    fwd = row(data, "course", 1, n, causal, "fwd")
    both = row(data, "course", 1, n, causal, "fwd+bwd") if pass_ == "fwd+bwd" else None
    if fwd is None or (pass_ == "fwd+bwd" and both is None):
        return None
    cfg = data["meta"]["config"]
    sizes = ring.step_bytes(cfg["batch"], cfg["heads"], n // world, cfg["d"],
                            ELEMENT_BYTES[cfg["dtype"]], "bwd", grad_bytes=ACCUMULATOR_BYTES)
    ms_per_byte = 1e3 / link_bytes_per_s
    compute = fwd["ms"] / world**2
    transfer = sizes["kv"] * ms_per_byte
    steps = [(compute, transfer)] * (world - 1) + [(compute, 0.0)]
    total_one = fwd["ms"]
    if pass_ == "fwd+bwd":
        compute_b = (both["ms"] - fwd["ms"]) / world**2
        steps += [(compute_b, (sizes["kv"] + sizes["dkv"]) * ms_per_byte)] * (world - 1)
        steps += [(compute_b, sizes["dkv"] * ms_per_byte)]
        total_one = both["ms"]
    ms = sum(max(c, x) for c, x in steps)
    waiting = sum(max(0.0, x - c) for c, x in steps)
    return {"ms": ms, "efficiency": total_one / (world * ms), "wait_fraction": waiting / ms,
            "compute_ms": compute, "transfer_ms": transfer}


def versus_context_parallel(data: dict, causal: bool = True, pass_: str = "fwd+bwd") -> list[dict]:
    """``context_parallel``'s time over the course ring's at every ``(W ≥ 2, N)`` both ran
    (above 1: the course ring is faster): ``[{"world", "N", "ratio"}]``."""
    points = []
    for r in data["rows"]:
        if (r["impl"], r["causal"], r["pass"]) != ("course", causal, pass_) or r["world"] < 2:
            continue
        cp = row(data, "context_parallel", r["world"], r["N"], causal, pass_)
        if cp is not None:
            points.append({"world": r["world"], "N": r["N"], "ratio": cp["ms"] / r["ms"]})
    return sorted(points, key=lambda p: (p["N"], p["world"]))


def disagreements(data: dict, threshold: float = 0.1) -> list[dict]:
    """Where the measured strong-scaling efficiency of the course ring and :func:`model`'s differ
    by more than ``threshold``: ``[{"world", "N", "causal", "pass", "measured", "model"}]``."""
    found = []
    for pass_ in PASSES:
        for causal in (False, True):
            for p in strong_scaling(data, "course", causal, pass_):
                m = model(data, p["world"], p["N"], causal, pass_)
                if m is not None and abs(p["efficiency"] - m["efficiency"]) > threshold:
                    found.append({"world": p["world"], "N": p["N"], "causal": causal,
                                  "pass": pass_, "measured": p["efficiency"],
                                  "model": m["efficiency"]})
    return found


def _fmt(value, spec: str, missing: str = "—") -> str:
    return missing if value is None else format(value, spec)


def format_table(data: dict) -> str:
    """A text table of the course ring: per ``(W, N, causal, pass)`` the time, TFLOP/s per GPU,
    strong-scaling efficiency measured and modelled, the share of the steps spent waiting
    (measured / modelled), bytes per step, peak memory of the fullest GPU, and context_parallel's
    time and its ratio to ours; the last line names the timer (:func:`timer_note`)."""
    head = (f"{'W':>2} {'N':>8} {'causal':>6} {'pass':>7} {'ms':>9} {'TF/s/GPU':>8} "
            f"{'eff':>5} {'model':>5} {'wait':>5} {'model':>5} {'MiB/step':>8} {'peak GiB':>8} "
            f"{'CP ms':>9} {'CP/ours':>7}")
    lines = [head]
    for r in sorted((r for r in data["rows"] if r["impl"] == "course"),
                    key=lambda r: (r["pass"], r["causal"], r["N"], r["world"])):
        w, n, causal, pass_ = r["world"], r["N"], r["causal"], r["pass"]
        one = row(data, "course", 1, n, causal, pass_)
        eff = one["ms"] / (w * r["ms"]) if one is not None and w > 1 else None
        m = model(data, w, n, causal, pass_) if w > 1 else None
        cp = row(data, "context_parallel", w, n, causal, pass_) if w > 1 else None
        peak = max(r["peak_mib"]) / 1024 if r["peak_mib"] and None not in r["peak_mib"] else None
        step = r.get("bytes_per_step")
        lines.append(
            f"{w:2d} {n:8d} {str(causal):>6} {pass_:>7} {r['ms']:9.2f} {r['tflops_per_gpu']:8.1f} "
            f"{_fmt(eff, '5.2f'):>5} {_fmt(m and m['efficiency'], '5.2f'):>5} "
            f"{_fmt(r.get('wait_fraction'), '5.0%'):>5} {_fmt(m and m['wait_fraction'], '5.0%'):>5} "
            f"{_fmt(step and step / MIB, '8.1f'):>8} {_fmt(peak, '8.2f'):>8} "
            f"{_fmt(cp and cp['ms'], '9.2f'):>9} {_fmt(cp and cp['ms'] / r['ms'], '7.2f'):>7}")
    lines.append(timer_note(data))
    return "\n".join(lines)


def format_correctness(data: dict) -> str:
    """One line per correctness check: the max relative error of each gathered tensor against the
    one-GPU kernel (``max |Δ| / max |ref|``), or the error that stopped it."""
    lines = []
    for c in data.get("correctness", []):
        what = (f"{RING_NAMES.get(c['impl'], c['impl'])}, W = {c['world']}, N = {c['N']:,}, "
                f"{'causal' if c['causal'] else 'not causal'}")
        if c["max_rel_err"] is None:
            lines.append(f"{what}: not checked ({c.get('error')})")
        else:
            errs = ", ".join(f"{k} {v:.2e}" for k, v in c["max_rel_err"].items())
            lines.append(f"{what}: max relative error {errs}")
    return "\n".join(lines)


def format_skipped(data: dict) -> str:
    """One line per measurement the run left out, with its reason."""
    return "\n".join(f"{s['impl']} W = {s['world']} N = {s['N']:,} "
                     f"{'causal' if s['causal'] else 'not causal'} {s['pass']}: {s['reason']}"
                     for s in data.get("skipped", []))


def plot_scaling(data: dict):
    """Strong-scaling efficiency against N for forward and forward + backward (measured: markers
    and solid lines; the cost model: dashed), and weak-scaling efficiency against W."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=100, layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    worlds = sorted({r["world"] for r in data["rows"] if r["world"] > 1})
    for ax, pass_ in zip(axes, PASSES):
        for i, w in enumerate(worlds):
            for causal, marker in ((False, "o"), (True, "s")):
                points = [p for p in strong_scaling(data, "course", causal, pass_) if p["world"] == w]
                if not points:
                    continue
                label = f"W = {w}, {'causal' if causal else 'not causal'}"
                ns = [p["N"] for p in points]
                ax.plot(ns, [p["efficiency"] for p in points], marker=marker,
                        color=colours[i % len(colours)], label=label)
                modelled = [model(data, w, n, causal, pass_) for n in ns]
                ax.plot(ns, [m["efficiency"] if m else float("nan") for m in modelled], "--",
                        color=colours[i % len(colours)], linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.1)
        ax.axhline(1.0, color="0.6", linewidth=0.8)
        ax.set_xlabel("sequence length N (tokens)")
        ax.set_ylabel("strong-scaling efficiency t₁ / (W·t_W)")
        ax.set_title(f"{PASS_NAMES[pass_]} (dashed: cost model)", fontsize=10)
        ax.legend(fontsize=8)
    ax = axes[2]
    for causal, marker in ((False, "o"), (True, "s")):
        points = weak_scaling(data, "course", causal, "fwd+bwd")
        for i, tokens in enumerate(sorted({p["tokens_per_gpu"] for p in points})):
            mine = [p for p in points if p["tokens_per_gpu"] == tokens]
            ax.plot([1] + [p["world"] for p in mine], [1.0] + [p["efficiency"] for p in mine],
                    marker=marker, color=colours[i % len(colours)],
                    label=f"{tokens:,} tokens/GPU, {'causal' if causal else 'not causal'}")
    ax.set_ylim(0, 1.1)
    ax.set_xlabel("GPUs W")
    ax.set_ylabel("TFLOP/s per GPU ÷ one GPU's on N / W")
    ax.set_title("weak scaling, forward + backward", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(f"Ring attention, {provenance(data)}\n{timer_note(data)}", fontsize=10)
    return fig
