"""`python -m tinyloop` runs the command line (tinyloop.cli)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
