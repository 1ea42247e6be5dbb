"""tools/lab/draft_vocab_bench: both step graphs export, run and are timed at a small shape, the pruned one's top-k
ids are kept ids mapped to target ids, and the program leaves nothing behind (its timings are for reading, not
asserted)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from draft_vocab_bench import export_step, level_feeds, main, make_head

from eagle_export import contract as C
from eagle_export.export.graphs.heads import prune_vocab


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_runs_at_a_small_shape_and_leaves_nothing(tmp_path, capsys, quantize):
    main(["--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "3000", "--keep",
          "500", "--rows", "1,3", "--past", "16", "--threads", "1", "--reps", "2", "--workdir", str(tmp_path),
          "--profile", "--quantize", quantize])
    out = capsys.readouterr().out
    assert "--draft-vocab 500" in out and "cut/full" in out and "kernel ms per call" in out
    # int4: the data file holds the quantized weights (under half a MiB; the float one about 1 MiB)
    full_mib = float(out.split("data ")[1].split(" MiB")[0])
    assert (full_mib < 0.5) is (quantize == "int4"), out
    assert list(tmp_path.iterdir()) == []


def test_pruned_step_graph_ranks_the_kept_rows_under_their_target_ids(tmp_path):
    """The pruned graph's top-k equals the unpruned head's logits restricted to the kept rows, ids as target ids."""
    head = make_head(64, 4, 2, 128, 3000)
    keep = torch.arange(1, 3000, 3)  # not 0..N-1: draft ids and target ids differ
    full_logits = head.lm_head.weight.detach().clone()
    prune_vocab(head, keep)
    path = tmp_path / "draft_step.onnx"
    export_step(head, path)
    feeds = level_feeds(64, 2, 16, 3, 16)
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    vals, ids, hidden = s.run([C.TOPK_LOGPROBS, C.TOPK_IDS, C.HIDDEN], feeds)
    logits = torch.from_numpy(hidden[0]) @ full_logits.T  # [rows, 3000] over the whole vocabulary
    want = torch.log_softmax(logits[:, keep], -1).topk(ids.shape[-1], -1)
    assert np.array_equal(ids[0], keep[want.indices].numpy())
    assert np.allclose(vals[0], want.values.numpy(), atol=1e-4)
