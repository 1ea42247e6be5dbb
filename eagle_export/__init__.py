"""EAGLE speculative decoding exported to ONNX / TensorRT, and the runtime that runs it."""

__version__ = "0.1.0"
