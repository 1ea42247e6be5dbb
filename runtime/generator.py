"""The EAGLE loop: prefill, draft tree, one target verify per round, acceptance, KV commit.

Backend-neutral: it talks to a backend only through the ``Backend`` interface (``backend.py``). It
allocates every buffer once (caches and their new-rows scratch, output scratch, host arrays for ids,
positions and masks) and passes ``BufferView``s of them to ``run``, made by address arithmetic.

A generation reads as the algorithm: ``_prefill`` (prompt chunks, each followed by its draft context),
then either ``_plain_step`` per token (no draft), or per round ``_grow_tree`` (draft levels),
``_verify`` (one target forward of the tree), ``_accept_and_commit`` (acceptance, kept K/V rows into
the cache) and ``_draft_context`` (the committed tokens through the draft).

Decoding is greedy unless a ``SamplingParams`` with temperature > 0 is given: then every place
that takes the target's argmax (the prefill's root, the no-draft step, the verify acceptance)
samples from the processed distribution instead, with a random source owned by that request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator as PyGenerator
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np
import torch

from eagle_export import contract as C
from eagle_export.dtypes import torch_dtype
from eagle_export.errors import GenerationError
from eagle_export.manifest import Manifest
from eagle_export.tree_params import TreeParams

from .accept import Accepted, accept_greedy, accept_sampling
from .backend import Backend
from .kv_cache import KVCache
from .sampling import LazyProbs, SamplingParams, process_logits, sample_token
from .tree import TreeGrower, VerifyTree
from .views import HostScratch, RowBuffers

log = logging.getLogger(__name__)
FINISH_REASONS = ("eos", "length", "capacity")


def tau(accept_lengths: list[int]) -> float:
    """Committed tokens per target forward (the accepted draft tokens of each round plus its bonus token), over
    the rounds given; 0 without rounds. The one definition: stats, bench and the command line use it."""
    if not accept_lengths:
        return 0.0
    return (sum(accept_lengths) + len(accept_lengths)) / len(accept_lengths)


@dataclass
class GenerationStats:
    rounds: int = 0  # target forwards after prefill (verify rounds, or decode steps with no draft)
    accept_lengths: list[int] = field(default_factory=list)  # draft tokens accepted per round
    draft_forwards: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # First draft position at or past the head's max_position_embeddings (None: never got there). Output stays
    # lossless past it; only acceptance may drop, as the head was not trained there.
    draft_beyond_position_limit: int | None = None

    @property
    def tau(self) -> float:
        """Committed tokens per target forward, bonus token included."""
        return tau(self.accept_lengths)

    def to_dict(self) -> dict:
        return {"rounds": self.rounds, "tau": self.tau, "accept_lengths": list(self.accept_lengths),
                "draft_forwards": self.draft_forwards, "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "draft_beyond_position_limit": self.draft_beyond_position_limit}


@dataclass
class GenerationResult:
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats
    prompt_len: int
    text: str | None = None

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "finish_reason": self.finish_reason,
                "prompt_tokens": self.prompt_len, "stats": self.stats.to_dict()}


@dataclass(frozen=True)
class _Sampler:
    """One request's sampling settings and its own random source."""

    params: SamplingParams
    rng: np.random.Generator


