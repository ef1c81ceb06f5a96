#!/usr/bin/env bash
# Fetch, here, the wheels that the GPU machine's image lacks for this project's code and its full test
# suite (that machine has no network). They land in .whl/ (git-ignored); name it in the device call's
# `carry`, and scripts/device_run.sh installs them there first. Python 3.12, x86-64 (the image's).
set -eu
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
PLATFORMS="--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any"
# Runtime: the API server, GGUF import, the console. Tests: openai client, import-linter, textual snapshots.
# The versions this project's CPU venv tests with (no resolver runs there: --no-deps, one version each).
PKGS="starlette==1.10.0 uvicorn==0.54.0 gguf==0.19.0 textual==8.2.8 platformdirs==4.14.9 mdit-py-plugins==0.7.0 \
  linkify-it-py==2.2.0 uc-micro-py==2.0.0 markdown-it-py==4.3.0 typing-extensions==4.16.0 \
  openai==3.57.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 anyio==4.16.0 \
  import-linter==2.16 grimp==3.20 pytest-textual-snapshot==1.1.0 syrupy==4.8.0 \
  llguidance==1.9.1 orjson==3.13.0 prometheus-client==0.26.0"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS -d .whl $PKGS
ls .whl | wc -l; du -sh .whl
