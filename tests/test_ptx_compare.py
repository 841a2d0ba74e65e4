"""tools/ptx_compare.py's comparison, on small made-up PTX (the snapshots themselves compile for
sm_90 in a child process: about 45 s on a 2-core CPU, run by hand)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import ptx_compare  # noqa: E402

PTX = """\t.file\t1 "{path}"
.entry k() {{
\t.loc\t1 {line} 0
\tadd.s32 \t%r1, %r2, {operand};
\tret;
}}
\t.section\t.debug_info
{{
.b8 {length}
}}
"""


def _ptx(path="/a/forward.py", line=67, operand=1, length=58):
    return PTX.format(path=path, line=line, operand=operand, length=length)


def test_source_locations_are_dropped_and_instructions_kept():
    moved = _ptx(path="/a/kernels/forward.py", line=68, length=65)
    assert ptx_compare.without_source_locations(_ptx()) == ptx_compare.without_source_locations(moved)
    assert ptx_compare.without_source_locations(_ptx()) != ptx_compare.without_source_locations(_ptx(operand=2))


def test_each_kernel_is_identical_identical_but_its_source_locations_or_different():
    key = "k [('*fp16', 'D'), ('constexpr', '{h}')]{{}}"
    before = {key.format(h="a" * 64): _ptx(), "same []": _ptx(), "moved []": _ptx(), "changed []": _ptx(),
              "gone []": _ptx()}
    after = {key.format(h="b" * 64): _ptx(line=70), "same []": _ptx(), "moved []": _ptx(path="/b.py"),
             "changed []": _ptx(operand=3)}
    lines = ptx_compare.compare(before, after)
    assert lines == ["DIFFERENT  changed: the instructions differ (changed [])",
                     "DIFFERENT  gone: compiled before only (gone [])",
                     "identical but source locations  k",  # paired although its constexpr's hash differs
                     "identical but source locations  moved",
                     "identical  same"]
