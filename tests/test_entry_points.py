"""Every public entry point works from a fresh Python process, in any import order.

Triton decides interpreter-or-compiler when ``@triton.jit`` decorates a function, and
``import triton`` already decorates its own standard library (``tl.cdiv``, ``tl.max``, ...). A
script that imports triton (or a kernel module) before the course chose its mode used to fail with
"Cannot call @triton.jit'd outside of the scope of a kernel". The notebooks and the rest of the
test suite call ``runtime.setup()`` first (conftest does), which hid the failure, so each case
here runs in its own subprocess that calls nothing first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from course_lib.platform import runtime

pytestmark = [pytest.mark.ch00, pytest.mark.slow]

# What the process imports before it touches any public entry point.
IMPORT_ORDERS = {
    "course_lib only": "import course_lib",
    "triton first": "import triton, triton.language as tl\nimport torch\nimport course_lib",
    "kernel module directly": "import torch\nimport course_lib.kernels.forward\nimport course_lib",
    "checks first": "from course_lib.teaching.exercises import ch05\nimport course_lib",
    "setup first (notebooks)": ("from course_lib.platform import runtime\nruntime.setup(verbose=False)\n"
                                "import course_lib"),
}

# Every public entry point, called the way a user would; prints one JSON line of results.
ENTRY_POINTS = """
import json, math, contextlib, io
import numpy as np
import torch
import torch.nn.functional as F
from course_lib.platform import runtime
dev = runtime.current().device
torch.manual_seed(0)
res = {"mode": runtime.current().mode}

q, k, v = (torch.randn(1, 2, 77, 64, device=dev) for _ in range(3))
o = course_lib.flash_attention(q, k, v)
res["flash_attention"] = (o - F.scaled_dot_product_attention(q, k, v)).abs().max().item()

qg = q.clone().requires_grad_()
course_lib.flash_attention(qg, k, v, causal=True).sum().backward()
qr = q.clone().requires_grad_()
F.scaled_dot_product_attention(qr, k, v, is_causal=True).sum().backward()
res["backward"] = (qg.grad - qr.grad).abs().max().item()

o2, lse = course_lib.flash_attention_with_lse(q, k, v)
ref_lse = torch.logsumexp(q @ k.transpose(-1, -2) / math.sqrt(64), dim=-1)
res["lse"] = (lse - ref_lse).abs().max().item()

from course_lib.kernels import primer
x, y = torch.randn(1000, device=dev), torch.randn(1000, device=dev)
res["primer_add"] = (primer.vector_add(x, y) - (x + y)).abs().max().item()

from course_lib.teaching import checks
from course_lib.teaching.exercises import ch05
with contextlib.redirect_stdout(io.StringIO()) as out, checks.library_answers_allowed():
    ch05.check_add_kernel(primer.add_kernel)
    ch05.check_softmax_kernel(primer.softmax_kernel)
res["checks"] = out.getvalue()

from course_lib.attention import decoding
qd = np.random.default_rng(0).standard_normal((2, 4, 32))
kd = np.random.default_rng(1).standard_normal((2, 4, 300, 32))
vd = np.random.default_rng(2).standard_normal((2, 4, 300, 32))
o_split, _ = decoding.flash_decode(qd, kd, vd, splits=5)
o_ref, _ = decoding.decode_attention_reference(qd, kd, vd)
res["decoding"] = float(np.abs(o_split - o_ref).max())
print(json.dumps(res))
"""


def _run(code: str, interpret_env: str | None, timeout: int = 300):
    """Run ``code`` as a script file (the GPU compiler reads a @jit function's source file)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret_env is not None:
        env["TRITON_INTERPRET"] = interpret_env
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "script.py"
        script.write_text(code)
        return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                              timeout=timeout)


# Each import order once, each with one value of TRITON_INTERPRET, every value with more than one
# order (a fresh process costs ~5 s of make test's 2 cores; all 15 pairs cost 75 s).
ORDER_ENVS = [("course_lib only", None), ("triton first", "0"), ("kernel module directly", "1"),
              ("checks first", "0"), ("setup first (notebooks)", "1"), ("course_lib only", "1")]


@pytest.mark.parametrize("order, interpret_env", ORDER_ENVS,
                         ids=[f"{o}-{'unset' if e is None else 'exported=' + e}" for o, e in ORDER_ENVS])
