import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable

import pytest


@pytest.fixture
def run_in_triton_interpreter() -> Callable[[str], None]:
    """Runs a test file as a script with TRITON_INTERPRET=1 (Triton reads it when imported, so
    the kernels need a fresh process) and fails, with the script's output, unless it exits 0."""

    def run(path: str) -> None:
        if importlib.util.find_spec("triton") is None:
            if sys.platform != "linux":
                pytest.skip("Triton ships for Linux only")
            pytest.fail("Triton is not installed, so its kernels go untested: pip install "
                        "triton (or the dev extra)")  # fmt: skip
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        result = subprocess.run(
            [sys.executable, path], env=env, capture_output=True, text=True, timeout=600
        )
        print(result.stdout)
        assert result.returncode == 0, result.stdout + result.stderr

    return run
