# Sourced by scripts/compat.sh and scripts/compat_extras.sh, from the repository root, with VENV and PY set:
# the tests' cache and plugin settings, uv (the one on PATH, or one installed under .cache/uv-venv), and a
# fresh virtual environment at $VENV.
export RLHF_CACHE_DIR="${RLHF_CACHE_DIR:-$PWD/.cache/rlhf-compat}"
export RLHF_DISABLE_PLUGIN_AUTOLOAD=1
UV="$(command -v uv || true)"
if [ -z "$UV" ]; then
  [ -x .cache/uv-venv/bin/uv ] || { "$PY" -m venv .cache/uv-venv && .cache/uv-venv/bin/pip install --quiet uv; }
  UV=.cache/uv-venv/bin/uv
fi
rm -rf "$VENV"
"$UV" venv --quiet -p "$PY" "$VENV"
