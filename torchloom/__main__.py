"""`python -m torchloom ...` (what torchrun launches) is the `torchloom` command."""

import os
import sys

from torchloom.cli import main
from torchloom.parallel import leave

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    leave(code)  # a torchrun rank skips the interpreter's teardown, where gloo can abort it
sys.exit(code)
