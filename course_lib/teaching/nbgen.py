"""Generate the learner notebooks (``notebooks/``) from the authored ones (``solutions/``).

In a solution notebook an answer sits between two marker lines inside a code cell::

    # Exercise 3.1: the running update of online softmax
    def update(m, l, x):
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

The cell must name its exercise in a comment ``# Exercise N.M: description`` above the block.
Each block becomes ``raise NotImplementedError("Exercise N.M: description")`` at the block's
indentation, so a block's code must not dedent below its marker (an answer that spans a loop
body and the lines after the loop is two blocks, one at each indentation). Outputs, execution counts and widget state are cleared, except the text outputs of
cells marked ``# NBVAL_CHECK_OUTPUT``: those are the expected values nbval compares against.

The generator also stamps ``solutions/`` with nbgrader cell metadata (:func:`stamp_nbgrader`:
each exercise cell a solution cell, the cell calling its check an autograded test cell), so
``nbgrader generate_assignment`` accepts the solution notebooks; the learner notebooks carry the
same metadata, so nbgrader can also autograde submissions of ``notebooks/``.

Every notebook, in both folders, gets the Google Colab cell (:func:`stamp_colab`) as its first code
cell, right after the title: on Colab it installs the course from the repository named in
``pyproject.toml`` (``[project.urls] Repository``) without touching Colab's torch and triton;
elsewhere it does nothing. ``--colab-links`` prints the "Open in Colab" links for the README.

Usage::

    python -m course_lib.teaching.nbgen            # write notebooks/ from solutions/
    python -m course_lib.teaching.nbgen --check    # exit 1, naming each notebook that is out of step
    python -m course_lib.teaching.nbgen --refresh-outputs solutions/03_online_softmax.ipynb
    python -m course_lib.teaching.nbgen --colab-links     # one "Open in Colab" badge line per notebook
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
CHECK_OUTPUT = "# NBVAL_CHECK_OUTPUT"
EXERCISE_RE = re.compile(r"^\s*#\s*(Exercise\s+\d+\.\d+\s*:.*?)\s*$")
EXERCISE_ID_RE = re.compile(r"Exercise\s+(\d+\.\d+)")
CHECK_CALL_RE = re.compile(r"\b(ch\d\d\.check_\w+)\s*\(")
ROOT = Path(__file__).resolve().parent.parent.parent
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


class NotebookError(ValueError):
    """A solution notebook cannot be turned into a learner notebook; the message says where."""


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def strip_solutions(source: str, where: str) -> str:
    """Replace each BEGIN/END SOLUTION block in one cell's source by a NotImplementedError."""
    lines = source.split("\n")
    out: list[str] = []
    exercise = None
    inside = False
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        m = EXERCISE_RE.match(line)
        if m and not inside:
            exercise = re.sub(r"\s+", " ", m.group(1))
        if stripped.startswith(BEGIN):
            if inside:
                raise NotebookError(f"{where}, line {n}: nested '{BEGIN}' (the previous block "
                                    f"has no '{END}' yet)")
            if exercise is None:
                raise NotebookError(f"{where}, line {n}: '{BEGIN}' without an "
                                    f"'# Exercise N.M: description' comment above it in the cell")
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f'{indent}raise NotImplementedError({json.dumps(exercise, ensure_ascii=False)})')
            inside = True
            continue
        if stripped.startswith(END):
            if not inside:
                raise NotebookError(f"{where}, line {n}: '{END}' without a matching '{BEGIN}'")
            inside = False
            continue
        if inside and stripped and not stripped.startswith("#") and len(line) - len(line.lstrip()) < len(indent):
            # the stub (one `raise` at the marker's indentation) would stand where only part of
            # the answer belongs, and the learner would never see where the rest goes
            raise NotebookError(
                f"{where}, line {n}: the solution dedents below its '{BEGIN}' marker "
                f"({len(indent)} spaces): end the block before this line and open a second block "
                f"at this line's indentation")
        if not inside:
            out.append(line)
    if inside:
        raise NotebookError(f"{where}: '{BEGIN}' is never closed by '{END}'")
    return "\n".join(out)


