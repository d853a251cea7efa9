import pytest
from helpers import assert_same_drafter

from woodcock.errors import DrafterError
from woodcock.formats.detect import detect, format_named
from woodcock.loading import load_drafter, resolve_source, save_drafter
from woodcock.synthetic import random_drafter, tiny_spec


def test_detect_native(tmp_path):
    save_drafter(random_drafter(tiny_spec("dflash")), tmp_path / "d")
    assert detect(tmp_path / "d").NAME == "woodcock"
    with pytest.raises(DrafterError, match="unknown format 'gguf'; expected one of woodcock"):
        format_named("gguf")


def test_hugging_face_ids_resolve_from_the_local_cache_offline(tmp_path, monkeypatch):
    """The real huggingface_hub code path, on a cache laid out as the hub lays it out."""
    drafter = random_drafter(tiny_spec("eagle3", draft_vocab_size=30), "BF16")
    repo = tmp_path / "hub" / "models--acme--tiny-eagle"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    save_drafter(drafter, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    import huggingface_hub.constants

    # huggingface_hub reads HF_HUB_CACHE once, when first imported
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert resolve_source("acme/tiny-eagle") == snapshot
    assert_same_drafter(load_drafter("acme/tiny-eagle"), drafter)
    with pytest.raises(
        DrafterError,
        match="acme/absent: not a local directory, and fetching it as a Hugging Face repo",
    ):
        load_drafter("acme/absent")
