"""The Open Inference Protocol v2 over gRPC (KServe's ``inference.GRPCInferenceService``) and the
standard ``grpc.health.v1.Health`` service, on ``--grpc-port`` beside the HTTP server."""
