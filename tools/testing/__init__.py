"""Stand-ins for tests: tiny random models (tiny_models) and the TensorRT execution emulator (trt_emulator)."""
