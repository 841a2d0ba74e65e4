"""Chapter 08's recorded H100 benchmark of the Triton flash-decoding kernels (``tools/bench_decoding.py``):
read it, and print it as a table that names its timer. (The algorithm is :mod:`course_lib.attention.decoding`,
the kernels :mod:`course_lib.kernels.decoding`.)
"""

from __future__ import annotations

import json
from pathlib import Path

from course_lib.measure.bench import RECORDED_DIR, timer_note

RECORDED_BENCH = RECORDED_DIR / "h100_decoding.json"
# tools/bench_decoding.py times with triton.testing.do_bench; its file names no timer.
RECORDED_BENCH_TIMER = "events"


def load_recorded_bench(path: Path | str = RECORDED_BENCH) -> dict:
    """The results of ``python tools/bench_decoding.py`` on an H100 (with their provenance)."""
    return json.loads(Path(path).read_text())


def format_recorded_bench(data: dict) -> str:
    """A table: per (batch, cache length), time and bandwidth as a fraction of the measured copy
    ceiling, for ``flash_decode_triton`` and SDPA; the second line names the timer."""
    p = data["provenance"]
    lines = [f"{p['gpu']}, torch {p['torch']}, triton {p['triton']}, {p['date'][:10]}; {data['what']}",
             f"copy ceiling {data['copy_ceiling_bytes_per_s'] / 1e12:.2f} TB/s; "
             f"{data['shape']['heads']} query heads, {data['shape']['kv_heads']} K/V heads, "
             f"d={data['shape']['head_dim']}; {timer_note(p, RECORDED_BENCH_TIMER)}",
             f"{'batch':>5} {'N':>7} {'splits':>6} | {'triton ms':>9} {'of copy':>7} | {'sdpa ms':>8} {'of copy':>7}"]
    for r in data["results"]:
        t, s = r["triton"], r["sdpa"]
        lines.append(f"{r['batch']:>5} {r['seq_len']:>7} {r['splits']:>6} | {t['ms']:>9.3f} "
                     f"{t['fraction_of_copy_ceiling']:>7.0%} | {s['ms']:>8.3f} {s['fraction_of_copy_ceiling']:>7.0%}")
    return "\n".join(lines)
