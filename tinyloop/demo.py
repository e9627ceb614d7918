"""The bundled demo model (docs/demo_model.md): a small looped byte-level model."""
from pathlib import Path

DEMO_MODEL = Path(__file__).resolve().parent / "data" / "demo.tinyloop"


def demo_model_path():
    if not DEMO_MODEL.is_file():
        raise FileNotFoundError(f"the bundled demo model is missing from {DEMO_MODEL}")
    return str(DEMO_MODEL)
