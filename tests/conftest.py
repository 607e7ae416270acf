"""Every test runs without a saved cpu profile, whatever the machine has calibrated:
``SchedulePolicy.AUTO`` then decides without a model (the kernel-by-kernel path) unless
a test passes one.  Set before any test (and any rank it spawns) starts."""

import os
import tempfile
from pathlib import Path

os.environ["HPMOE_PROFILE"] = str(Path(tempfile.gettempdir()) / "hpmoe-tests-no-profile" / "cpu.json")
