#!/usr/bin/env bash
# The upper end of the torch range pyproject.toml allows (CI runs the lower end, torch==2.13.0):
# a fresh virtual environment with TORCH (default: the newest release the index offers within the
# range), picofx and its test extra, then the tests that cover capture, the passes' numerics, the
# command line and the docs, on CPU. A release runs it before it widens or ships the range:
#
#     tools/check_torch_range.sh                 # the newest torch in the range
#     TORCH=2.14.1 tools/check_torch_range.sh    # one release
#
# Extra arguments go to pytest (e.g. -x, or other test files).
set -euo pipefail
cd "$(dirname "$0")/.."
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
RANGE=$(python3 -c "import re; print(re.search(r'\"torch([^\"]*)\"', open('pyproject.toml').read()).group(1))")
python3 -m venv "$SCRATCH/venv"
. "$SCRATCH/venv/bin/activate"
if [ -n "${TORCH:-}" ]; then SPEC="torch==$TORCH"; else SPEC="torch$RANGE"; fi
pip install -q "$SPEC"
pip install -q -e ".[test]"
python -c "import torch; print('torch', torch.__version__)"
export PICOFX_CACHE_DIR=$SCRATCH/picofx-cache TORCHINDUCTOR_CACHE_DIR=$SCRATCH/inductor-cache
python -m pytest -q -m "not slow" tests/test_capture.py tests/test_user_path.py tests/passes/test_fuse.py \
    tests/cli/test_first_hour.py tests/cli/test_train_checkpoints.py tests/test_docs.py "$@"
