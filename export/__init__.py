"""Export model packages to ONNX and TensorRT with Soft MoE routing fused, verified on export."""
