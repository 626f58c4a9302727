import sys

from sketchkv.cli import main

sys.exit(main())
