"""Record ring attention on 1, 2 and 4 GPUs: strong and weak scaling, how much communication
hides, bytes and memory per GPU, and PyTorch's context_parallel on the same shapes (chapter 11).

One command starts one process per GPU (NCCL, through ``course_lib.integrations.ring.run_ranks``) and writes
``course_lib.measure.ring_results``' format::

    python tools/bench_ring.py --out ring_multi_gpu.json     # the default grid on 4 GPUs, < 8 min
    python tools/bench_ring.py --dry-run                     # the grid and its estimate only
    python tools/bench_ring.py --cpu --out /tmp/ring.json    # the plumbing: gloo, interpreter, tiny

The grid: strong scaling, every ``--strong-n`` on every W of ``--worlds``; weak scaling, every
``--weak-tokens`` per GPU on every W (``N = W × tokens``); the union, each point measured once,
cheapest first; causal and not, forward and forward+backward. W = 1 is one GPU running the whole
sequence: ``course_lib.flash_attention`` for the course, SDPA for context_parallel. For W ≥ 2
the course ring uses zig-zag shards; ``context_parallel`` shards in its own order (load
balancing on for causal calls only: it refuses it otherwise).

Each measurement: one warm-up call (compiles), ``--repeats`` timed calls between barriers (the
slowest rank's time), peak memory per GPU, and for the course ring one traced call (CUDA events
per ring step: compute, wait for the transfer, bytes sent). Before it, the time it will take is
estimated from its FLOPs and the rate measured so far (or ``ASSUMED_TFLOPS``); it is skipped,
with the reason printed and recorded, when the estimate exceeds ``--max-point-s`` or what is
left of ``--budget-s``. First of all, at ``--verify-n`` tokens on every W ≥ 2, causal and not,
the gathered outputs and gradients of both rings are compared with ``course_lib.flash_attention``
on the whole sequence on one GPU (max |Δ| / max |ref|, per tensor).

NVLink multicast stays off for every rank: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set here (the machines this project borrows are shared).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.measure import bench, ring_results
from course_lib.integrations import ring

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
IMPLS = ("course", "context_parallel")  # "sdpa" (W = 1) comes with context_parallel
# The rate assumed for a measurement of a kind not measured yet, per GPU: deliberately below what
# an H100 reaches (FACTS.md: 300-450 TFLOP/s for these kernels), so the first estimates are long.
ASSUMED_TFLOPS = {"cuda": 100.0, "cpu": 1e-5}
ESTIMATE_SAFETY = 1.5  # estimates are multiplied by this: a larger N can run at a lower rate
OVERHEAD_S = 1.0  # per measurement: barriers, allocation, the trace's synchronisation
SECONDS_PER_MS = 1e-3
TERA = 1e12


@dataclass(frozen=True)
class Config:
    """What to measure and within what time (see the module docstring)."""

    device: str
    worlds: tuple
    strong_n: tuple
    weak_tokens: tuple
    causals: tuple
    passes: tuple
    impls: tuple
    dtype: str
    d: int
    heads: int
    batch: int
    layout: str
    repeats: int
    budget_s: float
    max_point_s: float
    verify_n: int | None
    seed: int = 0
    partial_out: str | None = None  # rank 0 rewrites this file after every measurement


# The GPU default must finish inside 8 minutes of a 4-GPU machine, start-up included: the budget
# (compiles included: its clock starts when the ranks do) plus one last measurement of at most
# max_point_s plus ~40 s of imports and NCCL set-up. Estimated (not measured) from the H100 rates
# of FACTS.md, the grid itself needs about 200 s; the budget only bites when the machine is slower.
DEFAULTS = {
    "cuda": dict(worlds=(1, 2, 4), strong_n=(32768, 131072, 262144), weak_tokens=(32768, 65536),
                 dtype="bfloat16", d=128, heads=8, batch=1, repeats=3, budget_s=360.0,
                 max_point_s=60.0, verify_n=32768),
    "cpu": dict(worlds=(1, 2), strong_n=(32,), weak_tokens=(16,), dtype="float32", d=16, heads=1,
                batch=1, repeats=1, budget_s=240.0, max_point_s=120.0, verify_n=32),
}


@dataclass(frozen=True)
class Measurement:
    impl: str
    world: int
    n: int
    causal: bool
    pass_: str

    def key(self) -> tuple:
        """Measurements whose rates predict each other's: same implementation, one GPU or a ring."""
        return self.impl, self.world > 1, self.causal, self.pass_

    def label(self) -> str:
        return (f"{self.impl:<16} W={self.world} N={self.n:>7} "
                f"{'causal' if self.causal else 'full  '} {self.pass_:<7}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="gloo processes on the CPU (tiny sizes)")
    p.add_argument("--worlds", type=int, nargs="+", help="GPU counts W (1 = the one-GPU kernel)")
    p.add_argument("--strong-n", type=int, nargs="+", help="total tokens N for strong scaling")
    p.add_argument("--weak-tokens", type=int, nargs="+", help="tokens per GPU for weak scaling")
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--passes", nargs="+", choices=ring_results.PASSES, default=list(ring_results.PASSES))
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--dtype", choices=tuple(ring_results.ELEMENT_BYTES))
    p.add_argument("--d", type=int, help="head dim")
    p.add_argument("--heads", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--layout", choices=ring.LAYOUTS, default="zigzag")
    p.add_argument("--repeats", type=int, help="timed calls per measurement")
    p.add_argument("--budget-s", type=float, help="seconds for all measurements, startup included")
    p.add_argument("--max-point-s", type=float, help="seconds one measurement may take")
    p.add_argument("--verify-n", type=int, help="tokens of the correctness check (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON file to write (rewritten after every measurement)")
    p.add_argument("--dry-run", action="store_true", help="print the grid and estimate; run nothing")
    return p


def _positive(name: str, value) -> None:
    if value is None or value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")


def config_from_args(args: argparse.Namespace) -> Config:
    """The :class:`Config` the arguments ask for, defaults filled in; ValueError naming the flag."""
    device = "cpu" if args.cpu else "cuda"
    base = DEFAULTS[device]

    def pick(name):
        value = getattr(args, name)
        return base[name] if value is None else value

    worlds = tuple(sorted(set(pick("worlds"))))
    strong = tuple(sorted(set(pick("strong_n"))))
    weak = tuple(sorted(set(pick("weak_tokens"))))
    for flag, values in (("--worlds", worlds), ("--strong-n", strong), ("--weak-tokens", weak)):
        for value in values:
            _positive(flag, value)
    for name in ("d", "heads", "batch", "repeats", "budget_s", "max_point_s"):
        _positive("--" + name.replace("_", "-"), pick(name))
    verify = pick("verify_n")
    if verify < 0:
        raise ValueError(f"--verify-n must be 0 (no check) or a token count, got {verify}")
    config = Config(device=device, worlds=worlds, strong_n=strong, weak_tokens=weak,
                    causals={"both": (False, True), "yes": (True,), "no": (False,)}[args.causal],
                    passes=tuple(args.passes), impls=tuple(args.impls), dtype=pick("dtype"),
                    d=pick("d"), heads=pick("heads"), batch=pick("batch"), layout=args.layout,
                    repeats=pick("repeats"), budget_s=float(pick("budget_s")),
                    max_point_s=float(pick("max_point_s")), verify_n=verify or None, seed=args.seed,
                    partial_out=str(args.out) if args.out else None)
    for m in measurements(config):  # every ring shard must be whole chunks (zig-zag: 2W of them)
        chunks = 2 * m.world if m.world > 1 else 1
        if m.n % chunks:
            raise ValueError(f"N = {m.n} (from --strong-n or --weak-tokens × W) must be a multiple "
                             f"of 2·W = {chunks} for W = {m.world}: zig-zag shards and "
                             f"context_parallel's load balancing cut it into 2W chunks")
    if config.verify_n and any(config.verify_n % (2 * w) for w in worlds if w > 1):
        raise ValueError(f"--verify-n {config.verify_n} must be a multiple of 2·W for every W "
                         f"in {worlds}")
    return config


def points(config: Config) -> list[tuple[int, int]]:
    """``(W, N)`` of strong scaling (every N on every W) and weak scaling (N = W × tokens), each
    once, cheapest first (work per GPU ∝ N² / W)."""
    found = {(w, n) for w in config.worlds for n in config.strong_n}
    found |= {(w, w * t) for w in config.worlds for t in config.weak_tokens}
    return sorted(found, key=lambda p: (p[1] ** 2 / p[0], p[0]))


def measurements(config: Config) -> list[Measurement]:
    """Every measurement of the grid, in the order they run: per point, causal, pass, implementation."""
    out = []
    for w, n in points(config):
        for causal in config.causals:
            for pass_ in config.passes:
                for impl in config.impls:
                    if impl == "context_parallel":
                        impl = "context_parallel" if w > 1 else "sdpa"
                    out.append(Measurement(impl, w, n, causal, pass_))
    return out


def flops(config: Config, m: Measurement) -> float:
    return bench.flops(config.batch, config.heads, m.n, config.d, m.causal, m.pass_)


class Budget:
    """Rank 0's clock: estimates each measurement and says why to skip it, or None."""

    def __init__(self, config: Config, start: float | None = None):
        self.config = config
        self.start = time.perf_counter() if start is None else start
        self.rates: dict = {}  # Measurement.key() -> FLOP/s per GPU, the latest measured

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def estimate_s(self, m: Measurement) -> float:
        rate = self.rates.get(m.key(), ASSUMED_TFLOPS[self.config.device] * TERA)
        calls = 1 + self.config.repeats + (1 if m.impl == "course" and m.world > 1 else 0)
        return ESTIMATE_SAFETY * calls * flops(self.config, m) / m.world / rate + OVERHEAD_S

    def reason_to_skip(self, m: Measurement) -> str | None:
        estimate = self.estimate_s(m)
        left = self.config.budget_s - self.elapsed()
        if estimate > self.config.max_point_s:
            return (f"estimated {estimate:.0f} s, over --max-point-s {self.config.max_point_s:.0f} s "
                    f"(raise it to measure this size)")
        if estimate > left:
            return (f"estimated {estimate:.0f} s, over the {max(left, 0):.0f} s left of --budget-s "
                    f"{self.config.budget_s:.0f} s")
        return None

    def measured(self, m: Measurement, ms: float) -> None:
        self.rates[m.key()] = flops(self.config, m) / m.world / (ms * SECONDS_PER_MS)


# ---------------------------------------------------------------- inside each rank


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(group, device: torch.device) -> None:
    if group is None:
        return
    if device.type == "cuda":
        dist.barrier(group=group, device_ids=[device.index])
    else:
        dist.barrier(group=group)


def _timed_ms(fn, repeats: int, group, device: torch.device) -> float:
    """Milliseconds per call of ``fn`` after one warm-up call, between barriers of ``group``."""
    fn()
    _sync(device)
    _barrier(group, device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    _barrier(group, device)
    return (time.perf_counter() - start) / repeats / SECONDS_PER_MS


def _inputs(config: Config, n: int, device: torch.device):
    """The whole sequence's ``q, k, v, do`` ``(B, H, N, d)``: the same on every rank (one seed)."""
    gen = torch.Generator(device=device).manual_seed(config.seed)
    dtype = getattr(torch, config.dtype)
    return [torch.randn(config.batch, config.heads, n, config.d, device=device, dtype=dtype,
                        generator=gen) for _ in range(4)]


def _leaves(*tensors):
    return [t.detach().requires_grad_() for t in tensors]


def _call(pass_: str, forward, inputs, do):
    """A no-argument call: ``forward(*inputs)`` without autograd, or with its three gradients."""
    if pass_ == "fwd":
        def run():
            with torch.no_grad():
                return forward(*inputs)
        return run
    leaves = _leaves(*inputs)
    return lambda: torch.autograd.grad(forward(*leaves), leaves, do)


def _memory_start(device: torch.device):
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / ring_results.MIB


def _memory_peak(device: torch.device):
    return torch.cuda.max_memory_allocated(device) / ring_results.MIB if device.type == "cuda" else None


def _trace_summary(trace: list) -> dict:
    """Per pass of a traced ring call: mean compute and wait per step, the waiting share, the
    most bytes one step sent."""
    out = {}
    for phase in ("fwd", "bwd"):
        steps = [t for t in trace if t["pass_"] == phase]
        if steps:
            compute = sum(t["compute_s"] for t in steps)
            wait = sum(t["wait_s"] for t in steps)
            out[phase] = {"compute_ms": compute / len(steps) / SECONDS_PER_MS,
                          "wait_ms": wait / len(steps) / SECONDS_PER_MS,
                          "wait_fraction": wait / (compute + wait) if compute + wait else 0.0,
                          "bytes_per_step": max(t["bytes_sent"] for t in steps)}
    return out


def _mesh(group, device: torch.device):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device.type)


def measure(config: Config, m: Measurement, rank: int, group, device: torch.device) -> dict:
    """This rank's part of one measurement: ``{"ms", "peak_mib", "inputs_mib", "trace"}`` or
    ``{"error"}`` (context_parallel's failures are recorded, not fatal)."""
    q, k, v, do = _inputs(config, m.n, device)
    trace = None
    if m.world == 1:
        forward = ((lambda a, b, c: one_gpu_kernel(a, b, c, m.causal)) if m.impl == "course" else
                   (lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=m.causal)))
        start_mib = _memory_start(device)
        ms = _timed_ms(_call(m.pass_, forward, (q, k, v), do), config.repeats, None, device)
    elif m.impl == "course":
        qs, ks, vs, dos = (ring.shard(x, rank, m.world, config.layout) for x in (q, k, v, do))
        del q, k, v, do  # each rank keeps its shard only, as a real run would

        def forward(a, b, c, trace=None):
            return ring.ring_attention(a, b, c, m.causal, group=group, layout=config.layout,
                                       trace=trace)

        start_mib = _memory_start(device)
        ms = _timed_ms(_call(m.pass_, forward, (qs, ks, vs), dos), config.repeats, group, device)
        trace = []
        _call(m.pass_, lambda a, b, c: forward(a, b, c, trace), (qs, ks, vs), dos)()
        trace = _trace_summary(trace)
    else:
        buffers = [q, k, v, do]  # whole sequences: context_parallel shards them in place
        start_mib = _memory_start(device)
        try:
            with ring.context_parallel_buffers(_mesh(group, device), m.causal, buffers):
                forward = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=m.causal)
                ms = _timed_ms(_call(m.pass_, forward, buffers[:3], buffers[3]), config.repeats,
                               group, device)
        except Exception as err:  # noqa: BLE001 - PyTorch's ring failing is a result to record
            return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    return {"ms": ms, "peak_mib": _memory_peak(device), "inputs_mib": start_mib, "trace": trace}


