#!/bin/bash
# The ignored folders a device call carries (run on this machine, which reaches PyPI):
#   .whl/        jax-triton 0.3.1, tokamax 0.0.17 and what it imports that the GPU image lacks,
#                fastapi/starlette/uvicorn for the server;
#   .whl/stub/   a stand-in for xprof (22 MB), which tokamax imports at import time for its own
#                benchmarking only;
#   .peer/       ../shared/peer without its wheels (LMDeploy's side and make_random_sdar.py).
#     bash scripts/device/wheels.sh && run(command=..., carry=[".whl", ".peer", ...])
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl/stub/xprof/cli .peer
PYENV_VERSION=${PYENV_VERSION:-3.12.1} python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d .whl jax-triton==0.3.1 tokamax==0.0.17 qwix==0.1.8 einshape immutabledict \
    pydantic pydantic-core annotated-types typing-inspection fastapi starlette uvicorn h11 click \
    annotated-doc
touch .whl/stub/xprof/__init__.py .whl/stub/xprof/cli/__init__.py
cat > .whl/stub/xprof/cli/tools.py <<'PY'
"""A stand-in for xprof, which tokamax imports at import time (its benchmarking only)."""


def get_kernel_stats_tool(*args, **kwargs):
    raise NotImplementedError("xprof is not installed on this machine")
PY
cp -r ../shared/peer/*.py ../shared/peer/README.md ../shared/peer/sdar_tokenizer .peer/
du -sh .whl .peer
