"""``python -m server``: the ``softmoe`` command, where the console script is not on PATH."""

from server.main import main

main()