def one_gpu_kernel(q, k, v, causal):
    """The one-GPU kernel the ring runs per block, on the whole sequence."""
    import course_lib

    return course_lib.flash_attention(q, k, v, causal)


def assemble(config: Config, m: Measurement, parts: list) -> dict:
    """One JSON row from every rank's :func:`measure` (ranks outside the measurement: None)."""
    parts = list(parts[:m.world])
    ms = parts[0]["ms"]
    row = {"impl": m.impl, "world": m.world, "N": m.n, "causal": m.causal, "pass": m.pass_,
           "ms": ms, "tflops_per_gpu": flops(config, m) / m.world / (ms * SECONDS_PER_MS) / TERA,
           "peak_mib": [p["peak_mib"] for p in parts], "inputs_mib": [p["inputs_mib"] for p in parts],
           "wait_fraction": None, "bytes_per_step": None, "trace": None}
    if parts[0]["trace"]:
        phases = [p["trace"] for p in parts]
        row["trace"] = {phase: {key: sum(t[phase][key] for t in phases) / len(phases)
                                for key in ("compute_ms", "wait_ms", "wait_fraction")}
                        for phase in phases[0]}
        for phase in row["trace"]:
            row["trace"][phase]["bytes_per_step"] = max(t[phase]["bytes_per_step"] for t in phases)
        compute = sum(t["compute_ms"] for t in row["trace"].values())
        wait = sum(t["wait_ms"] for t in row["trace"].values())
        row["wait_fraction"] = wait / (compute + wait) if compute + wait else 0.0
        row["bytes_per_step"] = max(t["bytes_per_step"] for t in row["trace"].values())
    return row