class Generator:
    """Owns every buffer of one decoding session (allocated here, once) and runs generations on them."""

    def __init__(self, manifest: Manifest, backend: Backend, prefill_chunk: int = 256):
        if not isinstance(backend, Backend):
            raise TypeError(f"{type(backend).__name__} does not implement runtime.backend.Backend")
        self.m = manifest
        self.backend = backend
        dtype = torch_dtype(manifest.dtype)
        t, d, lim = manifest.target, manifest.draft, manifest.tree_limits
        self.capacity = manifest.max_seq_len
        self.chunk = max(1, min(prefill_chunk, self.capacity))
        verify_rows = lim.max_verify_tokens
        t_rows = max(self.chunk, verify_rows)
        d_rows = max(self.chunk, lim.max_top_k, lim.max_context_rows)
        zeros = backend.zeros
        # Target cache: committed rows stay < capacity; a round's accepted path (up to verify_rows) may run past it.
        self.tcache = KVCache(t.num_layers, t.kv_heads, t.head_dim, self.capacity + verify_rows, dtype,
                              backend.device, new_rows=t_rows, zeros=zeros)
        # Draft cache: committed context + every frontier row of one round's tree.
        self.dcache = KVCache(d.num_layers, d.kv_heads, d.head_dim,
                              self.capacity + lim.max_draft_rows + lim.max_context_rows, dtype, backend.device,
                              new_rows=d_rows, zeros=zeros)
        self.logits = zeros((1, verify_rows, t.vocab_size), torch.float32)
        self.tfeats = zeros((1, t_rows, t.feature_dim), dtype)
        self.dvals = zeros((1, d_rows, lim.max_top_k), torch.float32)
        self.dids = zeros((1, d_rows, lim.max_top_k), torch.int64)
        self.dhidden = zeros((1, d_rows, d.hidden_size), dtype)
        self.dfeats_in = zeros((1, d_rows, d.feature_dim), dtype)  # context passes
        self.dhidden_in = zeros((1, lim.max_top_k, d.hidden_size), dtype)  # tree levels
        # In host memory the loop reads and fills these buffers through numpy views made here once (same memory, no
        # torch call per access). Elsewhere it reads through backend.to_host and gathers rows with torch.
        self._host_reads = backend.host_memory
        if self._host_reads:
            self._np_logits, self._np_dvals, self._np_dids = (x.numpy()[0] for x in (self.logits, self.dvals,
                                                                                     self.dids))
        self._np_rows = None
        if backend.host_memory and dtype != torch.bfloat16:  # numpy has no bfloat16
            self._np_rows = {name: getattr(self, name).numpy()[0] for name in ("tfeats", "dhidden", "dfeats_in",
                                                                                "dhidden_in")}
        # Every buffer a graph binds is passed as BufferViews made by arithmetic: a verify binds 2 x layers cache
        # views, and making each as a torch slice cost more than the bind.
        self._rows = {name: RowBuffers([getattr(self, name)])
                      for name in ("logits", "tfeats", "dvals", "dids", "dhidden", "dfeats_in", "dhidden_in")}
        self._warned_draft_limit = False
        # Host inputs live in scratch arrays reused by every call: same address, so a backend that keeps
        # bindings rebinds them only when their shape changes.
        rows = max(t_rows, d_rows)
        mask_elems = max(t_rows * (self.tcache.capacity + t_rows), d_rows * (self.dcache.capacity + d_rows))
        self._mask = HostScratch(mask_elems, np.bool_)
        self._ids = HostScratch(rows, np.int64)
        self._pos = HostScratch(rows, np.int64)
        self._lidx = HostScratch(verify_rows, np.int64)
        self._arange = np.arange(verify_rows, dtype=np.int64)
        self._arange_rows = np.arange(rows, dtype=np.int64)
        self._tri = np.tri(rows, dtype=np.bool_)  # causal blocks of context passes and prefill chunks
        self._draft_pos_limit = d.max_position_embeddings
        self._growers: dict[TreeParams, TreeGrower] = {}
        self.eos = set(t.eos_token_ids)
        self._target_names = (C.past_names(t.num_layers), C.present_names(t.num_layers))
        self._draft_names = (C.past_names(d.num_layers), C.present_names(d.num_layers))
        # Per call shape, the bindings that never move (host-array views, output rows, new-rows scratch), made once:
        # bounded by the distinct (rows, logit rows / feature rows) a session meets, at most a few hundred.
        self._io_memo: dict[tuple, tuple[dict, dict]] = {}
        self.vocab = t.vocab_size

    # ---- host access to the buffers ----------------------------------------------------------
    def _topk(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """The draft's top-k log-probs and ids at output row(s) ``rows`` (an int or a slice), as host arrays."""
        if self._host_reads:
            return self._np_dvals[rows], self._np_dids[rows]
        return self.backend.to_host(self.dvals[0, rows]), self.backend.to_host(self.dids[0, rows])

    def _argmax(self, rows: int) -> np.ndarray:
        """The target's argmax over each of the first ``rows`` logits rows (the first maximum on ties)."""
        if self._host_reads:
            return self._np_logits[:rows].argmax(-1)
        return self.backend.to_host(self.logits[0, :rows].argmax(-1))

    def _logits_row(self, i: int) -> np.ndarray:
        return self._np_logits[i] if self._host_reads else self.backend.to_host(self.logits[0, i])

    def _gather(self, dst: str, src: str, rows: np.ndarray) -> None:
        """Buffer ``dst`` rows [0, len(rows)) = buffer ``src`` rows ``rows`` (batch row 0)."""
        if self._np_rows is not None:
            d, s = self._np_rows[dst], self._np_rows[src]
            if len(rows) == 1:  # a chain's parent: one row, no gather
                d[0] = s[rows[0]]
            else:
                d[:len(rows)] = s[rows]
        else:
            s = getattr(self, src)
            getattr(self, dst)[0, :len(rows)].copy_(s[0, torch.tensor(rows, device=s.device)])  # rows may be read-only

    # ---- graph calls -------------------------------------------------------------------------
    # Callers fill the host inputs (``_ids.array``, ``_pos.array``, ``_lidx.array`` from row 0; the mask through
    # ``_mask.take``) and then call ``_run_target`` / ``_run_draft``, which bind them with the buffers' rows.
    def _buf(self, name: str, count: int):
        """Rows [0, count) of one of the output/scratch buffers, as a BufferView."""
        return self._rows[name].head(count)[0]

    def _causal_mask(self, new: int, past: int) -> None:
        mask = self._mask.take((new, past + new))
        mask[:, :past] = True
        mask[:, past:] = self._tri[:new, :new]

    def _target_io(self, n: int, r: int) -> tuple[dict, dict]:
        """The target call's bindings that depend only on (n, r), made once: inputs but the mask and the past,
        and every output."""
        key = (n, r)
        io = self._io_memo.get(key)
        if io is None:
            ins = {C.INPUT_IDS: self._ids.view((1, n)), C.POSITION_IDS: self._pos.view((1, n)),
                   C.LOGIT_INDICES: self._lidx.view((1, r))}
            outs = {C.LOGITS: self._buf("logits", r), C.FEATURES: self._buf("tfeats", n)}
            outs.update(zip(self._target_names[1], self.tcache.new_views(n), strict=True))
            io = self._io_memo[key] = (ins, MappingProxyType(outs))  # read-only: a backend may skip rechecking it
        return io

    def _draft_io(self, n: int, feat_rows: int) -> tuple[dict, dict]:
        """As ``_target_io`` for a draft call of n rows, ``feat_rows`` of them from target features."""
        key = (n, feat_rows, "draft")
        io = self._io_memo.get(key)
        if io is None:
            ins = {C.INPUT_IDS: self._ids.view((1, n)), C.POSITION_IDS: self._pos.view((1, n)),
                   C.DRAFT_FEATURES: self._buf("dfeats_in", feat_rows),
                   C.HIDDEN_IN: self._buf("dhidden_in", n - feat_rows)}
            outs = {C.TOPK_LOGPROBS: self._buf("dvals", n), C.TOPK_IDS: self._buf("dids", n),
                    C.HIDDEN: self._buf("dhidden", n)}
            outs.update(zip(self._draft_names[1], self.dcache.new_views(n), strict=True))
            io = self._io_memo[key] = (ins, MappingProxyType(outs))
        return io

    def _run_target(self, n: int, r: int, past: int) -> None:
        """Target call on ids/positions/mask/logit indices already in the scratch arrays: n new tokens after
        ``past`` cached ones, logits for r rows. Their K/V land in the cache's new-rows scratch (the caller writes
        the rows it keeps)."""
        fixed, outputs = self._target_io(n, r)
        inputs = fixed.copy()
        inputs[C.ATTENTION_MASK] = self._mask.view((1, n, past + n))
        inputs.update(zip(self._target_names[0], self.tcache.views(0, past), strict=True))
        self.backend.run(C.TARGET_GRAPH, inputs, outputs)

    def _run_draft(self, n: int, feat_rows: int, past: int) -> None:
        """One draft call on ids/positions/mask in the scratch arrays: the first ``feat_rows`` rows are fed
        from target features (``dfeats_in``), the rest from fed-back hiddens (``dhidden_in``)."""
        fixed, outputs = self._draft_io(n, feat_rows)
        inputs = fixed.copy()
        inputs[C.ATTENTION_MASK] = self._mask.view((1, n, past + n))
        inputs.update(zip(self._draft_names[0], self.dcache.views(0, past), strict=True))
        self.backend.run(C.DRAFT_GRAPH, inputs, outputs)
        self.dcache.write(past, n)
        self.stats.draft_forwards += 1
        self._last_row = n - 1
        limit = self._draft_pos_limit
        last = int(self._pos.array[n - 1])  # positions never decrease along a call
        if last >= limit and self.stats.draft_beyond_position_limit is None:
            self.stats.draft_beyond_position_limit = last
            if not self._warned_draft_limit:
                self._warned_draft_limit = True
                log.warning("the draft head ran at position %d, past its max_position_embeddings %d: output stays "
                            "lossless, but acceptance may drop (the head was not trained there)", last, limit)

    # ---- the algorithm's steps ---------------------------------------------------------------
    def _prefill(self, prompt: np.ndarray, sampler: _Sampler | None, use_draft: bool) -> int:
        """The prompt through the target in chunks (each followed by its draft context when drafting); returns
        the first generated token (the root of the first tree)."""
        n = len(prompt)
        root = -1
        for s in range(0, n, self.chunk):
            e = min(n, s + self.chunk)
            c = e - s
            last = e == n
            self._ids.array[:c] = prompt[s:e]
            self._pos.array[:c] = self._arange_rows[:c] + s
            self._causal_mask(c, s)
            self._lidx.array[0] = c - 1
            self._run_target(c, 1, s)
            self.tcache.write(s, c)
            if last:
                root = self._next_token(sampler)
            if use_draft:
                nxt = np.append(prompt[s + 1:e], root) if last else prompt[s + 1:e + 1]
                self._draft_context(nxt.astype(np.int64), np.arange(c), s)
        return root

    def _plain_step(self, token: int, L: int, sampler: _Sampler | None) -> int:
        """No draft: ``token`` through the target at position L (after L committed rows); returns the next."""
        self._ids.array[0] = token
        self._pos.array[0] = L
        self._lidx.array[0] = 0
        self._mask.take((L + 1,))[:] = True
        self._run_target(1, 1, L)
        self.tcache.write(L, 1)
        return self._next_token(sampler)

    def _grow_tree(self, tree: TreeParams, L: int, root: int) -> VerifyTree:
        """Draft ``tree.depth`` levels of ``top_k`` nodes after the last context pass, then select the verify
        tree of ``total_tokens`` nodes under ``root``. The draft cache holds L committed rows."""
        grower = self._growers.get(tree)
        if grower is None:  # kept across generations: its buffers and verify-tree shapes are reused
            grower = self._growers[tree] = TreeGrower(tree)
        grower.reset()
        k = tree.top_k
        ctx = self._last_row  # the context pass's last row predicts the root's children
        frontier = grower.add_root_children(*self._topk(ctx))
        for level in range(1, tree.depth + 1):
            past = L + frontier.fed
            self._gather("dhidden_in", "dhidden", frontier.parent_rows + ctx if level == 1 else frontier.parent_rows)
            mask = self._mask.take((k, past + k))
            mask[:, :L] = True
            mask[:, L:] = frontier.tree_mask
            self._ids.array[:k] = frontier.tokens
            self._pos.array[:k] = L + level - 1
            self._run_draft(k, 0, past)
            frontier = grower.add_children(*self._topk(slice(0, k)))
        return grower.select(tree.total_tokens, root)

    def _verify(self, vt: VerifyTree, L: int) -> None:
        """The whole tree through the target in one forward after L committed rows; logits for every node."""
        T = vt.num_nodes
        mask = self._mask.take((T, L + T))
        mask[:, :L] = True
        mask[:, L:] = vt.mask
        self._ids.array[:T] = vt.tokens
        np.add(vt.depths, L, out=self._pos.array[:T])
        self._lidx.array[:T] = self._arange[:T]
        self._run_target(T, T, L)

    def _accept_and_commit(self, vt: VerifyTree, L: int, sampler: _Sampler | None) -> tuple[Accepted, list[int]]:
        """The accepted path (greedy or by recursive rejection) and its K/V into the target cache at rows L..;
        returns it and the tokens it commits (accepted tokens, then the bonus token)."""
        acc = self._accept(vt, sampler)
        self.tcache.write_rows(L, acc.indices)  # the accepted path's K/V, root first
        return acc, [int(x) for x in acc.tokens] + [int(acc.bonus)]

    def _next_token(self, sampler: _Sampler | None) -> int:
        """The token after logits row 0: its argmax (greedy) or a draw from its processed distribution."""
        if sampler is None:
            return int(self._argmax(1)[0])
        return sample_token(process_logits(self._logits_row(0), sampler.params), sampler.rng)

    def _accept(self, vt, sampler: _Sampler | None):
        T = vt.num_nodes
        if sampler is None:
            return accept_greedy(vt, self._argmax(T))
        return accept_sampling(vt, LazyProbs(self._logits_row, T, sampler.params), sampler.rng)

    def _draft_context(self, tokens: np.ndarray, feature_rows: np.ndarray, start: int) -> None:
        """Feed committed pairs (feature_j, token_{j+1}) at draft positions start.. (rows start..).

        feature_rows: the rows of the target's last ``features`` output that hold feature_j, in order.
        """
        n = len(tokens)
        self._gather("dfeats_in", "tfeats", feature_rows)
        self._ids.array[:n] = tokens
        self._pos.array[:n] = self._arange_rows[:n] + start
        self._causal_mask(n, start)
        self._run_draft(n, n, start)

    # ---- a generation ------------------------------------------------------------------------
    def check_prompt(self, prompt_ids) -> np.ndarray:
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise GenerationError("the prompt is empty: give at least one token")
        bad = ids[(ids < 0) | (ids >= self.vocab)]
        if bad.size:
            raise GenerationError(f"prompt token id {int(bad[0])} is outside the vocabulary [0, {self.vocab})")
        if ids.size > self.capacity:
            raise GenerationError(
                f"the prompt has {ids.size} tokens, more than the artifact's capacity (--max-seq-len) of "
                f"{self.capacity}"
            )
        return ids

    def run(self, prompt_ids, max_new_tokens: int, tree: TreeParams | None = None, use_draft: bool = True,
            stop_on_eos: bool = True, sampling: SamplingParams | None = None,
            rng: np.random.Generator | None = None, on_round=None) -> PyGenerator[list[int], None, GenerationResult]:
        """Yield committed tokens as they are accepted; return the GenerationResult.

        sampling: None or temperature 0 = greedy. Otherwise tokens are sampled from the target's
        processed distribution, drawing from ``rng`` (default: a new one from ``sampling.seed``,
        owned by this request).

        on_round: optional trace hook, called after each verify round's acceptance with the round's
        ``VerifyTree`` and ``Accepted`` (read them in the call; their arrays are reused). Used by
        ``validate`` and the tests to compare rounds with the PyTorch oracle (runtime/oracle.py).
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        tree = tree or self.m.tree_defaults
        if use_draft:
            tree.validate(self.m.tree_limits)
            self.backend.check_tree(tree)  # engines may be built for smaller trees
        sampler = None
        if sampling is not None:
            if not isinstance(sampling, SamplingParams):
                raise GenerationError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
            if not sampling.validate().is_greedy:
                sampler = _Sampler(sampling, rng if rng is not None else sampling.make_rng())
        ids = self.check_prompt(prompt_ids)
        return self._loop(ids, max_new_tokens, tree, use_draft, stop_on_eos, sampler, on_round)

    def _loop(self, prompt: np.ndarray, max_new: int, tree: TreeParams, use_draft: bool, stop_on_eos: bool,
              sampler: _Sampler | None, on_round=None):
        self.stats = stats = GenerationStats()
        n = len(prompt)
        out: list[int] = []
        room = self.capacity - n  # tokens that still fit in the sequence
        if room <= 0:
            return GenerationResult(out, "capacity", stats, n)

        def emit(new: list[int]) -> tuple[list[int], str | None]:
            """Append tokens up to EOS / max_new / capacity; say why generation ends, if it does."""
            reason = None
            if stop_on_eos:
                for i, tok in enumerate(new):
                    if tok in self.eos:
                        new, reason = new[: i + 1], "eos"
                        break
            remaining = min(max_new, room) - len(out)
            if len(new) > remaining or (reason is None and len(new) == remaining):
                new = new[:remaining]
                reason = "length" if max_new <= room else "capacity"
            out.extend(new)
            return new, reason

        t0 = time.perf_counter()
        root = self._prefill(prompt, sampler, use_draft)
        stats.prefill_s = time.perf_counter() - t0
        L = n  # committed target cache rows (the draft cache holds as many)
        new, reason = emit([root])
        yield new
        t1 = time.perf_counter()
        try:
            if reason is not None:
                return GenerationResult(out, reason, stats, n)
            if not use_draft:
                while True:
                    root = self._plain_step(root, L, sampler)
                    L += 1
                    stats.rounds += 1
                    stats.accept_lengths.append(0)
                    new, reason = emit([root])
                    yield new
                    if reason is not None:
                        return GenerationResult(out, reason, stats, n)
            while True:
                vt = self._grow_tree(tree, L, root)
                self._verify(vt, L)
                acc, tokens = self._accept_and_commit(vt, L, sampler)
                stats.rounds += 1
                stats.accept_lengths.append(int(acc.num_accepted))
                if on_round is not None:
                    on_round(vt, acc)
                new, reason = emit(tokens)
                if new:
                    yield new
                if reason is not None:
                    return GenerationResult(out, reason, stats, n)
                # Draft context for the committed rows: (feature of root/accepted node, next token).
                self._draft_context(np.asarray(tokens, dtype=np.int64), acc.indices, L)
                L += len(acc.indices)
                root = tokens[-1]
        finally:
            stats.decode_s = time.perf_counter() - t1
