"""What a learner's walkthrough found wrong in the notebooks' prose and plots, each checked here.

Where the prose quotes a number, the test runs the computation the notebook shows (its own code
cells, executed from the notebook file) and compares the number the prose quotes with the result.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "solutions"
NOTEBOOKS = ROOT / "notebooks"


def _notebook(name: str, folder: Path = SOLUTIONS) -> dict:
    return json.loads((folder / f"{name}.ipynb").read_text(encoding="utf-8"))


def _source(cell) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def _cell(nb: dict, cell_id: str) -> str:
    found = [_source(c) for c in nb["cells"] if c.get("id") == cell_id]
    assert len(found) == 1, f"cell {cell_id} not found"
    return found[0]


def _run_cells(nb: dict, *cell_ids: str, namespace: dict | None = None) -> dict:
    """Execute the notebook's code cells ``cell_ids`` in order, in one namespace."""
    namespace = {} if namespace is None else namespace
    for cell_id in cell_ids:
        exec(compile(_cell(nb, cell_id), f"<cell {cell_id}>", "exec"), namespace)
    return namespace


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _quoted(pattern: str, text: str) -> float:
    """The number captured by ``pattern`` in ``text`` (which must contain it)."""
    found = re.search(pattern, text, re.S)
    assert found, f"the prose no longer says {pattern!r}"
    return _number(found.group(1))


# ------------------------------------------------------------------ chapter 04: FA1 vs standard

CH04 = "04_tiled_attention_numpy"


@pytest.mark.ch04
def test_ch04_prose_matches_the_traffic_table():
    """The prose under the table said both tiled orders "move several times less data" while the
    table shows FA1 moving 1.45× more than standard attention; now it quotes the table's ratios
    and says when FA1 wins (BLOCK_N, hence the SRAM size M, against d)."""
    nb = _notebook(CH04)
    prose = _cell(nb, "8954a835")
    assert "several times less data" not in prose
    ns = _run_cells(nb, "72c92aeb", "17e3736e", "84c4c02c")  # the counters of the table, and M
    std, fa1, fa2, d = ns["std"], ns["fa1"], ns["fa2"], ns["d"]
    std_total = std.reads + std.writes
    fa1_ratio = (fa1.reads + fa1.writes) / std_total
    fa2_ratio = std_total / (fa2.reads + fa2.writes)
    assert fa1_ratio > 1 > 1 / fa2_ratio  # FA1 moves more, FA2 less, at this size
    assert _quoted(r"FA1 moves ([\d.]+)× more", prose) == round(fa1_ratio, 2)
    assert _quoted(r"FA2 moves ([\d.]+)× less", prose) == round(fa2_ratio, 1)

    from course_lib.attention import iomodel

    # FA1's cost per score with the cell's tiles, and where it breaks even with standard attention
    block_m, block_n = 32, 16  # the cell's tiles (17e3736e)
    assert f"block_m={block_m}, block_n={block_n}" in _cell(nb, "17e3736e")
    per_row = 3 * d + 4  # q row read; o, l, m read and written back, per K/V tile
    assert _quoted(r"pays ([\d.]+) per score", prose) == per_row / block_n
    n = ns["N"]
    assert iomodel.fa1_io(n, n, d, block_m, block_n).total == fa1.reads + fa1.writes
    break_even = per_row / 8  # standard attention: about 8 elements per score (section 1)
    quoted_rows = _quoted(r"about \*\*(\d+)\*\* rows", prose)
    assert quoted_rows == math.ceil(break_even)
    below, above = math.floor(break_even) - 4, math.ceil(break_even) + 7
    assert iomodel.fa1_io(n, n, d, block_m, below).total > std_total > \
        iomodel.fa1_io(n, n, d, block_m, above).total
    assert _quoted(r"`d·\(3d \+ 4\)/2` = \*\*([\d,]+)\*\*", prose) == d * per_row / 2

    # a real SRAM: the A100's M from section 7, its rule's B_c, FA1 against standard at N = 4,096
    sram = ns["sram"]
    assert _quoted(r"A100's `M = ([\d,]+)`", prose) == sram
    b_r, b_c = iomodel.block_sizes(sram, d)
    assert _quoted(r"`B_c = (\d+)`", prose) == b_c
    big = _quoted(r"at N = ([\d,]+)\.", prose)
    gain = iomodel.standard_io(int(big), int(big), d).total / iomodel.fa1_io(int(big), int(big), d, b_r, b_c).total
    assert _quoted(r"moves \*\*(\d+)×\*\* less", prose) == round(gain)


