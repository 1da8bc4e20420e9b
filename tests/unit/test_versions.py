import pytest

from recsys_dist import versions


def test_supported_set_is_installed():
    versions.check_versions()


def test_mismatch_lists_installed_and_supported(monkeypatch):
    monkeypatch.setattr(
        versions, "installed_versions", lambda: {"torch": "2.14.1", "fbgemm-gpu": "1.9.0", "torchrec": "1.8.0"}
    )
    with pytest.raises(ImportError) as e:
        versions.check_versions()
    msg = str(e.value)
    assert "torch       installed 2.14.1" in msg and "supported 2.13.0" in msg
    assert "fbgemm-gpu  installed 1.9.0" in msg and "pip install" in msg
