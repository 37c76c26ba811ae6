"""Every endpoint, mixed, under the stepped load shape.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000 --headless --csv runs/mixed
    LOADTEST_STEPS=1,2,4,8 LOADTEST_STEP_SECONDS=15 LOADTEST_ENDPOINTS=classify,oip locust -f loadtests/locustfile.py ...

Each user loops over ``LOADTEST_ENDPOINTS`` (default classify, zero-shot, embed, oip). With a
shape class in the file, locust ignores ``-u``/``-r``/``-t``: the steps come from
``LOADTEST_STEPS`` / ``LOADTEST_STEP_SECONDS`` / ``LOADTEST_SPAWN_RATE``. Other settings: see
``loadtests/common.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `loadtests` importable

from loadtests.shape import StepLoadShape  # noqa: E402,F401
from loadtests.users import MixedUser  # noqa: E402,F401