# ------------------------------------------------------------------ chapter 01: matrices at peak

CH01 = "01_naive_attention"


@pytest.mark.ch01
def test_ch01_prose_counts_the_matrices_alive_at_peak_in_both_paths(capsys):
    """The text said "three" N×N matrices at peak, but a learner who skipped Exercise 1.1 measures
    the library's float64 oracle, which shows about 6 float32-sized ones: measured here with the
    notebook's own cells, for the solution and for what the learner notebook goes on with."""
    solution_nb, learner_nb = _notebook(CH01), _notebook(CH01, NOTEBOOKS)
    ns = _run_cells(solution_nb, "d7d8e15e", "9d7b5df9", "ade3456b")  # imports, 1.1, the meter
    solution = ns["attention_numpy"]
    learner = _run_cells(learner_nb, "d7d8e15e", "9d7b5df9", "3f8ac832")  # the stub, its check
    assert "not done yet" in capsys.readouterr().out
    fallback = learner["attention_numpy"]
    assert fallback.__module__.startswith("course_lib")

    from course_lib.attention import costmodel

    # the CPU branch of the measuring cell (8bd7656d): float32, one head, its largest N
    measuring = _cell(solution_nb, "8bd7656d")
    cpu_seq_lens = re.search(r"np\.float32, 1, \(([\d_, ]+)\)", measuring)
    n = max(int(x.replace("_", "")) for x in cpu_seq_lens.group(1).split(","))
    head_dim = ns["HEAD_DIM"] if "HEAD_DIM" in ns else 64
    q, k, v = (np.random.default_rng(i).standard_normal((1, n, head_dim)).astype(np.float32)
               for i in range(3))
    one = costmodel.attention_memory(n, head_dim, np.float32, heads=1).score_bytes
    alive = {name: ns["peak_bytes_numpy"](fn, q, k, v) / one
             for name, fn in (("solution", solution), ("skipped", fallback))}
    print(f"N×N matrices alive at peak, N = {n}: {alive}")
    prose = _cell(solution_nb, "91c47aa9")
    assert _quoted(r"\*\*(\d+)\*\* on CPU for the solution", prose) == round(alive["solution"])
    assert _quoted(r"\*\*(\d+)\*\* for the library's float64 oracle", prose) == round(alive["skipped"])
    before = _cell(solution_nb, "5bdddd69")
    assert _quoted(r"settles near \*\*(\d+)\*\*", before) == round(alive["skipped"])
    assert round(alive["solution"]) == 3 and "— three." in before


# ------------------------------------------------------------------ the reading, named

READING_NAMES = ("the memory-wall article", "the CS 229s notes", "Dremov's Triton walkthrough",
                 "the Unboxing LLMs article", "the paper notes")
# how a mention may name its article in running text ("the CS 229s notes' example", "The article")
MENTION_NAMES = ("memory-wall article", "CS 229s notes", "Dremov", "Unboxing LLMs", "paper notes",
                 "The article", "the article", "the notes", "The notes", "The articles'")


@pytest.mark.ch00
def test_the_reading_is_named_in_chapter_00():
    roadmap = "\n".join(_source(c) for c in _notebook("00_setup_and_roadmap")["cells"]
                        if c["cell_type"] == "markdown")
    section = roadmap[roadmap.index("## Reading"):]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 5, rows
    assert [row.split("|")[1].strip() for row in rows] == list(READING_NAMES)
    for title in ("Attention Optimization: From Memory Walls to Flash Attention",
                  "Understanding Flash Attention: Writing the Algorithm from Scratch in Triton",
                  "FlashAttention: Revolutionizing Transformer Efficiency", "Alex Dremov",
                  "FlashAttention & Efficient Attention", "CS 229s"):
        assert title in section