def test_entry_points_from_a_fresh_process(order, interpret_env):
    code = IMPORT_ORDERS[order] + "\n" + textwrap.dedent(ENTRY_POINTS)
    out = _run(code, interpret_env)
    assert out.returncode == 0, f"import order {order!r}, TRITON_INTERPRET={interpret_env}:\n{out.stderr[-3000:]}"
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["mode"] == runtime.current().mode  # the machine decides, not the exported variable
    tol = 1e-4 if runtime.current().interpreted else 2e-2  # GPU fp32 dots may use tf32 in SDPA
    for name in ("flash_attention", "backward", "lse", "primer_add"):
        assert res[name] < tol, (name, res[name])
    assert res["decoding"] < 1e-10
    assert res["checks"].count("passed") == 2, res["checks"]


def test_the_issue_snippet_prints_a_tensor():
    # The exact snippet a new user tried in a plain script.
    out = _run("import torch, course_lib\nq = torch.randn(1, 2, 77, 64)\n"
               "print(course_lib.flash_attention(q, q, q).shape)", None)
    if runtime.current().on_gpu:
        assert out.returncode != 0 and "use CPU tensors" not in out.stderr  # CPU tensors on a GPU run:
        assert "move the tensors to 'cuda'" in out.stderr  # a named ValueError, not a Triton trace
    else:
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip() == "torch.Size([1, 2, 77, 64])"


@pytest.mark.parametrize("interpret_env", [None, "1"], ids=["unset", "exported=1"])
def test_bench_show_recorded_from_a_fresh_process(interpret_env):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret_env is not None:
        env["TRITON_INTERPRET"] = interpret_env
    out = subprocess.run([sys.executable, "-m", "course_lib.measure.bench", "--show-recorded", "h100"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "H100" in out.stdout and "course ÷ sdpa_flash: median" in out.stdout


def test_redecorating_is_idempotent_and_complete():
    """After the switch, no triton.language function is left decorated for the other mode."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrong = JITFunction if runtime.current().interpreted else InterpretedFunction
    assert runtime._redecorate_triton_language(runtime.current().interpreted) == 0
    left = [name for name, value in vars(tl).items() if type(value) is wrong]
    left += [name for name, value in vars(tl.core.tensor).items() if type(value) is wrong
             or any(type(c.cell_contents) is wrong for c in getattr(value, "__closure__", None) or ())]
    assert left == []
    assert tl.max is tl.standard.max  # one object per function


def test_every_import_order_and_interpreter_setting_is_covered():
    assert {o for o, _ in ORDER_ENVS} == set(IMPORT_ORDERS) and {e for _, e in ORDER_ENVS} == {None, "0", "1"}


def test_member_functions_work_after_the_switch():
    """``x.sum()`` and ``tl.cdiv`` inside a kernel, with triton imported before the switch."""
    code = textwrap.dedent("""
        import triton, triton.language as tl, torch
        from course_lib.platform import runtime
        rt = runtime.setup(verbose=False)

        @triton.jit
        def row_sums(X, OUT, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            for t in range(0, tl.cdiv(n, BLOCK)):
                x = tl.load(X + t * BLOCK + offs, mask=t * BLOCK + offs < n, other=0.0)
                tl.store(OUT + t, x.sum(axis=0))

        x = torch.arange(100, dtype=torch.float32, device=rt.device)
        out = torch.zeros(4, device=rt.device)
        row_sums[(1,)](x, out, 100, BLOCK=32)
        print(out.tolist())
    """)
    for env in (None, "0", "1"):
        out = _run(code, env)
        assert out.returncode == 0, (env, out.stderr[-3000:])
        assert out.stdout.split("\n")[0] == "[496.0, 1520.0, 2544.0, 390.0]", (env, out.stdout)


def test_redecorating_converts_both_ways():
    """Decorated for the wrong mode, a triton.language function is converted back (in a fresh
    process, so the suite's own triton is untouched)."""
    code = textwrap.dedent("""
        import triton, triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
        from course_lib.platform import runtime
        before = type(tl.cdiv).__name__
        n_on = runtime._redecorate_triton_language(True)
        on = (type(tl.cdiv) is InterpretedFunction  # interpreted members sit inside a wrapper
              and tl.core.tensor.sum.__closure__[0].cell_contents is tl.sum)
        n_off = runtime._redecorate_triton_language(False)
        off = (type(tl.cdiv) is JITFunction and tl.max is tl.standard.max
               and tl.core.tensor.sum is tl.sum)  # jit'd members are stored as themselves
        print(before, n_on, on, n_off, off)
    """)
    out = _run(code, "0")
    assert out.returncode == 0, out.stderr[-3000:]
    before, n_on, on, n_off, off = out.stdout.split()
    assert before == "JITFunction"
    assert int(n_on) > 20 and on == "True"
    assert int(n_off) == int(n_on) and off == "True"