def exercise_cells(nb: dict) -> list[tuple[str, int, int | None]]:
    """``(exercise, cell, check_cell)`` for each exercise cell of ``nb`` (a code cell holding a
    solution block under ``# Exercise N.M: ...``), in notebook order: ``exercise`` is ``"N.M"``,
    ``check_cell`` the index of the first code cell after it that calls a check
    (``chNN.check_...(``), or None when none does before the next exercise cell."""
    cells = nb["cells"]
    found = []
    for i, cell in enumerate(cells):
        src = _source(cell)
        if cell.get("cell_type") != "code" or BEGIN not in src:
            continue
        heads = [EXERCISE_ID_RE.search(m.group(1)) for m in map(EXERCISE_RE.match, src.split("\n")) if m]
        if not heads or not heads[0]:
            continue
        found.append([heads[0].group(1), i, None])
    for n, entry in enumerate(found):
        stop = found[n + 1][1] if n + 1 < len(found) else len(cells)
        for j in range(entry[1] + 1, stop):
            if cells[j].get("cell_type") == "code" and CHECK_CALL_RE.search(_source(cells[j])):
                entry[2] = j
                break
    return [tuple(e) for e in found]


NBGRADER_ID_RE = re.compile(r"^(exercise|check)_\d+_\d+$")


def _nbgrader(grade_id: str, *, solution: bool, grade: bool, points: float | None = None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": not solution, "schema_version": 3,
            "solution": solution, "task": False}
    if grade:
        meta["points"] = points
    return meta


def stamp_nbgrader(nb: dict) -> dict:
    """Give ``nb``'s exercise cells the cell metadata ``nbgrader generate_assignment`` needs.

    Each exercise cell (a solution block under ``# Exercise N.M:``) becomes an nbgrader solution
    cell with grade_id ``exercise_N_M``; the cell that calls its check becomes a locked,
    autograded test cell ``check_N_M`` worth 1 point (or the points an instructor already gave
    it). Other cells are left alone, except that an id of this form on a cell that is no longer
    an exercise or a check is removed. Stamping a stamped notebook changes nothing. Returns a copy.
    """
    out = copy.deepcopy(nb)
    cells = out["cells"]
    wanted: dict[int, dict] = {}
    for ex, i, check in exercise_cells(out):
        tag = ex.replace(".", "_")
        wanted[i] = _nbgrader(f"exercise_{tag}", solution=True, grade=False)
        if check is not None:
            old = cells[check].get("metadata", {}).get("nbgrader", {}).get("points")
            points = old if isinstance(old, (int, float)) and not isinstance(old, bool) and old >= 0 else 1
            wanted[check] = _nbgrader(f"check_{tag}", solution=False, grade=True, points=points)
    for i, cell in enumerate(cells):
        meta = cell.setdefault("metadata", {})
        if i in wanted:
            meta["nbgrader"] = wanted[i]
        elif NBGRADER_ID_RE.match(str(meta.get("nbgrader", {}).get("grade_id", ""))):
            del meta["nbgrader"]
    return out


COLAB_CELL_ID = "colab-install"
# The first code cell of every notebook. It runs before course_lib is importable, so it stays
# tiny: the rest is course_lib.platform.colab, installed by its first step.
COLAB_CELL = """\
# Google Colab only (elsewhere this cell does nothing): install the course beside Colab's torch and triton.
import importlib, importlib.util, subprocess, sys
REPOSITORY = {url}  # pyproject.toml's [project.urls] Repository
if "google.colab" in sys.modules:
    if importlib.util.find_spec("course_lib") is None:
        if not REPOSITORY:
            raise RuntimeError({unpublished})
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "git+" + REPOSITORY])
        importlib.invalidate_caches()
    from course_lib.platform import colab
    colab.install()   # only what is missing or too old, never torch or triton; prints one line"""
