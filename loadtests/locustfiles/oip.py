"""``POST /v2/models/{model}/infer`` (Open Inference Protocol) alone, under the stepped load shape
(``LOADTEST_STEPS``, ``LOADTEST_STEP_SECONDS``). Every served model with a ``pixel_values``
input, picked at random; the images are preprocessed client-side into FP32 NCHW tensors and sent
as Triton binary tensors (``LOADTEST_OIP_BINARY=0``: JSON ``data``).

    locust -f loadtests/locustfiles/oip.py --host http://127.0.0.1:8000 --headless --csv runs/oip

Images: 8x8 digit PNGs and PNG/JPEG photos at 64x64, 224x224 and 640x480, generated in memory
(``LOADTEST_IMAGE_SIZES``, ``LOADTEST_IMAGE_FORMATS``, ``LOADTEST_IMAGES_PER_REQUEST``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `loadtests` importable

from loadtests.shape import StepLoadShape  # noqa: E402,F401
from loadtests.users import OIPUser  # noqa: E402,F401
