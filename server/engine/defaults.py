"""The models served when `softmoe serve` gets no --model: ``digits`` and ``digits-lit``.

Trained by `softmoe train-demo --out server/default_models --seed 0` (scikit-learn's bundled
digits; see softmoe_models/demo) and shipped inside the installed package, so a fresh clone
serves a real Soft MoE classifier and a real LiT zero-shot model offline.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED = Path(__file__).resolve().parents[1] / "default_models"
NAMES = ("digits", "digits-lit")


def default_packages(cache_dir: str = "") -> list[str]:
    missing = [n for n in NAMES if not (SHIPPED / n / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"shipped default model(s) {missing} not found under {SHIPPED}; "
                                f"recreate them with `softmoe train-demo --out {SHIPPED}`")
    return [f"{name}={SHIPPED / name}" for name in NAMES]
