"""``python -m npu_autopatch.kernels [--write]``: regenerate the shipped probe verdicts (see _fingerprint)."""

import sys

from ._generate import main

sys.exit(main())
