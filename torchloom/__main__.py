"""`python -m torchloom ...` (what torchrun launches) is the `torchloom` command."""

import os
import sys

from torchloom.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # A rank of a torchrun job leaves without the interpreter's teardown. DTensor's caches keep
    # the device meshes alive, and the meshes their gloo groups, past destroy_process_group; at
    # teardown a gloo worker thread can then wait for the GIL, be stopped, and abort the rank
    # ("terminate called without an active exception", SIGABRT, about one run in twenty on a
    # loaded 2-core CPU) after all its work was done and written. Every file is closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
