"""Stand-ins for tests, shipped with the package (as ``numpy.testing`` is) because ``eagle-export gpu-check`` and the
fixture recipe use them too: tiny random models built from configs (``tiny_models``) and the TensorRT execution
emulator (``trt_emulator``)."""