def _relative_errors(pairs) -> dict:
    """``max |got − ref|`` and ``max |ref|`` of each named pair (combined over ranks later)."""
    return {name: ((got.float() - ref.float()).abs().max().item(), ref.float().abs().max().item())
            for name, (got, ref) in pairs.items()}


def verify(config: Config, world: int, causal: bool, rank: int, group, device) -> dict | None:
    """This rank's errors for both rings at ``--verify-n`` against the one-GPU kernel."""
    if rank >= world:
        return None
    n = config.verify_n
    q, k, v, do = _inputs(config, n, device)
    leaves = _leaves(q, k, v)
    o = one_gpu_kernel(*leaves, causal)
    reference = dict(zip(ring_results.GRADS, (o.detach(), *torch.autograd.grad(o, leaves, do))))
    out = {}
    if "course" in config.impls:
        shards = [ring.shard(x, rank, world, config.layout) for x in (q, k, v, do)]
        mine = _leaves(*shards[:3])
        o_r = ring.ring_attention(*mine, causal, group=group, layout=config.layout)
        got = dict(zip(ring_results.GRADS, (o_r, *torch.autograd.grad(o_r, mine, shards[3]))))
        out["course"] = _relative_errors({name: (got[name], ring.shard(ref, rank, world, config.layout))
                                          for name, ref in reference.items()})
    if "context_parallel" in config.impls:
        layout = ring.context_parallel_layout(causal)
        buffers = [x.clone() for x in (q, k, v, do)]
        try:
            with ring.context_parallel_buffers(_mesh(group, device), causal, buffers):
                mine = _leaves(*buffers[:3])
                o_cp = F.scaled_dot_product_attention(*mine, is_causal=causal)
                got = dict(zip(ring_results.GRADS,
                               (o_cp, *torch.autograd.grad(o_cp, mine, buffers[3]))))
                out["context_parallel"] = _relative_errors(
                    {name: (got[name], ring.shard(ref, rank, world, layout))
                     for name, ref in reference.items()})
        except Exception as err:  # noqa: BLE001 - recorded, not fatal
            out["context_parallel"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    return out


def combine_checks(world: int, n: int, causal: bool, parts: list) -> list[dict]:
    """Correctness rows from every rank's :func:`verify`: max |Δ| over max |ref| per tensor."""
    rows = []
    for impl in parts[0]:
        mine = [p[impl] for p in parts[:world]]
        errors = next((e for e in mine if isinstance(e, str)), None)
        rel = None if errors else {
            name: max(e[name][0] for e in mine) / max(max(e[name][1] for e in mine), 1e-30)
            for name in ring_results.GRADS}
        rows.append({"impl": impl, "world": world, "N": n, "causal": causal,
                     "max_rel_err": rel, "error": errors})
    return rows


def _agree(value):
    """Rank 0's ``value`` on every rank (decisions must be the same everywhere)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value, world: int) -> list:
    parts = [None] * world
    dist.all_gather_object(parts, value)
    return parts


def _say(budget: Budget, text: str) -> None:
    print(f"[{budget.elapsed():5.0f} s] {text}", flush=True)


def worker(rank: int, world: int, config: Config, meta: dict) -> dict | None:
    """For ``ring.run_ranks``: run the verification and every measurement; rank 0 returns the
    results (``{"meta", "rows", "skipped", "correctness"}``), the others None."""
    device = ring.rank_device()
    groups = {w: (dist.new_group(list(range(w))) if w < world else dist.group.WORLD)
              for w in config.worlds if w > 1}
    budget = Budget(config)
    data = {"meta": {**meta, "partial": True}, "rows": [], "skipped": [], "correctness": []}
    if config.verify_n:
        for w in sorted(groups):
            for causal in config.causals:
                parts = _gather(verify(config, w, causal, rank, groups.get(w), device), world)
                if rank == 0:
                    checks = combine_checks(w, config.verify_n, causal, parts)
                    data["correctness"] += checks
                    _say(budget, ring_results.format_correctness({"correctness": checks}))
    for m in measurements(config):
        reason = _agree(budget.reason_to_skip(m) if rank == 0 else None)
        if reason is not None:
            if rank == 0:
                data["skipped"].append({"impl": m.impl, "world": m.world, "N": m.n,
                                        "causal": m.causal, "pass": m.pass_, "reason": reason})
                _say(budget, f"{m.label()} skipped: {reason}")
            continue
        mine = measure(config, m, rank, groups.get(m.world), device) if rank < m.world else None
        parts = _gather(mine, world)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if rank != 0:
            continue
        failed = next((p["error"] for p in parts[:m.world] if "error" in p), None)
        if failed:
            data["skipped"].append({"impl": m.impl, "world": m.world, "N": m.n, "causal": m.causal,
                                    "pass": m.pass_, "reason": failed})
            _say(budget, f"{m.label()} failed: {failed}")
        else:
            row = assemble(config, m, parts)
            budget.measured(m, row["ms"])
            data["rows"].append(row)
            wait = "" if row["wait_fraction"] is None else f", waiting {row['wait_fraction']:.0%}"
            _say(budget, f"{m.label()} {row['ms']:9.2f} ms, {row['tflops_per_gpu']:6.1f} "
                         f"TFLOP/s/GPU{wait}")
        if config.partial_out:
            Path(config.partial_out).write_text(json.dumps(data, indent=1) + "\n")
    if rank == 0:
        data["meta"].pop("partial")
        data["meta"]["seconds"] = round(budget.elapsed(), 1)
        return data
    return None


# ---------------------------------------------------------------- the launching process


def _command(args: list) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as err:
        return f"unknown ({type(err).__name__}: {err})"


def meta(config: Config) -> dict:
    """Provenance: GPU, how many, driver, link topology, versions, date, the switches set, the grid."""
    import triton

    data = {"torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "env": {name: os.environ.get(name) for name in MULTICAST_OFF},
            "command": " ".join(["python", "tools/bench_ring.py", *sys.argv[1:]]),
            "config": {k: v for k, v in asdict(config).items() if k != "partial_out"}}
    if config.device == "cuda":
        data.update(bench.machine_meta())
        data.update(gpu_count=torch.cuda.device_count(), link=_command(["nvidia-smi", "topo", "-m"]),
                    nccl=".".join(map(str, torch.cuda.nccl.version())), cuda=torch.version.cuda)
        from torch.distributed.tensor.experimental._attention import _cp_options

        data["context_parallel_rotate"] = str(_cp_options.rotate_method)  # how its ring moves K/V
        order = getattr(torch._C, "_get_sdp_priority_order", None)  # which backend SDPA tries first
        if order is not None:
            names = {int(v): k for k, v in torch.nn.attention.SDPBackend.__members__.items()}
            data["sdpa_priority"] = [names.get(i, str(i)) for i in order()]
    else:
        data.update(gpu=f"none: CPU ({platform.processor() or platform.machine()}, "
                        f"{os.cpu_count()} cores), Triton interpreter",
                    gpu_count=0, link="none (one machine, gloo over shared memory)")
    return data


def describe_plan(config: Config) -> str:
    """The grid and the budget's first estimate of each measurement, one line each."""
    budget = Budget(config, start=0.0)
    lines = [f"{len(measurements(config))} measurements, budget {config.budget_s:.0f} s "
             f"(estimates at the assumed {ASSUMED_TFLOPS[config.device]:g} TFLOP/s per GPU):"]
    lines += [f"  {m.label()} ~{budget.estimate_s(m):6.1f} s" for m in measurements(config)]
    total = sum(budget.estimate_s(m) for m in measurements(config))
    lines.append(f"total ~{total:.0f} s at the assumed rate (measured rates replace it as the run "
                 f"goes; what does not fit the budget is skipped, with the reason)")
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    p = parser()
    args = p.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as err:
        p.error(str(err))
    if args.dry_run:
        print(describe_plan(config))
        return None
    if config.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA GPU here: use --cpu")
    world = max(config.worlds)
    if config.device == "cuda" and torch.cuda.device_count() < world:
        p.error(f"--worlds asks for {world} GPUs, this machine has {torch.cuda.device_count()}")
    os.environ.update(MULTICAST_OFF)  # inherited by every rank
    info = meta(config)
    print(f"{ring.launch_plan(world, config.device).describe()}; NVLink multicast off "
          f"({', '.join(f'{k}={v}' for k, v in MULTICAST_OFF.items())})", flush=True)
    data = ring.run_ranks(worker, world, config, info, device=config.device,
                          timeout_s=config.budget_s + ring.GPU_TIMEOUT_S)[0]
    ring_results.validate(data)
    print(ring_results.provenance(data))
    print(ring_results.format_table(data))
    print(ring_results.format_correctness(data))
    if data["skipped"]:
        print("skipped:\n" + ring_results.format_skipped(data))
    if args.out:
        args.out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    main()
