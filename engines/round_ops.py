"""Operators appended to the engines' source graphs so that a greedy round needs one host read (issue 37).

On a GPU every host read of a round waits for the device. With the tree engine a round read twice (the verify's
argmax and the tree's candidates) and selected the verify tree and walked the acceptance on the host. These two
appendices move both steps into the engines, so the host reads once, the accepted path:

- ``append_selection`` (the draft tree graph cut to its depth): the ``select`` best candidates by cumulative score,
  ties to the lower index (a parent, which scores at least as high as its children and is generated before them,
  comes first; the same set ``TreeGrower.select`` takes without a threshold), ranked by comparing every pair so that
  no TopK's order of equal values decides it, their tokens,
  their depths, and the ancestor-or-self mask among them (each candidate's ancestors found by following
  ``tree_parents`` ``depth`` times). The round's verify inputs are made from these on the device.
- ``append_acceptance`` (the standard target graph): the greedy acceptance of the call's logit rows as a tree, from
  the inputs that describe it: a row's depth is its position less the first row's, a row's parent the row among
  those it attends to one level up. A row is accepted when every ancestor's token (and its own) is the argmax of its
  parent row; the accepted path ends at the deepest accepted row (the root, row 0, always). Outputs: every row's
  argmax (``next_ids``: the accepted tokens are the argmax of their parents, the bonus the last path row's), the
  number of accepted draft tokens and the path's rows, root first.

Both are pure ONNX (standard operators, opset 17), appended by ``build`` to the sources of the engines it makes and
by the emulator to the graphs it runs in their place; ONNX Runtime's own graphs do not carry them (on its CPU
provider some fifty small nodes cost more than the host's walk: docs/engines.md).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from eagle_export import contract as C

PREFIX = "/round_ops"


class _Builder:
    """Appends nodes and constants to a graph under one name prefix."""

    def __init__(self, g: onnx.GraphProto, what: str):
        self.g, self.p, self.count = g, f"{PREFIX}/{what}", 0

    def const(self, name: str, values, dtype=np.int64) -> str:
        full = f"{self.p}/{name}"
        self.g.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), full))
        return full

    def node(self, op: str, inputs: list[str], out: str | None = None, outputs: int = 1, **attrs):
        self.count += 1
        names = [out] if out is not None else [f"{self.p}/{op}_{self.count}_{i}" for i in range(outputs)]
        self.g.node.append(helper.make_node(op, inputs, names, name=f"{self.p}/{op}_{self.count}", **attrs))
        return names[0] if outputs == 1 else names

    def output(self, name: str, elem_type: int, shape: list) -> None:
        self.g.output.append(helper.make_tensor_value_info(name, elem_type, shape))


def candidate_levels(top_k: int, depth: int) -> list[int]:
    """Each candidate's level (1: the root's children) in the tree graph's generation order (``TreeGrower``)."""
    return [1] * top_k + [level for level in range(2, depth + 2) for _ in range(top_k * top_k)]