def _reading_mentions():
    """(notebook, paragraph) for every markdown paragraph that cites "the reading"."""
    for path in sorted(SOLUTIONS.glob("*.ipynb")):
        if path.name.startswith("00_"):
            continue
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] != "markdown":
                continue
            for paragraph in re.split(r"\n\s*\n", _source(cell)):
                if re.search(r"\b(the reading|reading's)\b", paragraph, re.I):
                    yield path.name, paragraph


def test_every_mention_of_the_reading_names_its_article():
    mentions = list(_reading_mentions())
    unnamed = [f"{name}: {p[:100]!r}" for name, p in mentions
               if not any(m in p for m in MENTION_NAMES)]
    assert not unnamed, "mentions of the reading that name no article:\n" + "\n".join(unnamed)
    named = sum(1 for path in SOLUTIONS.glob("*.ipynb") for c in json.loads(path.read_text())["cells"]
                if c["cell_type"] == "markdown" and any(m in _source(c) for m in MENTION_NAMES[:5]))
    assert named >= 15  # the articles are cited by name across the chapters


# ------------------------------------------------------------------ chapter 00: roadmap, NBVAL


def _markdown_table(text: str, header_start: str) -> list[list[str]]:
    lines = text[text.index(header_start):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.ch00
def test_roadmap_lists_every_chapter_like_the_readme():
    nb = _notebook("00_setup_and_roadmap")
    roadmap = _markdown_table(_cell(nb, "6ea8cf29"), "| # | chapter |")
    readme = _markdown_table((ROOT / "README.md").read_text(encoding="utf-8"), "| # | notebook |")
    listed = {row[0]: row for row in roadmap}
    chapters = sorted(p.name[:2] for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if p.name[:2] != "00")
    assert chapters and set(chapters) <= set(listed), f"roadmap lacks {set(chapters) - set(listed)}"
    for row in readme:
        if row[0] == "00":
            continue
        assert row[0] in listed, f"README's chapter {row[0]} is not in the roadmap"
        assert listed[row[0]][3] == row[3], f"chapter {row[0]}: roadmap plays with " \
            f"{listed[row[0]][3]!r}, README {row[3]!r}"
        assert "coming" not in listed[row[0]][1]
    for number, words in (("10", "masks as tile rules"), ("11", "beyond one GPU")):
        assert number in listed and words in listed[number][1]


@pytest.mark.ch00
def test_nbval_markers_are_explained_where_first_met():
    cells = _notebook("00_setup_and_roadmap", NOTEBOOKS)["cells"]
    first = next(i for i, c in enumerate(cells) if c["cell_type"] == "code" and "# NBVAL_" in _source(c))
    before = _source(cells[first - 1])
    assert cells[first - 1]["cell_type"] == "markdown"
    for words in ("NBVAL_IGNORE_OUTPUT", "NBVAL_CHECK_OUTPUT", "test runner", "ignore them"):
        assert words in before


# ------------------------------------------------------------------ chapter 06: benchmark plot

@pytest.mark.ch06
@pytest.mark.parametrize("pass_", ["fwd", "fwd+bwd"])
def test_benchmark_plot_is_readable_at_notebook_width(pass_):
    """It was 16 inches wide (shown at ~55% in a notebook: ~6 px text) with the legend over the
    lines of the first panel."""
    from course_lib.measure import bench

    fig = bench.plot(bench.load_recorded("h100"), pass_)
    fig.canvas.draw()
    width, _ = fig.get_size_inches()
    assert width * fig.dpi <= 950  # JupyterLab shows it at its natural size: no shrinking
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip() and t.get_visible()]
    small = {t.get_text(): t.get_fontsize() for t in texts if t.get_fontsize() < 10}
    assert not small, f"text under 10 pt: {small}"
    assert not any(ax.get_legend() for ax in fig.axes), "a legend inside a panel hides lines"
    assert len(fig.legends) == 1
    renderer = fig.canvas.get_renderer()
    legend_box = fig.legends[0].get_window_extent(renderer)
    for ax in fig.axes:
        if ax.get_visible():
            assert not legend_box.overlaps(ax.get_window_extent(renderer)), "legend over a panel"
    assert legend_box.y1 < min(ax.get_window_extent(renderer).y0 for ax in fig.axes if ax.get_visible())
