# The course's two commands. Both set everything up on a fresh machine (a local .venv with the
# pinned packages; re-running is quick when nothing changed).
#   make lab    open the course in JupyterLab (prints the URL; needs no browser on this machine)
#   make test   run every test: unit, property, both notebook folders (nbval) and the browser test

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
MIN_PY := 3.11

.PHONY: lab test setup check-python browser notebooks clean

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
	$(PY) -m course_lib.lab

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

test: setup browser
	$(PY) -m pytest

notebooks: setup
	$(PY) -m course_lib.nbgen

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis test-artifacts
