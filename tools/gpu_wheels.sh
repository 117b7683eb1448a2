#!/bin/bash
# The wheels a lent GPU machine (its image has torch, transformers, peft, pytest...; no registry)
# needs beside them to run reroll and `make gpu-check`: reroll's other dependencies, at the
# versions this .venv has, for the image's Python 3.12 on x86-64, into .whl/ (ignored by git;
# carry it: docs/gpus.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
NAMES="tensordict pyvers pydantic pydantic_core annotated-types typing-inspection math-verify
       latex2sympy2_extended antlr4-python3-runtime gguf starlette uvicorn"
pins=$(for n in $NAMES; do echo "$n==$($PY -m pip show "$n" | sed -n 's/^Version: //p')"; done)
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> "$(git rev-parse --git-path info/exclude)"
$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl $pins
du -sh .whl
