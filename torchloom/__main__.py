"""`python -m torchloom ...` (what torchrun launches) is the `torchloom` command."""

import sys

from torchloom.cli import main

sys.exit(main())
