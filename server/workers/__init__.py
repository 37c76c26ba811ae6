"""The engine in a process of its own, and the front-end processes of ``--frontend-workers``
that feed it through shared memory (the process, the remote batcher, the supervisor)."""
