"""``python -m kvlookup`` runs the CLI."""

import sys

from kvlookup.cli import main

sys.exit(main())
