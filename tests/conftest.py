import os

import pytest

# No test may reach a network: Hugging Face lookups answer from the local cache or fail at once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"


@pytest.fixture(autouse=True)
def _user_cache_in_a_temporary_directory(monkeypatch, tmp_path_factory):
    """What the commands keep in the user cache (latency profiles, the converted default target)
    goes to this run's temporary directory, never to the home directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))
