"""The artifact's files: ONNX external data read and written through one buffer (``datafile``), weights shared
between graphs (``shared_data``), where the draft's embedding table lies (``embedding_table``), the lean export that
streams a big checkpoint into the data file (``lean``), and the output folder's lock and atomic rename
(``out_dir``)."""
