"""`python -m pdd.launch` = `pdd serve`."""

import sys

from pdd.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
