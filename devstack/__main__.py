"""`python -m devstack up|down|status` (what scripts/stack runs)."""

import sys

from devstack.cli import main

sys.exit(main())