def append_selection(model: onnx.ModelProto, top_k: int, depth: int, select: int) -> onnx.ModelProto:
    """``model`` (a draft tree graph cut to ``depth`` levels of ``top_k``) with the ``select`` best candidates as
    outputs: ``C.SELECT_TOKENS`` and ``C.SELECT_DEPTHS`` [batch, select] and ``C.SELECT_MASK`` [batch, select,
    select] (row i attends to column j: j is i or one of its ancestors). In place; returns it."""
    n = top_k + depth * top_k * top_k
    if not 1 <= select <= n:
        raise ValueError(f"cannot select {select} of {n} candidates")
    b = _Builder(model.graph, "select")
    k = b.const("k", [select])
    # Each candidate's rank: the candidates ahead of it, by score, ties to the lower index (the host's stable sort).
    # TopK over the negated ranks, which are distinct, so the selection does not rest on how a TopK orders equal
    # values: ONNX says lower index first, TensorRT's ITopKLayer does not say, and a child at log-prob 0 ties its
    # parent (fp16 log-softmax rounds a confident draft's top log-prob to 0).
    earlier = np.arange(n)[None, :] < np.arange(n)[:, None]  # [i, j]: j was generated before i
    mine = b.node("Unsqueeze", [C.TREE_SCORES, b.const("ax2_s", [2])])  # [B, i, 1]
    theirs = b.node("Unsqueeze", [C.TREE_SCORES, b.const("ax1_s", [1])])  # [B, 1, j]
    ahead = b.node("Or", [b.node("Greater", [theirs, mine]),
                          b.node("And", [b.node("Equal", [theirs, mine]), b.const("earlier", earlier, np.bool_)])])
    rank = b.node("ReduceSum", [b.node("Cast", [ahead], to=TensorProto.FLOAT), b.const("ax2_r", [2])], keepdims=0)
    _, idx = b.node("TopK", [b.node("Neg", [rank]), k], outputs=2, axis=1, largest=1, sorted=1)
    b.node("GatherElements", [C.TREE_TOKENS, idx], C.SELECT_TOKENS, axis=1)
    b.node("Gather", [b.const("levels", candidate_levels(top_k, depth)), idx], C.SELECT_DEPTHS, axis=0)
    # parents with the root's -1 sent to a sentinel column n, whose parent is n again: a walk stays there
    neg = b.node("Less", [C.TREE_PARENTS, b.const("zero", 0)])
    parents = b.node("Where", [neg, b.const("sentinel", n), C.TREE_PARENTS])
    batch_by_one = b.node("Concat", [b.node("Shape", [C.TREE_PARENTS], start=0, end=1), b.const("one", [1])], axis=0)
    col = b.node("Expand", [b.const("sentinel_col", [[n]]), batch_by_one])  # [B, 1]
    ext = b.node("Concat", [parents, col], axis=1)  # [B, n + 1]
    cols = b.node("Unsqueeze", [idx, b.const("ax1", [1])])  # [B, 1, S]: the selected candidates as columns
    walk, mask = idx, None
    for step in range(depth + 1):  # levels 1..depth+1: a candidate has at most depth ancestors below the root
        hit = b.node("Equal", [b.node("Unsqueeze", [walk, b.const(f"ax2_{step}", [2])]), cols])  # [B, S, S]
        mask = hit if mask is None else b.node("Or", [mask, hit])
        if step < depth:
            walk = b.node("GatherElements", [ext, walk], axis=1)
    b.node("Identity", [mask], C.SELECT_MASK)
    b.output(C.SELECT_TOKENS, TensorProto.INT64, [C.BATCH, select])
    b.output(C.SELECT_DEPTHS, TensorProto.INT64, [C.BATCH, select])
    b.output(C.SELECT_MASK, TensorProto.BOOL, [C.BATCH, select, select])
    return model


