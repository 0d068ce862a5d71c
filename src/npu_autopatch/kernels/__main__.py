"""``python -m npu_autopatch.kernels [--write]``: regenerate the shipped probe verdicts (see _fingerprint).

An entry point only: the generator is a tool (tools/verdicts.py), imported when this runs.
"""

import sys

from ..tools.verdicts import main

sys.exit(main())