UNPUBLISHED = ("The course's repository URL is not published yet, so install it by hand: upload or "
               "clone the course folder into Colab, run `!pip install --no-deps -e <folder>`, restart "
               "the session (Runtime → Restart session) and run this cell again.")
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"


def colab_cell_source(repository: str) -> str:
    """The Colab cell's code for the course's repository URL (``""``: not published yet)."""
    if not isinstance(repository, str):
        raise TypeError(f"repository must be a str, got {type(repository).__name__}")
    return COLAB_CELL.format(url=json.dumps(repository), unpublished=json.dumps(UNPUBLISHED,
                                                                                ensure_ascii=False))


def stamp_colab(nb: dict, repository: str) -> dict:
    """Give ``nb`` the Colab cell (:func:`colab_cell_source`) as its first code cell, right after
    the title cell; an older Colab cell (found by its id) is replaced. Returns a copy."""
    out = copy.deepcopy(nb)
    cells = [c for c in out["cells"] if c.get("id") != COLAB_CELL_ID]
    at = 1 if cells and cells[0].get("cell_type") == "markdown" else 0
    cells.insert(at, {"cell_type": "code", "execution_count": None, "id": COLAB_CELL_ID,
                      "metadata": {}, "outputs": [], "source": colab_cell_source(repository)})
    out["cells"] = cells
    return out


def colab_link(repository: str, notebook: str, branch: str = "main") -> str:
    """The "Open in Colab" address of ``notebooks/<notebook>`` in a GitHub ``repository``."""
    import urllib.parse

    parts = urllib.parse.urlparse(repository.removesuffix(".git"))
    path = [p for p in parts.path.split("/") if p]
    if parts.netloc.lower() != "github.com" or len(path) != 2:
        raise ValueError(f"repository must be https://github.com/OWNER/NAME (Colab opens notebooks "
                         f"from GitHub), got {repository!r}")
    return (f"https://colab.research.google.com/github/{path[0]}/{path[1]}/blob/{branch}/"
            f"notebooks/{notebook}")


