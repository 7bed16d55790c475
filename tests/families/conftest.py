import pytest


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """A folder of 24 short English documents: calibration and evaluation text for the tiny families."""
    d = tmp_path_factory.mktemp("docs")
    for i in range(24):
        (d / f"{i}.txt").write_text(f"Section {i}. " + "The quick brown fox jumps over the lazy dog; it is late. " * (6 + i))
    return d
