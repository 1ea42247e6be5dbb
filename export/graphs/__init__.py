"""The PyTorch modules traced to ONNX, which are also the parity reference run eagerly: tree attention and its mask
(``attention``), the target verify graph (``target``), the draft heads and the draft step graph (``heads``), the
target families' layer patterns and MoE (``families``), the fused target graph for ONNX Runtime (``fused``, over the
contrib-op fusions of ``fusions``) and the draft tree graph (``draft_tree``)."""
