"""Reading checkpoints: a Hub id resolved to a folder (``hub``), the target and the head loaded and checked against
each other (``loaders``), the published head formats (``formats``) and the writer libraries' readings (``readings``)."""
