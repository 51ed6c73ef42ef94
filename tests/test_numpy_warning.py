"""The main job without NumPy (its `pip install -e .` installs only torch): torch warns once on stderr, as
docs/pages/cli.md says, and the audit's output is exactly the page's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: ``import numpy`` fails in the child, as on a machine without NumPy; then the CLI runs as ``python -m packedinit``.
_CHILD = "import sys; sys.modules['numpy'] = None; from packedinit.__main__ import main; sys.exit(main(['audit']))"


def test_the_main_job_without_numpy_prints_the_page_and_only_torchs_numpy_warning() -> None:
    # Python's own warning filters, as a user's shell has them (no PYTHONWARNINGS): with "default", torch 2.6
    # on Python 3.10 also shows a ResourceWarning for the TemporaryDirectory torch.distributed.nn.jit makes at import.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"} | {"PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr[-2000:]
    page = (ROOT / "docs" / "pages" / "cli.md").read_text()
    shown = page.split("<!-- demo-output:start -->\n```text\n$ python -m packedinit audit\n", 1)[1].split("```", 1)[0]
    assert r.stdout == shown
    warnings = [line for line in r.stderr.splitlines() if "Warning" in line]
    assert len(warnings) == 1, r.stderr
    assert re.search(r"torch/.*UserWarning: Failed to initialize NumPy", warnings[0]), warnings[0]
    assert "Failed to initialize NumPy: No module named 'numpy'" in page
