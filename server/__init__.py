"""softmoe-serve: the serving stack, in layers (each imports only those above it in this list).

- ``settings``, ``errors``, ``metrics``, ``context``: what every layer shares.
- ``observability/``: log lines (text or JSON) and OpenTelemetry traces, for every process and door.
- ``backends/``, ``pipeline/``, ``batching/``: run a model function, decode and preprocess an image,
  batch items onto a device.
- ``engine/``: the one owner of a model's life: a package becomes a served model (backend, proofs,
  warm-up, queues, metric series) and is taken down again; the model repository and its control.
- ``workers/``: the engine in its own process, fed by the front-end processes of ``--frontend-workers``.
- ``api/``: what the protocols share: admission at the door, the request service, the Open Inference
  Protocol's tensors, the request and response schemas.
- the doors: ``http/`` (FastAPI app, routes, page), ``grpc_api/`` (OIP over gRPC), ``jobs/``
  (``softmoe eval`` / ``softmoe embed`` over datasets, no network door).
- ``run``, ``cli``, ``main``: the process and the ``softmoe`` command.
"""
