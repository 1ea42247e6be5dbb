"""Weight-only block quantization: of one graph's MatMul weights (``matmuls``), and streamed over a finished export's
graphs (``artifact``, ``export --quantize``)."""
