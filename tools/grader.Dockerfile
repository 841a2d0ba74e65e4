# A container for grading a class with `python -m course_lib.teaching.grade` (CPU, Triton's interpreter).
#
# The grader sandboxes each notebook with bubblewrap *inside* the container: the container keeps
# the class away from your machine, bubblewrap keeps each notebook away from the grader, the
# solutions and the other notebooks (see README.md, "Grading with course_lib.teaching.grade"). bubblewrap
# needs to create namespaces, which Docker's default seccomp and AppArmor profiles forbid: run with
# the two --security-opt below (or with rootless Podman, which allows them). The grader prints
# `isolation: bubblewrap ...` when it works; with --isolation bubblewrap it refuses to grade
# otherwise.
#
# Build (from the course's root folder):
#   docker build -f tools/grader.Dockerfile -t course-grader .
# Grade (submissions read-only, no network, bounded memory and processes):
#   docker run --rm --network none --memory 8g --cpus 2 --pids-limit 2048 \
#     --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
#     -v "$PWD/submissions:/submissions:ro" -v "$PWD/results:/results" \
#     course-grader /submissions --out /results --jobs 2 --isolation bubblewrap
# Podman: the same with `podman` for `docker` (rootless: the --security-opt flags are optional).
#
# Not tested in a container on the machine that wrote it (it has no Docker daemon): the grader
# and its sandbox were tested directly on Debian 12 with bubblewrap 0.8.0.
FROM python:3.11-slim-bookworm

RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap \
 && rm -rf /var/lib/apt/lists/*

# The course, read-only for everyone but root; Python and the packages are readable by all.
WORKDIR /course
COPY pyproject.toml README.md ./
COPY course_lib ./course_lib
COPY solutions ./solutions
COPY notebooks ./notebooks
# torch's CPU wheel (PyPI's Linux torch is the multi-GB CUDA build); the pins are pyproject's
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu -e '.[lab]'

ENTRYPOINT ["python", "-m", "course_lib.teaching.grade"]
