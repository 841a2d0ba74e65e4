# The course's two commands. Both set everything up on a fresh machine (a local .venv with the
# pinned packages; re-running is quick when nothing changed).
#   make lab    open the course in JupyterLab (prints the URL; needs no browser on this machine)
#   make test   run every test: unit, property, both notebook folders (solutions/ by nbval, notebooks/ by
#               tests/test_no_false_pass.py with nbval-lax's rules) and the browser test

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
MIN_PY := 3.11

.PHONY: lab test setup check-python browser sandbox notebooks clean

check-python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { \
	  echo "error: '$(PYTHON)' not found. Install Python $(MIN_PY) or newer (e.g. apt-get install python3.11 python3.11-venv)," ; \
	  echo "       or point make at one: make test PYTHON=/path/to/python3.11"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || { \
	  echo "error: $(PYTHON) is $$($(PYTHON) -c 'import platform; print(platform.python_version())'); the course needs Python $(MIN_PY) or newer."; \
	  echo "       Install it (e.g. apt-get install python3.11 python3.11-venv) and run: make test PYTHON=python3.11"; exit 1; }
	@$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || { \
	  echo "error: $(PYTHON) lacks the venv/ensurepip modules; install them (e.g. apt-get install python3-venv)"; exit 1; }

# Re-install only when the packaging changes (pip is slow even when nothing is to do).
$(STAMP): pyproject.toml | check-python
	@if test -x $(PY) && ! $(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then \
	  echo "$(VENV) was made with $$($(PY) --version 2>&1), older than Python $(MIN_PY): making it again"; rm -rf $(VENV); fi
	@test -x $(PY) || { echo "Creating $(VENV) with $$($(PYTHON) --version)"; $(PYTHON) -m venv $(VENV); }
	@echo "Installing the course and its pinned dependencies into $(VENV) (first time: a few minutes)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[lab,test]'
	@touch $(STAMP)

setup: check-python $(STAMP)

lab: setup
	$(PY) -m course_lib.platform.lab

# Debian's Chromium for the real-browser test (no downloaded browser). If it cannot be
# installed, the browser test skips and says why.
browser:
	@if ! command -v chromium >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "Installing Debian's chromium for the browser test"; \
	    (apt-get install -y -q chromium >/tmp/course-chromium-install.log 2>&1 || \
	     (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/tmp/course-chromium-install.log 2>&1)) || \
	    echo "warning: could not install chromium (see /tmp/course-chromium-install.log); the browser test will skip"; \
	  else \
	    echo "note: chromium is missing and cannot be installed here (needs apt-get as root); the browser test will skip"; \
	  fi; \
	fi

# Debian's bubblewrap, the sandbox in which course_lib.teaching.grade runs each learner notebook (the
# hostile-notebook tests need it). If it cannot be installed, those tests skip and say why.
sandbox:
	@if ! command -v bwrap >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "Installing Debian's bubblewrap for the grader's sandbox"; \
	    (apt-get install -y -q bubblewrap >/tmp/course-bubblewrap-install.log 2>&1 || \
	     (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/tmp/course-bubblewrap-install.log 2>&1)) || \
	    echo "warning: could not install bubblewrap (see /tmp/course-bubblewrap-install.log); the hostile-notebook tests will skip"; \
	  else \
	    echo "note: bubblewrap is missing and cannot be installed here (needs apt-get as root); the hostile-notebook tests will skip"; \
	  fi; \
	fi

test: setup browser sandbox
	$(PY) -m pytest

notebooks: setup
	$(PY) -m course_lib.teaching.nbgen

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis test-artifacts

# ---- make test-oldest: the oldest versions the course supports --------------------------------
# The range is written once, in course_lib/platform/versions.py (MINIMUM; also what the Colab installer
# checks). This builds .venv-oldest with its OLDEST_TESTED pins (triton 3.6, numpy 2.0,
# matplotlib 3.10, ipywidgets 7.7.1, tqdm 4.66) and the test tools at pyproject.toml's pins, and
# runs the kernels in Triton's interpreter (forward, backward, API), the widgets and notebook 00
# there. torch is the CPU wheel of the course's pin (2.13.0): PyPI's Linux torch 2.11 is the CUDA
# build (GBs); torch 2.11 + triton 3.6 run on the GPU machine, whose image has exactly those.
OLDEST_VENV  ?= .venv-oldest
OLDEST_PY    := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.installed-stamp
OLDEST_TESTS := tests/test_kernels_forward.py tests/test_kernels_backward.py tests/test_kernels_api.py \
                $(wildcard tests/test_widgets_*.py) tests/test_oldest_widgets.py \
                notebooks/00_setup_and_roadmap.ipynb
# Sets Play's `playing`, ipywidgets 8's name (7 calls it `_playing`); tests/test_oldest_widgets.py
# plays the same run through the name each version has.
OLDEST_SKIP  := --deselect tests/test_widgets_tiling.py::test_play_speed_control

.PHONY: test-oldest

$(OLDEST_STAMP): course_lib/platform/versions.py pyproject.toml | check-python
	@echo "Building $(OLDEST_VENV) with the oldest supported versions: $$($(PYTHON) course_lib/platform/versions.py --oldest)"
	rm -rf $(OLDEST_VENV)
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install --quiet --disable-pip-version-check \
	  $$($(PYTHON) course_lib/platform/versions.py --oldest) $$($(PYTHON) course_lib/platform/versions.py --test-tools)
	$(OLDEST_PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $(OLDEST_STAMP)

# -W: an old matplotlib calls pyparsing's deprecated names thousands of times; nothing to act on.
test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -m pytest -m "not slow and not gpu" -W ignore::DeprecationWarning $(OLDEST_SKIP) $(OLDEST_TESTS)

# ---- make test-newest: the newest Triton release ----------------------------------------------
# course_lib/platform/versions.py's NEWEST_TESTED Triton (3.9.0) goes into $(NEWEST_DIR) and in front of the
# pinned environment (PYTHONPATH): torch stays the pinned CPU wheel (torch 2.14/2.15 on PyPI are
# the CUDA builds, GBs). It runs the kernels in Triton's interpreter (forward, backward, API), the
# Gluon spellings and fall-back (tests/test_compat.py), the Gluon kernels cross-compiled for sm_90,
# and the library's launches cross-compiled for Blackwell (sm_100, sm_120): 191 tests, 9.9 minutes
# on a 2-core machine busy with other work (2026-11-27), plus ~10 s to install Triton the first time.
NEWEST_DIR   ?= $(VENV)/triton-newest
NEWEST_STAMP := $(NEWEST_DIR)/.installed-stamp
NEWEST_TESTS := tests/test_kernels_forward.py tests/test_kernels_backward.py tests/test_kernels_api.py \
                tests/test_compat.py tests/test_gluon_hopper.py tests/test_gluon_backward.py \
                tests/test_gluon_masked.py tests/test_reach.py::test_blackwell_targets_compile_and_fit \
                tests/test_reach.py::test_ptx_facts_show_each_generations_tensor_core_instruction

.PHONY: test-newest

$(NEWEST_STAMP): course_lib/platform/versions.py $(STAMP)
	@echo "Installing $$($(PY) course_lib/platform/versions.py --newest) into $(NEWEST_DIR), in front of $(VENV)"
	rm -rf $(NEWEST_DIR)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --target $(NEWEST_DIR) \
	  $$($(PY) course_lib/platform/versions.py --newest)
	@touch $(NEWEST_STAMP)

# TRITON_DEFAULT_FP_FUSION=1: Triton 3.9 warns that its default will change in 3.10 unless it is
# set; 1 is the default the kernels were measured with.
test-newest: setup $(NEWEST_STAMP)
	PYTHONPATH=$(abspath $(NEWEST_DIR)) TRITON_DEFAULT_FP_FUSION=1 $(PY) -m pytest -m "not slow and not gpu" $(NEWEST_TESTS)
