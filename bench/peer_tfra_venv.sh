#!/usr/bin/env bash
# Builds the venv for the TFRA peer benchmark (bench/peer_tfra.py).
#
# TensorFlow Recommenders-Addons 0.8.1 supports no TensorFlow newer than 2.16,
# so the peer runs in its own venv: tensorflow-cpu 2.16.2 (which ships Keras 3)
# plus tf-keras 2.16.0 (the legacy Keras that TFRA needs). elastic_emb is
# installed into the same venv and runs there with Keras 3.
#
# Usage: bench/peer_tfra_venv.sh [REPO_ROOT]
#   REPO_ROOT   the elastic_emb checkout to install (default: this script's repo)
#   TFRA_VENV   where to build the venv (default: /work/tfra-venv; keep it out of the repo)
#   PYTHON      the interpreter to build it with (default: python3.11; TFRA 0.8.1 has
#               wheels for CPython 3.9-3.11 only)
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

repo_root="${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
venv="${TFRA_VENV:-/work/tfra-venv}"
python="${PYTHON:-python3.11}"

case "$(realpath -m "$venv")/" in
  "$(realpath "$repo_root")"/*)
    echo "error: TFRA_VENV=$venv is inside the repository $repo_root" >&2
    exit 2
    ;;
esac

if [[ ! -x "$venv/bin/python" ]]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
# TF 2.16 is built against NumPy 1.x.
"${pip[@]}" install -q \
  "tensorflow-cpu==2.16.2" \
  "tf-keras==2.16.0" \
  "tensorflow-recommenders-addons==0.8.1" \
  "numpy<2"
# Build elastic_emb against this venv's own packages, so pip does not swap
# TensorFlow or NumPy for newer ones while resolving build requirements. The
# build runs in a copy of the sources, leaving the checkout's build/ alone.
"${pip[@]}" install -q setuptools wheel pybind11
src="$(mktemp -d)"
trap 'rm -rf "$src"' EXIT
tar -C "$repo_root" --exclude=./build --exclude=./.git --exclude='*.so' \
  --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$src" -xf -
"${pip[@]}" install -q --no-build-isolation --force-reinstall --no-deps "$src"

# Smoke check: both stacks import, each in the Keras mode it needs.
TF_USE_LEGACY_KERAS=1 "$venv/bin/python" -c '
import tensorflow as tf, tf_keras, tensorflow_recommenders_addons as tfra
print("TFRA", tfra.__version__, "TF", tf.__version__, "tf_keras", tf_keras.__version__)
'
"$venv/bin/python" -c '
import keras, elastic_emb
print("elastic_emb with Keras", keras.__version__)
'
echo "TFRA venv ready: $venv"