def load_notebook(path: Path) -> dict:
    """Read a notebook's JSON; a corrupt file raises NotebookError naming it."""
    try:
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotebookError(f"{path}: not a readable notebook ({exc})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise NotebookError(f"{path}: not a notebook (no 'cells' list)")
    return nb


def _text_outputs(outputs: list) -> list:
    keep = []
    for o in outputs:
        if o.get("output_type") == "stream":
            keep.append({"name": o["name"], "output_type": "stream", "text": o["text"]})
        elif o.get("output_type") in ("execute_result", "display_data") and "text/plain" in o.get("data", {}):
            entry = {"data": {"text/plain": o["data"]["text/plain"]}, "metadata": {},
                     "output_type": o["output_type"]}
            if o["output_type"] == "execute_result":
                entry["execution_count"] = None
            keep.append(entry)
    return keep


def clean_cell(cell: dict) -> dict:
    """Clear a code cell's outputs (keeping CHECK_OUTPUT cells' text) and execution count."""
    cell = copy.deepcopy(cell)
    if cell.get("cell_type") == "code":
        keep = CHECK_OUTPUT in _source(cell)
        cell["outputs"] = _text_outputs(cell.get("outputs", [])) if keep else []
        # nbval refuses stored outputs on a cell that looks never run, so a kept output keeps a
        # (normalised) execution count
        cell["execution_count"] = 1 if cell["outputs"] else None
        cell.get("metadata", {}).pop("execution", None)
    return cell


def generate(nb: dict, name: str) -> dict:
    """The learner version of solution notebook ``nb`` (``name`` is used in error messages)."""
    out = copy.deepcopy(nb)
    cells = []
    for i, cell in enumerate(out["cells"]):
        src = _source(cell)
        where = f"{name}, cell {i}"
        if cell.get("cell_type") != "code":
            if BEGIN in src or END in src:
                raise NotebookError(f"{where}: solution markers in a {cell.get('cell_type')} cell; "
                                    f"they belong in code cells")
            cells.append(cell)
            continue
        cell = clean_cell(cell)
        if BEGIN in src or END in src:
            cell["source"] = strip_solutions(src, where)
        cells.append(cell)
    out["cells"] = cells
    meta = out.setdefault("metadata", {})
    meta.pop("widgets", None)
    meta["kernelspec"] = dict(KERNELSPEC)
    return out


def dumps(nb: dict) -> str:
    """Serialise like Jupyter does (indent 1, trailing newline) so diffs stay small."""
    return json.dumps(nb, indent=1, ensure_ascii=False, sort_keys=True) + "\n"


def build(solutions: Path, notebooks: Path, check: bool = False) -> list[str]:
    """Stamp the solutions' nbgrader metadata and Colab cell and generate every learner notebook
    (with ``check``, only compare); return the out-of-step names (a solution notebook whose
    metadata, else Colab cell, was missing or stale is listed as ``solutions/NAME (nbgrader
    metadata)``, else ``(Colab cell)``)."""
    stale = []
    sources = sorted(Path(solutions).glob("*.ipynb"))
    if not sources:
        raise NotebookError(f"{solutions}: no .ipynb files found")
    expected_names = {p.name for p in sources}
    from course_lib.platform.colab import repository_url

    repository = repository_url(ROOT / "pyproject.toml")
    for path in sources:
        original = load_notebook(path)
        graded = stamp_nbgrader(original)
        stamped = stamp_colab(graded, repository)
        if original != stamped:
            stale.append(f"solutions/{path.name} "
                         + ("(nbgrader metadata)" if graded != original else "(Colab cell)"))
            if not check:
                path.write_text(dumps(stamped), encoding="utf-8")
        text = dumps(generate(stamped, path.name))
        target = Path(notebooks) / path.name
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if current != text:
            stale.append(path.name)
            if not check:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
    for extra in sorted(Path(notebooks).glob("*.ipynb")):
        if extra.name not in expected_names:
            stale.append(f"{extra.name} (has no solution notebook)")
    return stale


def refresh_outputs(path: Path, timeout: int = 600) -> None:
    """Execute a solution notebook and store only its CHECK_OUTPUT cells' text outputs."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(Path(path).parent)}}).execute()
    for i, cell in enumerate(nb.cells):
        nb.cells[i] = nbformat.from_dict(clean_cell(cell))
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    Path(path).write_text(dumps(nb), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_lib.teaching.nbgen", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only report notebooks out of step")
    parser.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks")
    parser.add_argument("--refresh-outputs", nargs="+", type=Path, metavar="NOTEBOOK",
                        help="execute these solution notebooks and store their CHECK_OUTPUT outputs")
    parser.add_argument("--colab-links", action="store_true",
                        help='print one "Open in Colab" badge line per notebook (for the README)')
    args = parser.parse_args(argv)
    if args.colab_links:
        from course_lib.platform.colab import repository_url

        repository = repository_url(ROOT / "pyproject.toml")
        if not repository:
            print("nbgen: error: pyproject.toml has no [project.urls] Repository yet: "
                  "no Colab links to make", file=sys.stderr)
            return 2
        for path in sorted(args.solutions.glob("*.ipynb")):
            print(f"[![Open In Colab]({COLAB_BADGE})]({colab_link(repository, path.name)}) `{path.stem}`")
        return 0
    try:
        if args.refresh_outputs:
            for path in args.refresh_outputs:
                refresh_outputs(path)
                print(f"refreshed {path}")
        stale = build(args.solutions, args.notebooks, check=args.check)
    except NotebookError as exc:
        print(f"nbgen: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        for name in stale:
            where = name if name.startswith("solutions/") else f"notebooks/{name}"
            print(f"out of step: {where} — run `python -m course_lib.teaching.nbgen`", file=sys.stderr)
        if not stale:
            print(f"notebooks/ is in step with solutions/")
        return 1 if stale else 0
    print(f"wrote {len(stale)} notebook(s)" + (f": {', '.join(stale)}" if stale else " (all up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
