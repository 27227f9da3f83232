"""kvpress's presses on the passkey prompts of lcx's one-shot ablation
(``experiments/configs/smollm2_passkey_compression.yaml``: 8 prompts of 2,048 tokens): ``kvpress_eval.py`` on that
config, with the checkpoint given on the command line. Tables in ``runs/smollm2_passkey_compression_kvpress``.

Usage::

    python experiments/kvpress_passkey.py runs/models/SmolLM2-135M-Instruct --ratios 0.5 0.75 [--presses kvzip ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import kvpress_eval  # noqa: E402

CONFIG = Path(__file__).parent / "configs" / "smollm2_passkey_compression.yaml"

if __name__ == "__main__":
    model, *rest = sys.argv[1:] or ["--help"]
    kvpress_eval.main([str(CONFIG), f"checkpoint={model}", *rest] if not model.startswith("-") else [model, *rest])
