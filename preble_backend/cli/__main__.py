"""``python -m preble_backend.cli``."""

import sys

from preble_backend.cli import main

sys.exit(main())