def append_acceptance(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (the standard target graph) with the greedy acceptance of its logit rows as outputs:
    ``C.NEXT_IDS`` [batch, logit_rows] (each row's argmax), ``C.ACCEPT_COUNT`` [batch] (accepted draft tokens) and
    ``C.ACCEPT_ROWS`` [batch, logit_rows] (the accepted path's logit rows, root first; the rest in no order). The
    logit rows are read as a tree through the call's own inputs (module docstring); a call whose rows are not a tree
    (a prefill chunk's last row, a plain step) accepts nothing. In place; returns it."""
    b = _Builder(model.graph, "accept")
    i32, i64 = TensorProto.INT32, TensorProto.INT64
    ax1, ax2 = b.const("ax1", [1]), b.const("ax2", [2])
    one = b.const("one", 1)
    b.node("ArgMax", [C.LOGITS], C.NEXT_IDS, axis=-1, keepdims=0)
    li = b.node("Unsqueeze", [C.LOGIT_INDICES, ax2])  # [B, R, 1]
    tok = b.node("GatherND", [C.INPUT_IDS, li], batch_dims=1)  # [B, R]
    pos = b.node("GatherND", [C.POSITION_IDS, li], batch_dims=1)
    past = b.node("Sub", [b.node("Shape", [C.ATTENTION_MASK], start=2, end=3),
                          b.node("Shape", [C.INPUT_IDS], start=1, end=2)])  # [1]
    rows = b.node("GatherND", [C.ATTENTION_MASK, li], batch_dims=1)  # [B, R, total]
    cols = b.node("GatherND", [b.node("Transpose", [rows], perm=[0, 2, 1]), b.node("Add", [li, past])],
                  batch_dims=1)  # [B, R(columns), R(rows)]
    m = b.node("Transpose", [cols], perm=[0, 2, 1])  # [B, R, R]: row i attends to row j
    d = b.node("Sub", [pos, b.node("Slice", [pos, b.const("z", [0]), b.const("e", [1]), ax1])])  # depth [B, R]
    parent = b.node("And", [m, b.node("Equal", [b.node("Unsqueeze", [d, ax1]),
                                                 b.node("Unsqueeze", [b.node("Sub", [d, one]), ax2])])])
    match = b.node("Equal", [b.node("Unsqueeze", [tok, ax2]), b.node("Unsqueeze", [C.NEXT_IDS, ax1])])
    ok = b.node("ReduceMax", [b.node("Cast", [b.node("And", [parent, match])], to=i32)], axes=[2], keepdims=0)
    root = b.node("Cast", [b.node("Equal", [d, b.const("zero", 0)])], to=i32)  # row 0 (and a row alone)
    bad = b.node("Not", [b.node("Cast", [b.node("Max", [ok, root])], to=TensorProto.BOOL)])
    anybad = b.node("ReduceMax", [b.node("Cast", [b.node("And", [m, b.node("Unsqueeze", [bad, ax1])])], to=i32)],
                    axes=[2], keepdims=0)  # [B, R]: some ancestor (or the row) is not accepted
    good = b.node("Cast", [b.node("Sub", [b.const("one32", 1, np.int32), anybad])], to=i64)
    # The deepest accepted row scores highest; at depth 0 (nothing accepted) the root ties with the padding rows
    # (each its own root), so the lower row wins by the score's last digit, not by ArgMax's order of equal values
    # (TensorRT makes ArgMax a TopK, which documents none): a padding row taken for the root would be committed.
    r = b.node("Shape", [C.LOGIT_INDICES], start=1, end=2)
    r0 = b.node("Squeeze", [r, b.const("ax0", [0])])
    lower_first = b.node("Sub", [b.node("Sub", [r0, one]), b.node("Range", [b.const("zero_r", 0), r0, one])])  # R-1..0
    score = b.node("Add", [b.node("Mul", [b.node("Mul", [good, b.node("Add", [d, one])]), r]), lower_first])
    best = b.node("ArgMax", [score], axis=1, keepdims=1)  # [B, 1]
    b.node("Squeeze", [b.node("GatherElements", [d, best], axis=1), ax1], C.ACCEPT_COUNT)
    on_path = b.node("Cast", [b.node("Squeeze", [b.node("GatherND", [m, b.node("Unsqueeze", [best, ax2])],
                                                        batch_dims=1), ax1])], to=i64)  # [B, R]
    key = b.node("Mul", [on_path, b.node("Sub", [r, d])])  # path rows by depth first, the others 0
    b.node("TopK", [key, r], outputs=2, axis=1, largest=1, sorted=1)
    model.graph.node[-1].output[1] = C.ACCEPT_ROWS
    b.output(C.NEXT_IDS, i64, [C.BATCH, C.LOGIT_ROWS])
    b.output(C.ACCEPT_COUNT, i64, [C.BATCH])
    b.output(C.ACCEPT_ROWS, i64, [C.BATCH, C.LOGIT_ROWS])
    return model
