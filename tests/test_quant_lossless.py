"""Quantized EAGLE is token-exact: on an int4/int8 export of the trained fixture, EAGLE's tokens equal the same
artifact's plain (no-draft) decoding on every fixture prompt for 128 tokens, on both target graphs the ONNX Runtime
backend runs (the fused one, and the standard one it falls back to).

Why it was not (tools/lab/results.md, "Why quantized EAGLE diverged"): MLAS computes a one-row product with its own
kernel
and a tree row's attention sums its columns where the tree put them, so a row decoded alone and the same row verified
differ in their last bits; accuracy level 4 rounds every MatMul input to int8 and grows such bits into logit
differences that flip near-ties. What makes it exact: the fused graph runs a one-row call's attention over two rows
(export/graphs/fused.py ``pad_one_row_attention``), the default tree of such an artifact is a chain
(``exact_default_tree``), and the standard graph runs the float kernel (``runtime_session_config``).

The fixture's prompts at 128 tokens reach near-ties a short check misses: before the fix, int4 diverged at token 45
of prompt 10 and int8 at tokens 54 and 98 (test_late_divergence_is_caught plants one after token 64).
"""

from __future__ import annotations

import numpy as np
import pytest

from eagle_export import contract as C
from eagle_export.export.exporter import ExportOptions, export_artifact
from eagle_export.export.quantization.artifact import QuantizeOptions, exact_default_tree
from eagle_export.manifest import load_manifest
from eagle_export.prompts import read_prompts
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.commands.bench import find_divergence
from eagle_export.tools.commands.demo import FIXTURE, fixture_tree
from eagle_export.tree_params import TreeParams

NEW_TOKENS = 128
LATE = 64  # a divergence planted after this many tokens must still be caught


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(head, bits) -> the fixture exported with that head and --quantize int<bits> (its tuned tree, which the
    export narrows to a chain), once per module."""
    root = tmp_path_factory.mktemp("quant_lossless")
    done = {}

    def get(head: str, bits: int):
        if (head, bits) not in done:
            done[head, bits] = export_artifact(
                FIXTURE / "target", FIXTURE / head, root / f"{head}-int{bits}",
                ExportOptions(max_seq_len=320, tree=fixture_tree(head), quantize=QuantizeOptions(bits=bits)),
                progress=False)
        return done[head, bits]

    return get


def divergences(rt: EagleRuntime, prompts: list[list[int]], max_new: int = NEW_TOKENS) -> list[str]:
    """For each prompt where EAGLE's tokens differ from plain decoding's: where, and no-draft's top-2 margin there."""
    out = []
    for i, ids in enumerate(prompts):
        eagle = rt.generate(prompt_ids=ids, max_new_tokens=max_new, stop_on_eos=False).tokens
        plain = rt.generate(prompt_ids=ids, max_new_tokens=max_new, use_draft=False, stop_on_eos=False).tokens
        assert len(eagle) == len(plain) == max_new
        d = find_divergence(rt, ids, eagle, plain)
        if d is not None:
            out.append(f"prompt {i}: {d.describe()}")
    return out


def fixture_prompts(rt: EagleRuntime) -> list[list[int]]:
    return [rt.encode(p.text) for p in read_prompts(FIXTURE / "prompts.jsonl")]


@pytest.mark.parametrize("head, bits", [("eagle3", 4), ("eagle1", 8)])
def test_quantized_eagle_equals_plain_decoding(quantized, head, bits):
    """Every fixture prompt, 128 tokens, EOS ignored, the artifact's default tree (a chain: the eagle3 head's tuned
    tree is 2-wide), on the fused graph and on the standard graph. Both heads and both widths, two exports (the
    other two pairs were checked by hand: tools/lab/results.md)."""
    art = quantized(head, bits)
    m = load_manifest(art)
    assert m.quantization.one_row_scratch and m.tree_defaults.top_k == 1
    for fused in (True, False):
        with EagleRuntime.open(art, threads=1, fused=fused) as rt:
            assert rt.backend.target_graph == (C.TARGET_FUSED_GRAPH if fused else C.TARGET_GRAPH)
            prompts = fixture_prompts(rt)
            found = divergences(rt, prompts)
            assert not found, f"{head} int{bits} {'fused' if fused else 'standard'} graph: " + "; ".join(found)


