"""`python -m hf_specdec ...`: the `hf-specdec` command."""

import sys

from hf_specdec.cli import main

if __name__ == "__main__":
    sys.exit(main())
