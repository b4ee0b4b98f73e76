import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/multiprocess.py and tests/tiny.py


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Tokenizers and tokenized corpora built by tests go to a per-session cache."""
    os.environ["PARATRON_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
