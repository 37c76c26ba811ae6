"""Peer servers for the bench's ``peers`` section: the same exported ONNX graph behind LitServe
(``litserve_app``) and Ray Serve (``ray_app``), with the same batching limits, decode and
preprocess as `softmoe serve --backend onnxruntime` (``common``). Optional: ``pip install
'softmoe-serve[peers]'``; the bench skips a peer whose package does not import.
"""
