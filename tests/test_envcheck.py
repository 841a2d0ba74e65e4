"""Chapter 00's environment report and Triton smoke test."""

import pytest

from course_lib.platform import envcheck

pytestmark = pytest.mark.ch00


def test_smoke_test_passes_on_ragged_size():
    assert envcheck.triton_smoke_test(n=1000) < 1e-5


def test_smoke_test_detects_unwritten_output(monkeypatch):
    # A kernel that "runs" but writes nothing must be caught, not reported as a pass.
    class _Silent:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(envcheck, "_smoke_kernel", lambda: _Silent())
    with pytest.raises(RuntimeError, match="unwritten"):
        envcheck.triton_smoke_test(n=300)


def test_environment_report_has_versions():
    report = envcheck.environment_report()
    for key in ("mode", "device", "python", "torch", "triton", "numpy"):
        assert key in report
    assert report["torch"].startswith("2.")
