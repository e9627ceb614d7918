"""The files the package ships in tinyloop/data/: the demo model (docs/demo_model.md) and the
built-in GPTQ calibration text. A leaf module: the model, the CLI, the converter and the demo
all find their data here, so none of them imports another for a path."""
from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
DEMO_MODEL = DATA_DIR / "demo.tinyloop"
CALIBRATION_TEXT = DATA_DIR / "calibration.txt"


def demo_model_path() -> str:
    """The bundled demo model's path; FileNotFoundError when the install lacks it."""
    if not DEMO_MODEL.is_file():
        raise FileNotFoundError(f"the bundled demo model is missing from {DEMO_MODEL}")
    return str(DEMO_MODEL)
