"""numba (and cffi) stay optional: without them `import tinyloop` and the numpy backend work,
backend="auto" takes numpy and says why once, and asking for a numba backend gives a clear
error instead of an ImportError."""
import subprocess
import sys

PROBE = """
import sys
import warnings
sys.modules["numba"] = None          # any `import numba...` now raises ImportError
sys.modules["cffi"] = None
import tinyloop
from tinyloop import backend_available
from tinyloop.backends import FallbackWarning
path = sys.argv[1]
with tinyloop.Model(path, backend="numpy") as model:
    assert len(model.generate([1, 2, 3], max_tokens=2)) == 5
assert tinyloop.backend == "numpy"
reason = tinyloop.backend_info()["reason"]
assert reason.startswith("the native library is unavailable ("), reason
assert " and numba cannot be imported (" in reason and reason.endswith("; using numpy"), reason
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        with tinyloop.Model(path) as model:
            assert model.backend == "numpy" and model.runtime()["backend"] == "numpy"
assert [(w.category, str(w.message)) for w in caught] == [(FallbackWarning, "tinyloop: " + reason)]
for name in ("numba", "numba-cuda"):
    ok, why = backend_available(name)
    assert not ok and "numba cannot be imported" in why, (name, why)
    try:
        tinyloop.Model(path, backend=name)
    except RuntimeError as exc:
        assert "is not available: numba cannot be imported" in str(exc), exc
    else:
        raise AssertionError(name + " opened without numba")
assert not [m for m in sys.modules if m.startswith(("numba", "cffi")) and sys.modules[m]]
print("ok")
"""


def test_numpy_backend_works_without_numba_and_cffi(model_files, tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE, str(model_files["int8-gqa"])],
                         capture_output=True, text=True, cwd=tmp_path)  # not the source tree
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
