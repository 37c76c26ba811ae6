"""Load tests for softmoe-serve: locustfiles, a stepped load shape, and a sweep runner.

- ``loadtests/locustfile.py``: every endpoint mixed (``LOADTEST_ENDPOINTS``), stepped shape;
  ``loadtests/locustfiles/{classify,embed,zero_shot,oip}.py``: one endpoint each.
- ``python -m loadtests.run``: a headless sweep over user counts with a CSV and PNG report.

Images are generated in memory at start-up (scikit-learn's digits and sample photos), so the
repository holds no image files. See ``loadtests/README.md``.
"""
