"""The generator's buffers and graph calls: every buffer of ``slots`` sequences, allocated once, and the calls that
bind views of them (``_run_target``, ``_run_draft``, ``_run_tree``).

Backend-neutral: it talks to a backend only through the ``Backend`` interface (``backend.py``). It allocates every
buffer once (caches and their new-rows scratch, output scratch, host arrays for ids, positions and masks) and passes
``BufferView``s of them to ``run``, made by address arithmetic; each call shape's fixed bindings are made once and
kept (``_io_memo``). What the calls compute a round from is the round's business (``generator.py``).
"""

from __future__ import annotations

import time
from types import MappingProxyType

import numpy as np
import torch

from eagle_export import contract as C
from eagle_export.dtypes import torch_dtype
from eagle_export.errors import GenerationError
from eagle_export.manifest import Manifest

from .backend import Backend
from .embedding import TokenEmbedding
from .kv_cache import FusedKVCache, KVCache
from .slots import LayoutPlan, Padding
from .target_kv import InPlaceTargetKV, ScratchTargetKV, TargetKV
from .views import HostScratch, RowBuffers, SplitInputs, row_runs, view_of


class GraphCalls:
    """Owns every buffer of ``slots`` sequences (allocated here, once) and makes the graph calls over them.

    step: the smallest rounding, in rows, of the cache regions' common stride (``slots.LayoutPlan``)."""

    def __init__(self, manifest: Manifest, backend: Backend, embedding: TokenEmbedding, prefill_chunk: int = 256,
                 slots: int = 1, step: int = 16):
        if not isinstance(backend, Backend):
            raise TypeError(f"{type(backend).__name__} does not implement runtime.backend.Backend")
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise GenerationError(f"max_batch must be a positive integer, got {slots!r}")
        if slots > manifest.max_batch:
            raise GenerationError(
                f"max_batch {slots} is above the artifact's batch range [1, {manifest.max_batch}]: re-export with "
                f"--max-batch {slots} or more"
            )
        self.m, self.backend, self.B = manifest, backend, slots
        self._t_draft = self._t_target = 0.0  # graph seconds of the current round
        self.embedding = embedding  # the draft's input_embeds come from it (contract version 3)
        dev = backend.device
        dtype = torch_dtype(manifest.dtype)
        zeros = backend.zeros
        t, d, lim = manifest.target, manifest.draft, manifest.tree_limits
        B = slots
        self.capacity = manifest.max_seq_len
        self.chunk = max(1, min(prefill_chunk, self.capacity))
        self.verify_rows = verify_rows = lim.max_verify_tokens
        ctx_rows = lim.max_context_rows  # a context pass after a round: accepted path + bonus
        K = lim.max_top_k
        t_rows = max(self.chunk, B * verify_rows)
        d_rows = max(self.chunk, B * max(K, ctx_rows))
        # Per slot: target features of tokens committed in rounds without a draft, until a context pass (_draft_lag)
        self._lag_rows = max(1, min(d_rows // B, max(self.chunk, ctx_rows)))
        t_slot = self.capacity + verify_rows  # rows per slot region, as a single sequence's cache
        d_slot = self.capacity + lim.max_draft_rows + lim.max_context_rows
        # The target graph this backend runs: ONNX Runtime's fused graph writes its cache in place (contract 4).
        self.tgraph = backend.target_graph
        self.fused = self.tgraph == C.TARGET_FUSED_GRAPH
        if self.fused:
            rows = manifest.graphs[self.tgraph].axes[C.CAPACITY][1]
            if rows != t_slot:
                raise GenerationError(f"the fused target graph's cache holds {rows} rows, the runtime needs {t_slot}: "
                                      "re-export")
            self.tcache = FusedKVCache(t.num_layers, t.kv_heads, t.head_dim, t_slot, dtype, B, zeros)
        else:
            self.tcache = KVCache(t.num_layers, t.kv_heads, t.head_dim, t_slot, dtype, dev, new_rows=t_rows,
                                  zeros=zeros, slots=B)
        self.dcache = KVCache(d.num_layers, d.kv_heads, d.head_dim, d_slot, dtype, dev, new_rows=d_rows, zeros=zeros,
                              slots=B)
        self.t_slot = t_slot
        # A batched call binds [A, stride] as its past, so the stride stays within the graphs' past_len range (the
        # engines' profiles are built from it). A continuing sequence never needs more (docs/runtime.md).
        t_past = manifest.graphs[C.TARGET_GRAPH].axes[C.PAST_LEN][1]
        d_past = manifest.graphs[C.DRAFT_GRAPH].axes[C.PAST_LEN][1]
        self.tplan, self.dplan = LayoutPlan(min(t_slot, t_past), step), LayoutPlan(min(d_slot, d_past), step)
        self.padding = Padding()
        bufs = {
            "logits": zeros((1, B * verify_rows, t.vocab_size), torch.float32),
            "tfeats": zeros((1, t_rows, t.feature_dim), dtype),
            "dvals": zeros((1, d_rows, K), torch.float32),
            "dids": zeros((1, d_rows, K), torch.int64),
            "dhidden": zeros((1, d_rows, d.hidden_size), dtype),
            "dembeds": zeros((1, d_rows, d.hidden_size), dtype),  # the draft's tokens' embedding rows
            "dfeats_in": zeros((1, d_rows, d.feature_dim), dtype),  # context passes
            "dhidden_in": zeros((1, B * K, d.hidden_size), dtype),  # tree levels
            "lagfeats": zeros((1, B * self._lag_rows, t.feature_dim), dtype),  # features of lagging tokens
        }
        for k, v in bufs.items():
            setattr(self, k, v)
        self._t = {k: v[0] for k, v in bufs.items()}  # [rows, ...] torch views
        self._rows = {k: RowBuffers([v]) for k, v in bufs.items()}
        self._cpu = backend.host_memory and dtype != torch.bfloat16
        # On a device the draft's embedding rows are gathered into a host array and copied without blocking
        # (``Backend.copy_from_host``; a bfloat16 table is gathered with torch, as before).
        self._embed_host = (np.empty((d_rows, d.hidden_size), dtype=np.dtype(manifest.dtype))
                            if not backend.host_memory and dtype != torch.bfloat16 else None)
        # In host memory the loop reads and fills these buffers through numpy views made here once (same memory, no
        # torch call per access). Elsewhere it reads through backend.to_host and gathers rows with torch.
        self._np = {k: v.numpy() for k, v in self._t.items()} if self._cpu else None
        # The last context row of every slot (its top-k and hidden predict the root's children): kept per slot,
        # because a joining request's prefill reuses the draft output rows between rounds.
        self.ctx_vals = np.zeros((B, K), dtype=np.float32)
        self.ctx_ids = np.zeros((B, K), dtype=np.int64)
        self.ctx_hidden = zeros((B, d.hidden_size), dtype)
        self._np_ctx_hidden = self.ctx_hidden.numpy() if self._cpu else None
        rows = max(t_rows, d_rows)
        mask_elems = max(t_rows * (t_slot + t_rows), d_rows * (d_slot + d_rows))
        self._mask = HostScratch(mask_elems, np.bool_)
        self._ids = HostScratch(rows, np.int64)
        self._pos = HostScratch(rows, np.int64)
        self._lidx = HostScratch(max(B * verify_rows, 1), np.int64)
        self._arange = np.arange(max(rows, t_slot + d_slot), dtype=np.int64)
        self._tri = np.tri(max(self.chunk, ctx_rows), dtype=np.bool_)
        self._target_names = (C.past_names(t.num_layers), C.present_names(t.num_layers))
        # The target cache's verbs, whichever layout its graph has (runtime/target_kv.py): the round steps never ask.
        self.tkv: TargetKV = (InPlaceTargetKV(self.tcache, *self._target_names) if self.fused
                    else ScratchTargetKV(self.tcache, self.tplan, *self._target_names))
        self._draft_names = (C.past_names(d.num_layers), C.present_names(d.num_layers))
        self._io_memo: dict[tuple, tuple[dict, MappingProxyType]] = {}
        # The draft tree graphs (contract 6): a round's context pass and tree levels in one call, for trees of a
        # top_k the export made a graph for (top_k -> the most levels it grows), run cut to the round's depth.
        self.xgraph = backend.tree_graph
        self.tree_depths = dict(backend.tree_depths) if self.xgraph is not None else {}
        self._fixed_depth = backend.fixed_tree_depth
        self.selects: dict[int, int] = {}
        if self.tree_depths:
            n = max(k + most * k * k for k, most in self.tree_depths.items())
            # Candidates are flat buffers: a call of n candidates over a sequences binds their first a * n entries.
            # They and the context row's top-k are parts of one block, each at a 256-byte boundary, so that on a
            # device one host read fetches what a tree call returned (``tree_output``), not one read per output.
            # A tree engine's verify tree (``Backend.tree_selects``) is in the block too.
            parts = {"scores": (np.float32, B * n), "tokens": (np.int64, B * n), "parents": (np.int64, B * n),
                     "vals": (np.float32, B * K), "ids": (np.int64, B * K)}
            self.selects = {k: v for k, v in backend.tree_selects.items() if k in self.tree_depths}
            S = max(self.selects.values(), default=0)
            if S:
                parts.update(sel_tokens=(np.int64, B * S), sel_depths=(np.int64, B * S), sel_mask=(np.bool_, B * S * S))
            self._xblock, self._x, self._x_parts = packed_block(zeros, parts)
            self._x["vals"], self._x["ids"] = self._x["vals"].view(B, K), self._x["ids"].view(B, K)
            self._x["hidden"] = zeros((B, d.hidden_size), dtype)
            self._x_host: dict | None = None  # the last tree call's block read to the host (device buffers)
            self._x_n = 0  # candidates per sequence of the last tree call
            self._last_row = HostScratch(B, np.int64)
            self._xnp = {k: v.numpy() for k, v in self._x.items()} if self._cpu else None
        self.vocab = t.vocab_size
        # The verify engine's greedy acceptance (``Backend.accepts_in_graph``), bound on every target call: each logit
        # row's argmax, and per sequence the accepted count and path rows; one block, read once (``acceptance``).
        self.in_graph_accept = backend.accepts_in_graph
        if self.in_graph_accept:
            rows = B * verify_rows
            self._accblock, self._acc, self._acc_parts = packed_block(
                zeros, {"next_ids": (np.int64, rows), "rows": (np.int64, rows), "count": (np.int64, B)})
            self._acc_host: dict | None = None  # the last target call's block on the host (read once per call)
            if self.selects:  # a device round's verify inputs, made from the tree engines' selections
                S = max(self.selects.values())
                rows = B * verify_rows
                self._dev_ids = zeros((rows,), torch.int64)
                self._dev_pos = zeros((rows,), torch.int64)
                self._dev_mask = zeros((rows * (t_slot + verify_rows),), torch.bool)
                # Per slot, its next verify tree and its context row's top-k, copied out of the tree call's outputs
                # (a later tree call, a joining request's prefill, rewrites those rows before the slot verifies).
                self._slot_sel = {"tokens": zeros((B, S), torch.int64), "depths": zeros((B, S), torch.int64),
                                  "mask": zeros((B, S, S), torch.bool)}
                self._slot_ctx_block, self._slot_ctx, self._slot_ctx_parts = packed_block(
                    zeros, {"vals": (np.float32, B * K), "ids": (np.int64, B * K)})

    def acceptance(self) -> dict[str, np.ndarray]:
        """The last target call's acceptance block on the host (one read per call, whoever asks): ``next_ids`` and
        ``rows`` [a * r] flat as bound, ``count`` [a]."""
        if self._acc_host is None:
            self._acc_host = read_block(self.backend, self._accblock, self._acc_parts)
        return self._acc_host

    # ---- host access ---------------------------------------------------------------------------
    def _rows_np(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of an output buffer as a host array (a view on the CPU)."""
        if self._np is not None:
            return self._np[name][start:stop]
        return self.backend.to_host(self._t[name][start:stop])

    def _gather(self, dst: str, dst_start: int, src: str, rows: np.ndarray) -> None:
        """Buffer ``dst`` rows [dst_start, dst_start + len(rows)) = buffer ``src`` rows ``rows``."""
        n = len(rows)
        if self._np is not None:
            if n == 1:  # a chain's parent: one row, no gather
                self._np[dst][dst_start] = self._np[src][rows[0]]
            else:
                self._np[dst][dst_start:dst_start + n] = self._np[src][rows]
        else:  # run by run: slices are device-to-device copies, where an index tensor made from host rows is a
            # blocking host-to-device copy (torch synchronises the stream after it)
            s, d = self._t[src], self._t[dst]
            for i, j, first in row_runs([int(x) for x in rows]):
                d[dst_start + i:dst_start + j].copy_(s[first:first + j - i])

    def _set_hidden_in(self, start: int, count: int, b: int) -> None:
        """``hidden_in`` rows [start, start + count) = slot b's last context hidden (a level-1 parent)."""
        if self._np is not None:
            self._np["dhidden_in"][start:start + count] = self._np_ctx_hidden[b]
        else:
            self._t["dhidden_in"][start:start + count].copy_(self.ctx_hidden[b].expand(count, -1))

    def _keep_context_row(self, b: int, row: int) -> None:
        """Slot b's context row = draft output row ``row`` (top-k and hidden)."""
        self.ctx_vals[b] = self._rows_np("dvals", row, row + 1)[0]
        self.ctx_ids[b] = self._rows_np("dids", row, row + 1)[0]
        if self._np is not None:
            self._np_ctx_hidden[b] = self._np["dhidden"][row]
        else:
            self.ctx_hidden[b].copy_(self._t["dhidden"][row])

    # ---- graph calls ---------------------------------------------------------------------------
    def _host(self, scratch: HostScratch, *shape: int):
        return scratch.view(shape)

    def _buf(self, name: str, slots: int, count: int):
        rb = self._rows[name]
        return rb.block(0, slots, count)[0]

    def _target_io(self, a: int, n: int, r: int, slot: int = 0, row0: int = 0,
                   device_inputs: bool = False) -> tuple[MappingProxyType, MappingProxyType]:
        """The target call's fixed bindings, read-only (``SplitInputs``' fixed part, and the outputs). Fused: the
        caches of slots [slot, slot + a) are inputs and outputs alike (written in place); standard: the new rows land
        in the scratch. Logits and features from output row ``row0`` on. device_inputs: ids and positions from the
        device buffers a device round fills (``Generator._verify_on_device``)."""
        key = ("t", a, n, r, self.tkv.memo_slot(slot), row0, device_inputs)
        io = self._io_memo.get(key)
        if io is None:
            ids, pos = ((self._dev_ids[:a * n].view(a, n), self._dev_pos[:a * n].view(a, n)) if device_inputs
                        else (self._host(self._ids, a, n), self._host(self._pos, a, n)))
            ins = {C.INPUT_IDS: ids, C.POSITION_IDS: pos, C.LOGIT_INDICES: self._host(self._lidx, a, r)}
            outs = {C.LOGITS: self._rows["logits"].block(row0, a, r)[0],
                    C.FEATURES: self._rows["tfeats"].block(row0, a, n)[0]}
            if self.in_graph_accept:  # a backend whose target calls all return it (TensorRT, no per-sequence calls)
                acc = self._acc
                outs.update({C.NEXT_IDS: acc["next_ids"][row0:row0 + a * r].view(a, r),
                             C.ACCEPT_ROWS: acc["rows"][row0:row0 + a * r].view(a, r),
                             C.ACCEPT_COUNT: acc["count"][:a]})
            cache_ins, cache_outs = self.tkv.bindings(slot, a, n)
            ins.update(cache_ins)
            outs.update(cache_outs)
            io = self._io_memo[key] = (MappingProxyType(ins), MappingProxyType(outs))
        return io

    def _draft_io(self, a: int, n: int, feat_rows: int) -> tuple[MappingProxyType, MappingProxyType]:
        key = ("d", a, n, feat_rows)
        io = self._io_memo.get(key)
        if io is None:
            ins = {C.INPUT_EMBEDS: self._buf("dembeds", a, n), C.POSITION_IDS: self._host(self._pos, a, n),
                   C.DRAFT_FEATURES: self._buf("dfeats_in", a, feat_rows),
                   C.HIDDEN_IN: self._buf("dhidden_in", a, n - feat_rows)}
            outs = {C.TOPK_LOGPROBS: self._buf("dvals", a, n), C.TOPK_IDS: self._buf("dids", a, n),
                    C.HIDDEN: self._buf("dhidden", a, n)}
            present = self.dcache.new_block_views(a, n)
            outs.update(zip(self._draft_names[1], present, strict=True))
            io = self._io_memo[key] = (MappingProxyType(ins), MappingProxyType(outs))
        return io

    def _tree_io(self, a: int, n: int, cand: int, k: int) -> tuple[MappingProxyType, MappingProxyType]:
        key = ("x", a, n, cand, k)
        io = self._io_memo.get(key)
        if io is None:
            x = self._x
            ins = {C.INPUT_EMBEDS: self._buf("dembeds", a, n), C.POSITION_IDS: self._host(self._pos, a, n),
                   C.DRAFT_FEATURES: self._buf("dfeats_in", a, n), C.LAST_ROW: self._host(self._last_row, a)}
            flat = {name: x[name][:a * cand].view(a, cand) for name in ("scores", "tokens", "parents")}
            outs = {C.TREE_SCORES: flat["scores"], C.TREE_TOKENS: flat["tokens"], C.TREE_PARENTS: flat["parents"],
                    C.CONTEXT_TOPK_LOGPROBS: x["vals"][:a], C.CONTEXT_TOPK_IDS: x["ids"][:a],
                    C.CONTEXT_HIDDEN: x["hidden"][:a]}
            if k in self.selects:  # the tree engine's verify tree of its top_k
                S = self.selects[k]
                outs.update({C.SELECT_TOKENS: x["sel_tokens"][:a * S].view(a, S),
                             C.SELECT_DEPTHS: x["sel_depths"][:a * S].view(a, S),
                             C.SELECT_MASK: x["sel_mask"][:a * S * S].view(a, S, S)})
            outs = {k: view_of(v) for k, v in outs.items()}
            outs.update(zip(self._draft_names[1], self.dcache.new_block_views(a, n), strict=True))
            io = self._io_memo[key] = (MappingProxyType(ins), MappingProxyType(outs))
        return io

    def _past(self, cache: KVCache, a: int, past: int, base: int = 0) -> list:
        """The past binding: one slot's rows [base, base + past), or ``a`` regions of ``past`` rows from row 0."""
        if a == 1:
            return cache.views(base, past)
        return cache.block_views(a, past)

    def _run_target(self, a: int, n: int, r: int, past: int, slot: int = 0, row0: int = 0,
                    device_inputs: bool = False) -> None:
        """The target over ``a`` sequences from slot ``slot`` (``a`` > 1: from slot 0), ``n`` new rows each after
        ``past`` bound rows; logits and features from output row ``row0`` on. device_inputs: ids, positions and the
        mask from a device round's buffers."""
        fixed, outputs = self._target_io(a, n, r, slot, row0, device_inputs)
        mask = (self._dev_mask[:a * n * (past + n)].view(a, n, past + n) if device_inputs
                else self._host(self._mask, a, n, past + n))
        changing = {C.ATTENTION_MASK: mask}
        cache = self.tkv.past(a, past, slot)
        if cache:
            changing.update(cache)
        inputs = SplitInputs(fixed, changing)
        t0 = time.perf_counter()
        self.backend.run(self.tgraph, inputs, outputs)
        self._t_target += time.perf_counter() - t0
        if self.in_graph_accept:
            self._acc_host = None

    def _embed(self, rows: int) -> None:
        """``dembeds`` rows [0, rows) = the embedding rows of the tokens in ``_ids`` (host buffers: through numpy; on a
        backend that copies from the host without blocking, gathered into a host array and copied through it)."""
        if self._embed_host is not None:
            host = self._embed_host[:rows]
            self.embedding.gather(self._ids.array[:rows], host)
            self.backend.copy_from_host(self._t["dembeds"][:rows], host)
            return
        dst = self._np["dembeds"] if self._np is not None else self._t["dembeds"]
        self.embedding.gather(self._ids.array[:rows], dst[:rows])

    def _run_draft(self, a: int, n: int, feat_rows: int, past: int, base: int = 0) -> None:
        """The draft over the tokens in ``_ids`` [a, n]: their embedding rows are gathered here, then the call."""
        self._embed(a * n)
        fixed, outputs = self._draft_io(a, n, feat_rows)
        inputs = self._draft_inputs(fixed, a, n, past, base)
        t0 = time.perf_counter()
        self.backend.run(C.DRAFT_GRAPH, inputs, outputs)
        self._t_draft += time.perf_counter() - t0

    def _draft_inputs(self, fixed, a: int, n: int, past: int, base: int) -> SplitInputs:
        """A draft call's inputs (step or tree graph): its fixed bindings, and per call the mask and the past views
        of ``past`` rows from row ``base``."""
        changing = {C.ATTENTION_MASK: self._host(self._mask, a, n, past + n)}
        changing.update(zip(self._draft_names[0], self._past(self.dcache, a, past, base), strict=True))
        return SplitInputs(fixed, changing)

    def _run_tree(self, a: int, n: int, past: int, k: int, depth: int, base: int = 0) -> None:
        """The draft tree graph of top_k ``k``, cut to ``depth`` levels, over the context rows in ``_ids`` [a, n]
        (every row a feature row), each sequence's last context row in ``_last_row``: the context pass and the whole
        tree in one call."""
        self._embed(a * n)
        if self._fixed_depth:  # an engine grows its depth whatever the round's (the first levels serve a shallower one)
            depth = self.tree_depths[k]
        self._x_n = cand = k + depth * k * k
        fixed, outputs = self._tree_io(a, n, cand, k)
        inputs = self._draft_inputs(fixed, a, n, past, base)
        t0 = time.perf_counter()
        self.backend.run(C.tree_call(k, depth), inputs, outputs)
        self._t_draft += time.perf_counter() - t0
        self._x_host = None

    def tree_output(self) -> dict[str, np.ndarray]:
        """The last tree call's candidates and context rows' top-k on the host: numpy views of host buffers, or one
        read of the block on a device (made once per call, whichever slots load from it)."""
        if self._xnp is not None:
            return self._xnp
        if self._x_host is None:
            K = self.ctx_vals.shape[1]
            self._x_host = read_block(self.backend, self._xblock, self._x_parts)
            self._x_host["vals"] = self._x_host["vals"].reshape(-1, K)
            self._x_host["ids"] = self._x_host["ids"].reshape(-1, K)
        return self._x_host

    def tree_graph_fits(self, top_k: int, depth: int) -> bool:
        """Does a round of this tree draft in one call (a draft tree graph for its top_k, at least its depth)? Else
        it drafts level by level with the step graph."""
        return 1 <= depth <= self.tree_depths.get(top_k, 0)


def packed_block(zeros, parts: dict[str, tuple[type, int]]) -> tuple[torch.Tensor, dict, dict]:
    """One byte buffer holding ``parts`` (name -> (numpy dtype, elements)), each at a 256-byte boundary (TensorRT's
    address alignment): (the buffer, name -> typed flat view, name -> (offset, dtype, elements)). Outputs bound to its
    parts come back to the host in one read (``read_block``)."""
    layout, end = {}, 0
    for name, (typ, count) in parts.items():
        layout[name] = (end, typ, count)
        end += -(-count * np.dtype(typ).itemsize // 256) * 256
    block = zeros((max(end, 1),), torch.uint8)
    as_torch = {np.float32: torch.float32, np.int64: torch.int64, np.bool_: torch.bool}
    views = {name: block[o:o + count * np.dtype(typ).itemsize].view(as_torch[typ])
             for name, (o, typ, count) in layout.items()}
    return block, views, layout


def read_block(backend, block: torch.Tensor, layout: dict) -> dict[str, np.ndarray]:
    """A ``packed_block`` on the host: one ``to_host`` of the buffer, typed numpy views of its parts."""
    raw = backend.to_host(block)
    return {name: raw[o:o + count * np.dtype(typ).itemsize].view(typ) for name, (o, typ, count) in layout.items()}

