#!/usr/bin/env bash
# Give the perf_analyzer binary from the tritonclient wheel the two shared
# libraries it links but the wheel does not ship: libb64.so.0d and libcudart.so.12
# (needed even on CPU). They go into .cache/perf_analyzer/lib under exactly those
# names; tandem.client.bench.perf_analyzer puts that folder on LD_LIBRARY_PATH. No root.
#
#   bash scripts/install_perf_analyzer_deps.sh [--download] [PYTHON]
#
# By default each library is linked from a copy already in the venv:
# nvidia-pytriton==0.7.0 (a pinned dependency: it is the server) bundles both, from
# the same Triton 2.51 build as perf_analyzer, under auditwheel's hashed names; the
# loader resolves LD_LIBRARY_PATH entries by file name, so a link under the plain
# name is enough. --download (or a venv without those copies) fetches them instead:
# libb64 with `apt-get download libb64-0d` + `dpkg-deb -x` (needs apt lists; run
# `apt-get update` once), libcudart with `pip install nvidia-cuda-runtime-cu12`.
# Idempotent; ends by running `perf_analyzer --version` with the result.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DOWNLOAD=0
PY="$ROOT/.venv/bin/python"
for arg in "$@"; do
    case "$arg" in
        --download) DOWNLOAD=1 ;;
        -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
        *) PY="$arg" ;;
    esac
done
CACHE="$ROOT/.cache/perf_analyzer"
LIB="$CACHE/lib"
mkdir -p "$LIB"

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PA="$(dirname "$PY")/perf_analyzer"
[ -x "$PA" ] || { echo "error: no perf_analyzer at $PA; install tritonclient[all]==2.51.0 first (pip install -e .)" >&2; exit 1; }
BUNDLED="$SITE/nvidia_pytriton.libs"

# link NAME to the first existing file among the remaining arguments; false if none
link_first() {
    local name="$1"; shift
    local f
    for f in "$@"; do
        if [ -f "$f" ]; then
            ln -sfn "$f" "$LIB/$name"
            echo "$name -> $f"
            return 0
        fi
    done
    return 1
}

libb64_from_debian() {
    local deb_dir="$CACHE/deb" root="$CACHE/root"
    mkdir -p "$deb_dir"
    rm -f "$deb_dir"/libb64-0d_*.deb
    # needs no root; as root, Sandbox::User=root skips the _apt user, who cannot write here
    if ! (cd "$deb_dir" && apt-get download -q -o APT::Sandbox::User=root libb64-0d); then
        echo "error: apt-get download libb64-0d failed; run 'apt-get update' once (as root) and retry," >&2
        echo "       or install it system-wide: apt-get install libb64-0d" >&2
        return 1
    fi
    rm -rf "$root"
    dpkg-deb -x "$deb_dir"/libb64-0d_*.deb "$root"
    link_first libb64.so.0d "$root"/usr/lib/*/libb64.so.0d
}

cudart_from_pypi() {
    # 12.6: the CUDA that Triton 2.51 (and so this perf_analyzer) was built with
    "$PY" -m pip install -q "nvidia-cuda-runtime-cu12==12.6.77"
    link_first libcudart.so.12 "$SITE/nvidia/cuda_runtime/lib/libcudart.so.12"
}

if [ "$DOWNLOAD" = 1 ]; then
    libb64_from_debian
    cudart_from_pypi
else
    link_first libb64.so.0d "$BUNDLED"/libb64-*.so.0d || libb64_from_debian
    link_first libcudart.so.12 "$SITE/nvidia/cuda_runtime/lib/libcudart.so.12" \
        "$BUNDLED"/libcudart-*.so.12* || cudart_from_pypi
fi

if ! version="$(LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$PA" --version 2>&1)"; then
    echo "error: perf_analyzer still does not start with LD_LIBRARY_PATH=$LIB:" >&2
    echo "$version" >&2
    exit 1
fi
echo "$version"
