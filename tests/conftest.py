import os

import pytest

# The test process keeps the BLAS that MLX and torch bring: tests compare bit patterns that
# another BLAS's blocking could change. Commands the tests start get the default (OpenBLAS).
_opt_out = os.environ.get("WOODCOCK_OPENBLAS")
os.environ["WOODCOCK_OPENBLAS"] = "0"
import woodcock  # noqa: E402, F401

if _opt_out is None:
    del os.environ["WOODCOCK_OPENBLAS"]
else:
    os.environ["WOODCOCK_OPENBLAS"] = _opt_out

# No test may reach a network: Hugging Face lookups answer from the local cache or fail at once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


@pytest.fixture(autouse=True)
def _user_cache_in_a_temporary_directory(monkeypatch, tmp_path_factory):
    """What the commands keep in the user cache (latency profiles, the converted default target)
    goes to this run's temporary directory, never to the home directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
