"""Deprecated: `python -m spmd_rl.data inspect RUN_DIR` is `python -m spmd_rl.experience inspect RUN_DIR` (the HDF5
experience files' inspector), kept working for one release."""

from __future__ import annotations

import sys
import warnings

from spmd_rl.experience import main

if __name__ == "__main__":
    warnings.warn(
        "python -m spmd_rl.data is deprecated: use python -m spmd_rl.experience", DeprecationWarning, stacklevel=1
    )
    sys.exit(main())
