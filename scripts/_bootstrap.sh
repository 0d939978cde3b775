# Sourced by scripts/test and scripts/demo: make ./.venv with kvstream installed (idempotent).
# Usage: . scripts/_bootstrap.sh EXTRAS    (e.g. "dev" or "all")
set -euo pipefail
_extras=${1:-all}
PY=${PYTHON:-python3}
VENV=${KVSTREAM_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# torch only where it is used (the cache's tensor storage: the `cache` extra, and `dev` for the
# test suite); the demo runs the cache metadata-only and needs none. Installed first, pinned to
# the CPU build these machines carry, so the project's torch range is already satisfied and pip
# does not pull a multi-GB CUDA build.
case ",$_extras," in
  *,dev,* | *,cache,*)
    if ! python -c "import torch" 2>/dev/null; then
      echo "== installing torch (CPU)"
      python -m pip install -q "torch==${KVSTREAM_TORCH_VERSION:-2.13.0}"
    fi
    ;;
esac
# Installed before with these extras, and neither pyproject.toml nor a C source changed since:
# the editable install is current (Python edits need no reinstall), so a second run starts at
# once.
_stamp="$VENV/.kvstream-installed-$_extras"
_want=$(find kvstream -name '*.[ch]' | LC_ALL=C sort | xargs cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$_stamp" ] && [ "$(cat "$_stamp")" = "$_want" ] && python -c "import kvstream" 2>/dev/null; then
  echo "== kvstream[$_extras] is installed (pyproject.toml and C sources unchanged)"
else
  python -m pip install -q --upgrade pip
  echo "== installing kvstream[$_extras]"
  python -m pip install -q -e ".[$_extras]"
  echo "$_want" > "$_stamp"
fi
