"""``python -m lab2_trainer.cli``: the same as ``lab2-train`` (what ``torchrun -m`` runs)."""

import sys

from lab2_trainer.cli.main import main

sys.exit(main())