def test_one_row_call_is_computed_as_a_verify_row(quantized):
    """The property the fused graph's padding gives: a one-row call's logits equal, bit for bit, the same row's as
    the first of a 2-, 5- or 13-row call over the same cache (ONNX Runtime's kernels: so this also tells whether
    MatMulNBits at the artifact's settings is row-independent on this CPU). Without the padding the one-row call
    goes through MLAS's one-row SGEMM kernel in GroupQueryAttention and differs (by up to 8e-3 in int4 logits)."""
    from eagle_export.tools.commands.validate.graphs import FusedAsStandard

    art = quantized("eagle3", 4)
    m = load_manifest(art)
    t = m.target
    run = FusedAsStandard(art / m.graphs[C.TARGET_FUSED_GRAPH].file, m, threads=1)
    rng = np.random.default_rng(0)
    past_rows = 37
    ids = rng.integers(3, t.vocab_size, past_rows + 13)

    def call(tokens, start, past):
        n = len(tokens)
        mask = np.concatenate([np.ones((n, start), bool), np.tri(n, dtype=bool)], 1)
        feed = {C.INPUT_IDS: np.asarray(tokens, np.int64)[None],
                C.POSITION_IDS: np.arange(start, start + n, dtype=np.int64)[None],
                C.ATTENTION_MASK: mask[None], C.LOGIT_INDICES: np.arange(n, dtype=np.int64)[None]}
        feed.update(zip(C.past_names(t.num_layers), past, strict=True))
        out, touched = run(feed)
        assert touched == []  # a one-row call writes its scratch row and nothing else
        return out

    empty = [np.zeros((1, 0, t.kv_heads, t.head_dim), np.float32)] * (2 * t.num_layers)
    pre = call(ids[:past_rows], 0, empty)
    past = [pre[n] for n in C.present_names(t.num_layers)]
    one = call(ids[past_rows:past_rows + 1], past_rows, past)
    for n in (2, 5, 13):
        many = call(ids[past_rows:past_rows + n], past_rows, past)
        assert np.array_equal(one[C.LOGITS][0, 0], many[C.LOGITS][0, 0]), n
        assert np.array_equal(one[C.present_key(3)][0, 0], many[C.present_key(3)][0, 0]), n


def test_late_divergence_is_caught(quantized, monkeypatch):
    """A planted bug that only shows after token 64: from there on, every verify call's logits get token 0 raised,
    as a kernel that rounds wide calls differently would. The 128-token check reports the divergence, past token 64,
    with no-draft's margin; a 64-token check would have passed."""
    from eagle_export.runtime.generator import Generator

    art = quantized("eagle1", 8)
    real = Generator._run_target

    def late_bug(self, a, n, r, past, slot=0, row0=0):
        real(self, a, n, r, past, slot, row0)
        if n > 1 and past >= self._planted_from:  # verify calls only: plain decoding's are one row
            self._np["logits"][row0:row0 + r, 0] += 50.0

    with EagleRuntime.open(art, threads=1, guard=False) as rt:  # every round verifies a draft
        ids = fixture_prompts(rt)[0]
        rt.generator._planted_from = len(ids) + LATE
        monkeypatch.setattr(Generator, "_run_target", late_bug)
        assert divergences(rt, [ids], max_new=LATE) == []
        found = divergences(rt, [ids])
        assert len(found) == 1 and "no-draft top-2 logit margin" in found[0], found
        token = int(found[0].split("generated token ")[1].split()[0])
        assert LATE <= token < NEW_TOKENS and "EAGLE 0," in found[0], found


def test_default_tree_is_a_chain_where_only_chains_are_exact():
    """A quantized export at accuracy level 4 keeps a chain, and narrows a branching tree to the chain of its
    depth; at the float level 1, with --quantize-inexact-trees, or unquantized, the tree stays as given."""
    wide = TreeParams(2, 4, 8)
    assert exact_default_tree(wide, QuantizeOptions(bits=4)) == TreeParams(1, 4, 5)
    assert exact_default_tree(TreeParams(4, 3, 3), QuantizeOptions(bits=8)) == TreeParams(1, 3, 3)
    assert exact_default_tree(TreeParams(1, 6, 7), QuantizeOptions(bits=4)) == TreeParams(1, 6, 7)
    for options in (None, QuantizeOptions(bits=4, accuracy_level=1), QuantizeOptions(bits=4, inexact_trees=True)):
        assert exact_default_tree(wide, options) == wide


def test_graphs_run_at_their_accuracy_levels(quantized):
    """The fused graph's MatMulNBits carry the export's level 4, and so does the draft graphs' session; the standard
    target graph's session runs float products: int4 fused at the float level 1, int8 left as DequantizeLinear ->
    MatMul (float weights once loaded: its 8-bit float kernel is 3-5x slower)."""
    import onnx

    from eagle_export.runtime.ort_backend import OrtBackend, runtime_session_config

    level, no_qdq = "session.qdq_matmulnbits_accuracy_level", "session.disable_quant_qdq"
    for head, bits in (("eagle3", 4), ("eagle1", 8)):
        art = quantized(head, bits)
        m = load_manifest(art)
        fused = onnx.load(str(art / m.graphs[C.TARGET_FUSED_GRAPH].file), load_external_data=False)
        assert {a.i for n in fused.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
                if a.name == "accuracy_level"} == {4}
        assert runtime_session_config(m, C.DRAFT_GRAPH) == runtime_session_config(m, C.TARGET_FUSED_GRAPH) == {
            level: "4"}
        want = {level: "1"} if bits == 4 else {no_qdq: "1"}
        assert runtime_session_config(m, C.TARGET_GRAPH) == want
        be = OrtBackend(art, m, threads=1, fused=False)
        opts = be.graphs[C.TARGET_GRAPH].session.get_session_options()
        assert all(opts.get_session_config_entry(k) == v for k, v in want.items())
        assert be.graph(C.DRAFT_GRAPH).session.get_session_options().get_session_config_entry(level) == "4"
