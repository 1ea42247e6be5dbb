"""Commands users run: validate, bench, tune, gpu_check, kv_layout_bench, trt_host_bench, lm_head_share_bench (the
EAGLE-1/2 draft's lm_head copied vs shared from the target's data file, measured on ONNX Runtime CPU)
(``python -m eagle_export.tools.commands.<name>``)."""
