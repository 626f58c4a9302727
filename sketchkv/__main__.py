"""`python -m sketchkv`: the same command line as the `sketchkv` script (sketchkv/cli.py)."""
import sys

from sketchkv.cli import main

sys.exit(main())
