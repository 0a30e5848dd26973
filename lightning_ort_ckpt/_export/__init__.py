"""Leaving training: ONNX and safetensors exports, consolidation, loading outside a Trainer."""
