"""tools/relayout.py's rewriting of the old module names (issue 38), on small texts; the tree itself
is checked by tests/test_import_cycles.py (no old path inside course_lib) and tests/test_moved.py."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import relayout  # noqa: E402


@pytest.fixture(scope="module")
def rewriter():
    return relayout.Rewriter(relayout.load_moved())


@pytest.mark.parametrize("old, new", [
    ("from course_lib import runtime\n", "from course_lib.platform import runtime\n"),
    ("from course_lib import costmodel, hardware  # noqa\n",
     "from course_lib.attention import costmodel  # noqa\nfrom course_lib.platform import hardware\n"),
    ("from course_lib import flash_attention, checks as c\n",
     "from course_lib import flash_attention\nfrom course_lib.teaching import checks as c\n"),
    ("from course_lib.kernels import forward, sweep\n",
     "from course_lib.kernels import forward\nfrom course_lib.measure import sweep\n"),
    ("from course_lib.exercises import ch05\n", "from course_lib.teaching.exercises import ch05\n"),
    ("python -m course_lib.reach --check", "python -m course_lib.measure.reach --check"),
    ("see course_lib/ring.py and course_lib/widgets/ring.py", "see course_lib/integrations/ring.py and "
     "course_lib/teaching/widgets/ring.py"),
    ('ROOT / "course_lib" / "versions.py"', 'ROOT / "course_lib" / "platform" / "versions.py"'),
    ('code = "import x\\nfrom course_lib import checks, tiled\\n"',
     'code = "import x\\nfrom course_lib.teaching import checks\\nfrom course_lib.attention import tiled\\n"'),
    ("course_lib.ring_results.plot and course_lib.kernels.api", "course_lib.measure.ring_results.plot and "
     "course_lib.kernels.api"),
])
def test_old_names_become_new_ones(rewriter, old, new):
    assert rewriter.code(old) == new
    assert rewriter.code(new) == new  # a second run changes nothing


def test_a_parenthesised_import_keeps_its_continuation_lines_aligned(rewriter):
    old = ("from course_lib.checks import (Case, check_function,\n"
           "                               compare)\n"
           "x = (1,\n"
           "     2)\n")
    assert rewriter.code(old) == ("from course_lib.teaching.checks import (Case, check_function,\n"
                                  "                                        compare)\n"
                                  "x = (1,\n"
                                  "     2)\n")


def test_a_file_moved_deeper_points_where_it_pointed():
    text = 'ROOT = Path(__file__).resolve().parent.parent\nDATA = Path(__file__).parent / "data"\n'
    assert relayout.deeper(text, 1) == ('ROOT = Path(__file__).resolve().parent.parent.parent\n'
                                        'DATA = Path(__file__).parent.parent / "data"\n')
