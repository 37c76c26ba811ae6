"""``/v1/zero-shot`` alone, under the stepped load shape (``LOADTEST_STEPS``, ``LOADTEST_STEP_SECONDS``).

    locust -f loadtests/locustfiles/zero_shot.py --host http://127.0.0.1:8000 --headless --csv runs/zero_shot

Images: 8x8 digit PNGs and PNG/JPEG photos at 64x64, 224x224 and 640x480, generated in memory
(``LOADTEST_IMAGE_SIZES``, ``LOADTEST_IMAGE_FORMATS``, ``LOADTEST_IMAGES_PER_REQUEST``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `loadtests` importable

from loadtests.shape import StepLoadShape  # noqa: E402,F401
from loadtests.users import ZeroShotUser  # noqa: E402,F401
