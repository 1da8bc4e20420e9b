from tests.conftest import ROOT


def test_library_never_imports_pipelines_or_tests():
    for path in (ROOT / "recsys_dist").rglob("*.py"):
        text = path.read_text()
        assert "import pipelines" not in text and "from pipelines" not in text, path
        assert "from tests" not in text and "import tests" not in text, path
