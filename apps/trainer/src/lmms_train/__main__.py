"""`python -m lmms_train CONFIG.yaml ...` (what torchrun launches)."""

import sys

from lmms_train.cli import main

if __name__ == "__main__":
    sys.exit(main())
