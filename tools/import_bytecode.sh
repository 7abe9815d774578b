#!/bin/bash
# torch's (and Triton's) import in a fresh process, as this machine's Python runs it and with a bytecode
# cache, alternated over ROUNDS rounds:
#
#     bash tools/import_bytecode.sh [ROUNDS] [CACHE_DIR]
#
# A Python that has no bytecode for torch's modules (installed without compiling them, e.g. by uv
# without --compile-bytecode, and run with PYTHONDONTWRITEBYTECODE=1, as Docker images often set)
# compiles every module of torch in every fresh process. The cached rows read the bytecode that one
# warm-up process writes under CACHE_DIR (PYTHONPYCACHEPREFIX); nothing is written into site-packages.
# Prints the environment's bytecode settings, then one line per process: "none|pyc torch S triton S".
R=${1:-3}
P=${2:-/tmp/mxfp4conv-pyc}
rm -rf "$P"
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}"
python3 -c "import importlib.util, os; d = os.path.dirname(importlib.util.find_spec('torch').origin); print('torch', d, '__pycache__' if os.path.isdir(os.path.join(d, '__pycache__')) else 'no __pycache__')"
PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$P python3 -c "import torch
try:
    import triton
except ImportError:
    pass"
for r in $(seq "$R"); do
  for v in none pyc; do
    if [ $v = pyc ]; then export PYTHONPYCACHEPREFIX=$P; else unset PYTHONPYCACHEPREFIX; fi
    python3 -c "import time
t = time.perf_counter()
import torch
a = time.perf_counter() - t
try:
    import triton
    b = round(time.perf_counter() - t - a, 3)
except ImportError:
    b = None
print('$v', 'torch', round(a, 3), 'triton', b)"
  done
done
unset PYTHONPYCACHEPREFIX
rm -rf "$P"
