import os

# No test may reach a network: Hugging Face lookups answer from the local cache or fail at once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
