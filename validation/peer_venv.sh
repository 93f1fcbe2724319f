#!/usr/bin/env bash
# The Python environment with current PyTorch and Hugging Face (torch, transformers,
# safetensors, tokenizers) that the interop and tokenizer tests compare dstrain against, and
# TensorBoard, whose own reader checks the event files dstrain writes.
# It lives outside the repository, so that every build and CI run on a machine shares one:
# ${DSTRAIN_PEER_VENV:-/var/tmp/dstrain-peer}. Made from PyPI with pip, the one part of the
# tests that needs the network, and only when missing, incomplete or made from other versions:
# every version comes from validation/peer-constraints.txt.
#   validation/peer_venv.sh                make it if needed, then print its python
#   validation/peer_venv.sh --check        print its python, or fail saying why it is not usable
#   validation/peer_venv.sh --run ARGS...  --check, then run its python with ARGS
set -euo pipefail

venv=${DSTRAIN_PEER_VENV:-/var/tmp/dstrain-peer}
py=$venv/bin/python
packages=(torch transformers safetensors tokenizers tensorboard)
log=$venv.install.log
constraints=$(cd "$(dirname "$0")" && pwd)/peer-constraints.txt
stamp=$venv/dstrain-peer-constraints.txt  # the constraints it was made from

usable() {
  [[ -x $py ]] && cmp -s "$constraints" "$stamp" &&
    "$py" -c "import torch, transformers, safetensors, tokenizers, tensorboard" 2>/dev/null
}

why_not() {
  echo "peer_venv: no usable venv at $venv (DSTRAIN_PEER_VENV): it needs ${packages[*]} at the versions of" \
       "$constraints." >&2
  if [[ -s $log ]]; then
    echo "peer_venv: the last attempt to make it ($log) ended with:" >&2
    tail -n 15 "$log" >&2
  else
    echo "peer_venv: make it with validation/peer_venv.sh (needs python3-venv and access to PyPI)." >&2
  fi
  exit 1
}

case "${1:-}" in
  --check)
    usable || why_not
    echo "$py"
    exit 0 ;;
  --run)
    shift
    usable || why_not
    exec "$py" "$@" ;;
  "") ;;
  *) echo "usage: $0 [--check | --run ARGS...]" >&2; exit 2 ;;
esac

# One maker at a time; a second caller waits and then finds it made.
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if usable; then
  echo "$py"
  exit 0
fi
echo "peer_venv: making $venv with ${packages[*]} from PyPI (once per machine; log in $log)" >&2
{
  [[ -x $py ]] || /usr/bin/python3 -m venv "$venv"
  "$py" -m pip install --disable-pip-version-check --progress-bar off -c "$constraints" "${packages[@]}" &&
    cp "$constraints" "$stamp"
} >"$log" 2>&1 || why_not
usable || why_not
echo "$py"
