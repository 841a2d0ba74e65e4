#!/usr/bin/env bash
# Run the course's tests and every notebook (solutions/ and notebooks/) natively on a CUDA machine
# that has torch + triton but no Jupyter packages and no network (the H100 machine this project
# borrows). Bring the Jupyter/test packages as wheels in .whl/ first, from a networked machine:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 --platform any -d .whl nbval==0.11.0 ipykernel==7.4.0 \
#     ipywidgets==8.1.9 pytest==9.2.0 pytest-timeout==2.4.0 hypothesis==6.170.15 nbclient==0.11.0 \
#     nbformat==5.11.1 matplotlib==3.11.2 tqdm==4.70.1      (then delete numpy-*.whl: keep the machine's)
# Usage: tools/gpu_check.sh [OUTDIR] [extra pytest args]   (GPU_CHECK_TARGETS overrides the paths)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-/tmp/gpu-check}}"; shift || true
mkdir -p "$OUT_DIR"
SITE=/tmp/course-site
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH="$SITE:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch, triton, numpy; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__)'
} | tee "$OUT_DIR/gpu_env.txt"
# The browser and JupyterLab-server tests need JupyterLab and Chromium (CPU CI covers them); the
# pin test checks the CPU venv's versions, which this machine's image does not have.
python3 -m pytest -p no:cacheprovider \
  -o addopts="-ra --strict-markers --nbval-lax --nbval-current-env --nbval-cell-timeout=600" \
  --deselect tests/test_packaging.py::test_installed_versions_match_pins \
  --ignore tests/test_browser.py --ignore tests/test_lab.py \
  --junitxml "$OUT_DIR/junit.xml" --durations=15 "$@" ${GPU_CHECK_TARGETS:-tests solutions notebooks} 2>&1 | tee "$OUT_DIR/gpu_tests.log"
exit "${PIPESTATUS[0]}"
