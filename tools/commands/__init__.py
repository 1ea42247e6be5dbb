"""Commands users run: validate, bench, tune, gpu_check, kv_layout_bench, trt_host_bench
(``python -m eagle_export.tools.commands.<name>``)."""
