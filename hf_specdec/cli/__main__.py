"""`python -m hf_specdec.cli ...`: the `hf-specdec` command (as `torchrun` and `accelerate launch` start it)."""

import sys

from hf_specdec.cli import main

if __name__ == "__main__":
    sys.exit(main())
