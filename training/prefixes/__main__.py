import sys

from training.prefixes.cli import main

sys.exit(main())
