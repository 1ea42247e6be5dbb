"""A draft tree graph cut to fewer levels (contract 6).

The export traces one draft tree graph per top_k, grown to the artifact's ``max_depth``
(``export/graphs/draft_tree.py``).
Its levels are unrolled in order, each from the ones before, so the first ``d`` levels of a deeper graph are a
graph of depth ``d``: ``cut`` keeps them and drops the rest, in the ONNX model, before ONNX Runtime loads it. The
graph ends as ``DraftTree.forward`` builds its outputs for this: ``tree_scores`` and ``tree_tokens`` are a Concat of
one piece per level (the root's children, then each level's children), behind depth-free Reshapes; ``tree_parents``
is an Add of a constant holding one entry per candidate and, for a top_k above 1, a Gather by a constant of a Concat
of one pick per level. ``cut`` keeps the first pieces and entries, then every node the outputs still need.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from eagle_export import contract as C

_PASS_THROUGH = ("Reshape", "Identity", "Squeeze", "Unsqueeze")


class CutError(ValueError):
    """The graph is not shaped as a draft tree graph of this contract (another export's file?)."""


def cut(model: onnx.ModelProto, top_k: int, depth: int, graph_depth: int) -> onnx.ModelProto:
    """``model`` (a draft tree graph of ``top_k`` grown ``graph_depth`` levels) cut to its first ``depth`` levels,
    in place; returns it. The outputs keep their names and ranks; ``tree_candidates`` becomes
    top_k + depth * top_k^2."""
    if not 1 <= depth <= graph_depth:
        raise CutError(f"a graph of {graph_depth} levels cannot be cut to {depth}")
    if depth == graph_depth:
        return model
    g = model.graph
    producer = {o: node for node in g.node for o in node.output}
    inits = {t.name: t for t in g.initializer}
    k, full, n = top_k, top_k + graph_depth * top_k * top_k, top_k + depth * top_k * top_k

    def source(name: str):
        node = producer.get(name)
        while node is not None and node.op_type in _PASS_THROUGH:
            node = producer.get(node.input[0])
        return node

    def constant(name: str) -> np.ndarray | None:
        if name in inits:
            return numpy_helper.to_array(inits[name])
        node = producer.get(name)
        if node is not None and node.op_type == "Constant":
            return numpy_helper.to_array(node.attribute[0].t)
        return None

    def replace(node, index: int, value: np.ndarray) -> None:
        name = f"{node.input[index]}_cut{depth}"
        g.initializer.append(numpy_helper.from_array(value, name))
        node.input[index] = name

    def expect(node, op: str, what: str):
        if node is None or node.op_type != op:
            raise CutError(f"{what} does not come from a {op} (got {None if node is None else node.op_type})")
        return node

    for out in (C.TREE_SCORES, C.TREE_TOKENS):
        cat = expect(source(out), "Concat", out)
        if len(cat.input) != graph_depth + 1:
            raise CutError(f"{out} joins {len(cat.input)} pieces, not one per level ({graph_depth + 1})")
        del cat.input[depth + 1:]
    add = expect(source(C.TREE_PARENTS), "Add", C.TREE_PARENTS)
    for i, name in enumerate(add.input):
        value = constant(name)
        if value is not None:  # one entry per candidate, along the axis that has them all
            axis = [a for a, size in enumerate(value.shape) if size == full]
            if len(axis) != 1:
                raise CutError(f"{C.TREE_PARENTS}'s constant has shape {value.shape}, not one axis of {full}")
            replace(add, i, np.take(value, np.arange(n), axis=axis[0]))
        elif k > 1:
            gather = expect(source(name), "Gather", f"{C.TREE_PARENTS}'s frontier indices")
            cols = constant(gather.input[1])
            if cols is None or cols.shape != (full,):
                raise CutError(f"{C.TREE_PARENTS}'s Gather indices are not a constant of {full} entries")
            replace(gather, 1, cols[:n])
            picks = expect(source(gather.input[0]), "Concat", f"{C.TREE_PARENTS}'s frontiers")
            if len(picks.input) != graph_depth:
                raise CutError(f"{C.TREE_PARENTS}'s frontiers join {len(picks.input)} pieces, not {graph_depth}")
            del picks.input[depth:]
    _prune(g)
    return model


def _prune(g: onnx.GraphProto) -> None:
    """Drop the nodes and initializers the outputs no longer need, and the inferred shapes of removed values."""
    producer = {o: i for i, node in enumerate(g.node) for o in node.output}
    needed: set[int] = set()
    todo = [o.name for o in g.output]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        i = producer.get(name)
        if i is not None and i not in needed:
            needed.add(i)
            todo.extend(x for x in g.node[i].input if x)
            for attr in g.node[i].attribute:  # subgraphs (none in this graph, but stay safe)
                if attr.type == onnx.AttributeProto.GRAPH:
                    todo.extend(x.name for x in attr.g.input)
    keep = [node for i, node in enumerate(g.node) if i in needed]
    del g.node[:]
    g.node.extend(keep)
    used = {x for node in keep for x in node.input} | {o.name for o in g.output}
    inits = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(inits)
    del g.value_info[:]
