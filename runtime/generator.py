"""The EAGLE loop: prefill, draft tree, one target verify per round, acceptance, KV commit, for one
sequence or a batch of them.

The buffers and the graph calls over them are ``GraphCalls``' (``graph_calls.py``: allocated once, bound by
address through the ``Backend`` interface), the target cache's verbs ``target_kv.py``'s, what a generation returns
``results.py``'s; this module is the round's steps.

One ``Generator`` holds ``slots`` sequence slots (1 unless the runtime was opened with ``max_batch``). Each
active sequence (a ``Slot``) has its own committed rows in both caches, its own tree, acceptance, sampling
state, stop rule and stats. A round reads as the algorithm, for every active sequence at once:
``_grow_tree`` (one draft call per tree level), ``_verify`` (one target call for every tree),
``_accept_and_commit`` (per sequence) and ``_draft_context`` (one draft call for every sequence's committed
tokens); a sequence joins with ``_prefill`` (its prompt alone, in chunks) and leaves when it finishes. Where the
backend runs the draft tree graph (contract 5) and the round's trees fit it, ``_draft_context`` grows every
sequence's next tree in its one call (``_run_tree``, ``_load_tree``), and the next round skips ``_grow_tree``: one
draft call and one target call a round.
Decoding without a draft is the same round with a root-only tree and no draft calls. ``run`` drives one
sequence through these steps; the scheduler (``scheduler.py``) drives many.

Ragged lengths share a call through the masks and positions (the graphs' batch axis is dynamic): each
sequence's committed rows are a prefix of its cache region, the regions sit at a common stride, and a call
over A >= 2 sequences binds ``[A, stride]`` rows with the mask hiding every row a sequence does not own (see
``slots.py`` and docs/runtime.md, "Batched decoding"). One sequence binds exactly its committed rows, as before.
A sequence that feeds fewer rows than the call's widest (a smaller tree, a shorter accepted path, a finished
or no-draft sequence) gets padding rows that see only themselves; their outputs are never read and their K/V
never kept, so padding never changes a token.

Decoding is greedy unless a ``SamplingParams`` with temperature > 0 is given: then every place
that takes the target's argmax (the prefill's root, the no-draft step, the verify acceptance)
samples from the processed distribution instead, with a random source owned by that request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator as PyGenerator
from dataclasses import dataclass, field

import numpy as np

from eagle_export.errors import GenerationError
from eagle_export.manifest import Manifest
from eagle_export.tree_params import TreeParams

from .accept import Accepted, accept_greedy, accept_sampling
from .backend import Backend
from .chain_length import ChainLength, short_of
from .embedding import TokenEmbedding
from .graph_calls import GraphCalls, read_block
from .guard import DEFAULT_POLICY, MIXED, PLAIN, SPEC, Guard, GuardPolicy, RoundCosts
from .logprobs import token_logprobs
from .results import GenerationResult, GenerationStats
from .sampling import LazyProbs, SamplingParams, process_logits, sample_token
from .slots import Request, StopRule, check_max_new, move_order
from .tree import Frontier, TreeGrower, VerifyTree

log = logging.getLogger(__name__)
KEEP = object()  # Generator.round: every sequence keeps its tree (no per-batch table applied)


@dataclass(eq=False)
class Slot:
    """One active sequence: its request, committed length, tree state, stop rule and stats."""

    req: Request
    stop: StopRule
    stats: GenerationStats
    sink: object  # where committed tokens go: ``push(list)``, ``finish(result)``, ``fail(exc)``
    L: int = 0  # committed rows (target and draft alike)
    root: int = -1
    grower: TreeGrower | None = None
    frontier: Frontier | None = None
    vt: VerifyTree | None = None
    acc: Accepted | None = None
    tokens: list[int] = field(default_factory=list)  # this round's committed tokens (accepted + bonus)
    reason: str | None = None
    error: BaseException | None = None
    t_join: float = 0.0
    ready: bool = False  # the grower holds this round's candidates already (the draft tree graph grew them)
    # the tree engine's selection of this round's verify tree is on the device, not in the grower (``_device_round``)
    dev: bool = False
    lag: list[int] = field(default_factory=list)  # tokens of rounds without a draft, not yet in the draft cache
    guard: Guard | None = None  # the speculation guard of a drafting request (None: off)
    guarded: bool = False  # this round's mode came from the guard (the request could draft this round)
    leaving: bool = False  # the guard turned speculation off after this round: its tokens go to the lag rows
    # lag tokens before which no flush or shadow read of the lag rows is due (``Generator._read_at``; 0: look again)
    read_at: int = 0
    # the runtime's running tau for the request's tree (RoundCosts.prior: tau, variance, rounds; the guard's start)
    prior: tuple[float, float, float] | None = None
    # a guarded chain's choice between its base chain and a short one (runtime/chain_length.py; None: no choice), and
    # the base it was made for (a per-batch row may change the base)
    chain: ChainLength | None = None
    chain_base: TreeParams | None = None
    drafted: TreeParams | None = None  # the tree this round's verify tree came from

    def __post_init__(self) -> None:
        self.base = self.req.tree  # the tree this slot drafts with when it drafts (a per-batch row may change it)
        self.set_tree(self.req.tree)
        if self.req.guard is not None and self.req.tree is not None:
            self.guard = Guard(self.req.guard, prior=self.prior)

    def set_tree(self, t: TreeParams | None) -> None:
        """The tree of this slot's next rounds (None: no draft)."""
        self.tree = t
        self.k, self.depth = (t.top_k, t.depth) if t is not None else (0, 0)
        # Rows a round may write past L. Target: the accepted path (root + at most depth + 1 draft tokens, never
        # more than the verify tree's nodes). Draft: every tree level's frontier, or the next context pass.
        self.slack_t = min(t.depth + 2, t.total_tokens + 1) if t is not None else 1
        self.slack_d = max(t.depth * t.top_k, self.slack_t) if t is not None else 1


class Generator(GraphCalls):
    """Runs the rounds of ``slots`` sequences together over the buffers and graph calls of ``GraphCalls``.

    step: the smallest rounding, in rows, of the cache regions' common stride (``slots.LayoutPlan``)."""

    def __init__(self, manifest: Manifest, backend: Backend, embedding: TokenEmbedding, prefill_chunk: int = 256,
                 slots: int = 1, step: int = 16, guard: GuardPolicy | None = DEFAULT_POLICY):
        super().__init__(manifest, backend, embedding, prefill_chunk, slots, step)
        # The speculation guard (runtime/guard.py): its settings for drafting requests (None: off), and the round
        # times it reads, measured over this generator's rounds.
        self.guard = None if guard is None else guard.validate()
        self.costs = RoundCosts()
        t, d = manifest.target, manifest.draft
        self._draft_pos_limit = d.max_position_embeddings
        self._warned_draft_limit = False
        self._growers: dict[TreeParams, list[TreeGrower]] = {}  # free growers per tree setting, reused
        self.eos = frozenset(t.eos_token_ids)
        self.active: list[Slot] = []

    def _tree_fits(self, s: Slot) -> bool:
        return self.tree_graph_fits(s.k, s.depth)

    def _load_tree(self, s: Slot, b: int, committed: int, row: int | None = None) -> None:
        """Slot b's next tree from the tree graph's output row ``row`` (default b; s has ``committed`` rows once this
        round's are in), and its context row (top-k and hidden) as a step-graph context pass would have left it."""
        r = b if row is None else row
        s.ready = True
        self._note_draft_positions(s, committed + s.depth - 1, calls=0)  # the call was counted with its context
        s.dev = self.in_graph_accept and self._device_round(s)
        if s.dev:  # the tree engine selected the verify tree on the device: kept there for the slot, nothing read
            S, K, x = self.selects[s.k], self.ctx_vals.shape[1], self._x
            sel = self._slot_sel
            sel["tokens"][b].copy_(x["sel_tokens"][r * S:(r + 1) * S])
            sel["depths"][b].copy_(x["sel_depths"][r * S:(r + 1) * S])
            sel["mask"][b].copy_(x["sel_mask"][r * S * S:(r + 1) * S * S].view(S, S))
            self._slot_ctx["vals"][b * K:(b + 1) * K].copy_(x["vals"][r])
            self._slot_ctx["ids"][b * K:(b + 1) * K].copy_(x["ids"][r])
            self.ctx_hidden[b].copy_(x["hidden"][r])
            return
        c = slice(r * self._x_n, (r + 1) * self._x_n)  # row r of the last call's [a, n] candidates
        xn = self._xnp if self._xnp is not None else self.tree_output()  # host memory: views made once
        s.grower.load(xn["scores"][c], xn["tokens"][c], xn["parents"][c])
        self.ctx_vals[b], self.ctx_ids[b] = xn["vals"][r], xn["ids"][r]
        if self._np_ctx_hidden is not None:  # host memory: numpy views made once
            self._np_ctx_hidden[b] = xn["hidden"][r]
        else:
            self.ctx_hidden[b].copy_(self._x["hidden"][r])

    def _device_round(self, s: Slot) -> bool:
        """Is s's next verify tree selected on the device (a round then reads once, the accepted paths): a backend
        whose verify engine accepts and whose tree engine for s's top_k, at s's depth, selects at least s's verify
        tree; a greedy request without a threshold, a trace or log-probs (those select and accept on the host)."""
        t = s.tree
        return (self.in_graph_accept and t is not None
                and self.selects.get(t.top_k, 0) >= t.total_tokens and self.tree_depths.get(t.top_k) == t.depth
                and not t.threshold and self._greedy_plain(s))

    def _greedy_plain(self, s: Slot) -> bool:
        """A request whose tokens the verify engine's acceptance gives (greedy, no trace, no log-probs)."""
        return s.req.sampling is None and s.req.on_round is None and s.req.logprobs is None

    def _on_device(self, slots: list[Slot]) -> bool:
        """Does this round run on the device: a slot with a tree selected there, and every slot either so or without
        a draft this round, greedy. Otherwise a slot whose tree was selected on the device drafts again on the host,
        level by level from its context row (read now): a rare round (a sampled request joined, a trace)."""
        if not any(s.dev for s in slots):
            return False
        if all(s.dev or (s.grower is None and self._greedy_plain(s)) for s in slots):
            return True
        K = self.ctx_vals.shape[1]
        ctx = read_block(self.backend, self._slot_ctx_block, self._slot_ctx_parts)
        for b, s in enumerate(slots):
            if s.dev:
                self.ctx_vals[b], self.ctx_ids[b] = ctx["vals"][b * K:(b + 1) * K], ctx["ids"][b * K:(b + 1) * K]
                s.dev = s.ready = False
        return False

    def _note_draft_positions(self, s: Slot, last: int, calls: int = 1) -> None:
        """``calls`` more draft calls for s, whose last position was ``last``: past the head's trained range?"""
        s.stats.draft_forwards += calls
        if last >= self._draft_pos_limit and s.stats.draft_beyond_position_limit is None:
            s.stats.draft_beyond_position_limit = last
            if not self._warned_draft_limit:
                self._warned_draft_limit = True
                log.warning("the draft head ran at position %d, past its max_position_embeddings %d: output stays "
                            "lossless, but acceptance may drop (the head was not trained there)", last,
                            self._draft_pos_limit)

    # ---- requests ----------------------------------------------------------------------------
    def check(self, prompt_ids, max_new_tokens: int, tree: TreeParams | None = None, use_draft: bool = True,
              stop_on_eos: bool = True, sampling: SamplingParams | None = None,
              rng: np.random.Generator | None = None, on_round=None) -> Request:
        """One generation's settings, checked (GenerationError naming the problem), as a ``Request``."""
        check_max_new(max_new_tokens)
        table = self.m.batch_trees
        tuned = use_draft and tree is None and table is not None
        if tuned and not any(r.tree is not None for r in table.rows if r.active <= self.B):
            tuned = use_draft = False  # the artifact's default is no draft at every batch size this runtime reaches
        if use_draft:
            tree = tree or self.m.tree_defaults
            for t in (tree, *(self.m.batch_trees.trees() if tuned else ())):
                t.validate(self.m.tree_limits)
                self.backend.check_tree(t)  # engines may be built for smaller trees
            tree = tree.trimmed()  # no level grown that no verify tree reaches (TreeParams.trimmed)
        else:
            tree = None
        if sampling is not None:
            if not isinstance(sampling, SamplingParams):
                raise GenerationError(f"sampling must be a SamplingParams or None, got {type(sampling).__name__}")
            if sampling.validate().is_greedy:
                sampling = None
            elif rng is None:  # the request's own random source, unless the caller gives one
                rng = sampling.make_rng()
        if sampling is None:
            rng = None
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1) if _is_int_seq(prompt_ids) else None
        if ids is None:
            raise GenerationError("prompt ids must be a sequence of integers")
        if ids.size == 0:
            raise GenerationError("the prompt is empty: give at least one token")
        bad = ids[(ids < 0) | (ids >= self.vocab)]
        if bad.size:
            raise GenerationError(f"prompt token id {int(bad[0])} is outside the vocabulary [0, {self.vocab})")
        if ids.size > self.capacity:
            raise GenerationError(f"the prompt has {ids.size} tokens, more than the artifact's capacity "
                                  f"(--max-seq-len) of {self.capacity}")
        # A traced request (on_round) drafts every round, so that its rounds compare with the oracle's.
        guard = self.guard if tree is not None and on_round is None else None
        return Request(ids, max_new_tokens, tree, stop_on_eos, sampling, rng, on_round=on_round, tuned=tuned,
                       guard=guard)

    @property
    def free(self) -> int:
        return self.B - len(self.active)

    def join(self, req: Request, sink) -> Slot | None:
        """Prefill ``req`` in the next free slot and add it to the batch; None if it finished at once (its sink
        has been told). Call between rounds only."""
        if not self.free:
            raise RuntimeError("no free slot")
        n = len(req.prompt)
        stats = GenerationStats()
        s = Slot(req, StopRule(req.max_new_tokens, self.capacity - n, self.eos if req.stop_on_eos else None),
                 stats, sink, t_join=time.perf_counter(), prior=self.costs.prior(req.tree) if req.guard else None)
        if s.stop.room <= 0:
            sink.finish(GenerationResult([], "capacity", stats, n))
            return None
        j = len(self.active)
        if req.tree is not None:
            s.grower = self._take_grower(req.tree)
        if s.guard is not None:  # a runtime whose earlier requests on this tree lost starts it with plain rounds
            s.guard.start(self._cost_ratio(len(self.active) + 1, req.tree, n))
        self._fit(self.active + [s], extra={id(s): n})
        try:
            self._prefill(s, j)
        except BaseException:
            self._release_grower(s)
            raise
        stats.prefill_s = time.perf_counter() - s.t_join
        new, reason = s.stop.emit([s.root])
        if req.logprobs is not None and new:
            self._logprobs(s, [0], new)
        sink.push(new)
        if reason is not None:
            self._release_grower(s)
            self._finish(s, reason)
            return None
        self.active.append(s)
        return s

    def _release_grower(self, s: Slot) -> None:
        if s.grower is not None:
            self._growers[s.tree].append(s.grower)
            s.grower = None
            s.ready = s.dev = False

    def _take_grower(self, tree: TreeParams) -> TreeGrower:
        free = self._growers.setdefault(tree, [])
        return free.pop() if free else TreeGrower(tree)

    def _prefill(self, s: Slot, j: int) -> None:
        """The prompt in chunks, alone (batch 1) in slot j's regions; each chunk's draft context right after."""
        prompt, n = s.req.prompt, len(s.req.prompt)
        base_d = j * self.dplan.stride
        use_draft = s.req.tree is not None
        # Every chunk's context pass through the tree graph where the request's tree has one (the last one grows the
        # first round's tree in the same call; the others' trees go unread): it computes the MLP and the top-k of the
        # last row only, and a runtime whose requests draft well never opens the step graph (ort_backend). Not for a
        # request the guard starts with plain rounds: its draft needs the step graph's context rows.
        tree = use_draft and self._tree_fits(s) and not (s.guard is not None and s.guard.mode == PLAIN)
        for st in range(0, n, self.chunk):
            e = min(n, st + self.chunk)
            c, last = e - st, e == n
            self._ids.array[:c] = prompt[st:e]
            self._pos.array[:c] = self._arange[:c] + st
            self._causal(c, st)
            self._lidx.array[0] = c - 1
            self._run_target(1, c, 1, st, j)
            self.tkv.keep(j, st, c)
            if last:
                s.root = self._first_token(s)
            if use_draft:
                nxt = np.append(prompt[st + 1:e], s.root) if last else prompt[st + 1:e + 1]
                self._gather("dfeats_in", 0, "tfeats", self._arange[:c])
                self._ids.array[:c] = nxt
                self._pos.array[:c] = self._arange[:c] + st
                self._causal(c, st)
                if tree:
                    self._last_row.array[0] = c - 1
                    self._run_tree(1, c, st, s.k, s.depth, base_d)
                else:
                    self._run_draft(1, c, c, st, base_d)
                self.dcache.write(base_d + st, c)
                self._note_draft_positions(s, e - 1)
        if use_draft:
            if tree:
                self._load_tree(s, j, n, row=0)  # a prefill is a call of its own (batch 1)
            else:
                self._keep_context_row(j, c - 1)
        s.L = n

    def _causal(self, new: int, past: int) -> None:
        mask = self._mask.take((new, past + new))
        mask[:, :past] = True
        mask[:, past:] = self._tri[:new, :new] if new <= len(self._tri) else np.tri(new, dtype=np.bool_)

    def _first_token(self, s: Slot) -> int:
        return self._token_at(s, 0)

    def _token_at(self, s: Slot, r: int) -> int:
        """The token after logits row r: its argmax (greedy; on the device when the buffers live there) or a draw
        from its processed distribution with s's random source."""
        if s.req.sampling is None:
            if self.in_graph_accept:  # the verify engine's argmax of the row (its block, read once per call)
                tok = int(self.acceptance()["next_ids"][r])
                if not 0 <= tok < self.vocab:
                    raise ValueError(f"the verify engine's argmax read back as {tok}, outside the vocabulary (a read "
                                     "before the engine wrote it?)")
                return tok
            if self._np is not None:
                return int(self._np["logits"][r].argmax())
            return int(self.backend.to_host(self._t["logits"][r].argmax()))
        return sample_token(process_logits(self._rows_np("logits", r, r + 1)[0], s.req.sampling), s.req.rng)

    # ---- layout --------------------------------------------------------------------------------
    def _fit(self, slots: list[Slot], extra: dict | None = None) -> None:
        """Strides that hold every slot's rows for the next round (and a joining prompt); move regions if needed."""
        need_t = need_d = 0
        for s in slots:
            L = extra[id(s)] if extra and id(s) in extra else s.L
            need_t, need_d = max(need_t, L + s.slack_t), max(need_d, L + s.slack_d)
        plans = ((self.tkv.layout, self.tcache, need_t), (self.dplan, self.dcache, need_d))
        for plan, cache, need in plans:
            if plan is None:  # a cache whose slots have fixed regions
                continue
            need = min(need, plan.rows_per_slot)  # a finishing sequence alone goes past it (ScratchTargetKV.room)
            if need <= plan.stride < need + 2 * plan.step:  # surely LayoutPlan.wanted's no-move case (granule >= step)
                continue
            new = plan.wanted(need)
            if new != plan.stride:
                old = plan.stride
                for b in move_order(old, new, len(self.active)):
                    cache.move(b * old, b * new, self.active[b].L)
                plan.stride = new
                plan.moves += 1

    # ---- one round for every active slot -------------------------------------------------------
    def round(self, tuned: TreeParams | None | object = KEEP) -> list[Slot]:
        """One round: grow every slot's tree (one draft call per level), verify all trees in one target call,
        accept and commit per slot, one draft context call; returns the slots that finished (already removed).

        tuned: the tree of this round for the sequences without an explicit tree (``Request.tuned``), as the
        scheduler picks it from the artifact's per-batch table: a TreeParams, or None for a plain one-token round;
        KEEP: every sequence keeps the tree it has."""
        slots = self.active
        if not slots:
            return []
        t0 = time.perf_counter()
        self._t_draft = self._t_target = 0.0
        opened0 = self.backend.open_s  # a session opened in this round is not its cost
        if tuned is not KEEP:
            for s in slots:
                if s.req.tuned:
                    s.base = tuned if tuned is None else tuned.trimmed()
        if len(slots) == 1:
            s = slots[0]
            guarded = s.guard is not None and s.base is not None
            if s.base is None or (guarded and s.guard.mode == PLAIN):
                return self._plain_round(s, guarded, t0, opened0)
        for s in slots:
            # The guard may make a drafting request's round plain (its mode, decided after its last round).
            s.guarded = s.guard is not None and s.base is not None
            s.read_at = 0  # a speculative round may change the guard's state: its reads' schedule with it
            want = None if s.guarded and s.guard.mode == PLAIN else self._spec_tree(s)
            if s.tree != want:
                self._set_tree(s, want)
            s.leaving = False
        self._fit(slots)
        if any(s.lag and s.grower is not None for s in slots):  # drafting again: the draft cache catches up first
            self._draft_lag(slots, lambda s: s.grower is not None, grow=True)
        device = self.in_graph_accept and self._on_device(slots)
        drafting = [s for s in slots if s.grower is not None and not s.ready]
        if drafting:
            self._grow_tree(slots, drafting)
        for s in slots:
            if s.grower is not None:
                # a device round's verify tree is the tree engine's selection: no tree on the host
                s.vt = None if s.dev else s.grower.select(s.tree.total_tokens, s.root, s.tree.threshold)
                s.ready = False
                s.drafted = s.tree
        spec = [s.grower is not None for s in slots]
        tt = self._verify_on_device(slots) if device else self._verify(slots)
        for b, s in enumerate(slots):
            try:
                self._accept_and_commit(s, b, tt)
            except Exception as e:  # noqa: BLE001 - this request fails alone (its logits, its settings)
                s.error, s.tokens = e, []
        if self.guard is not None:
            self._judge(slots, spec)
        self._draft_context(slots, tt)
        if any(s.req.tree is not None and (s.grower is None or s.leaving) for s in slots):
            self._keep_lag(slots, tt)
        opened = self.backend.open_s - opened0  # inside a draft call's time
        self._t_draft = max(self._t_draft - opened, 0.0)
        self._account(slots, spec, time.perf_counter() - t0 - opened)
        return self._retire()

    def _plain_round(self, s: Slot, guarded: bool, t0: float, opened0: float) -> list[Slot]:
        """``round`` for one sequence whose round has no draft: one that never drafts (``--no-draft``, an artifact
        whose default is no draft), or one the guard runs plain (``guarded``). What ``round`` does for it (its
        one-row verify, ``_plain_step``, the guard's verdict, the lag rows of a request that can draft, the
        accounting), without the steps that have nothing to do (tree growth and selection, the draft's context
        pass). On a small model the loop's own host work is a tenth of a plain step, and those steps were half of
        it."""
        s.guarded, s.leaving = guarded, False
        if s.tree is not None:
            self._set_tree(s, None)
        self._fit(self.active)
        L = s.L
        self._ids.array[0], self._pos.array[0], self._lidx.array[0] = s.root, L, 0
        self._mask.array[:L + 1] = True  # the [1, 1, L + 1] mask: every committed row and the root
        self.padding.add(L, L)
        self.tkv.wrote(0, L)
        self._run_target(1, 1, 1, L)
        s.stats.rounds += 1
        try:
            self._plain_step(s, 0, 0)
        except Exception as e:  # noqa: BLE001 - as in round: this request fails alone
            s.error, s.tokens = e, []
        if guarded:
            self._judge([s], [False])
        if s.reason is None and s.error is None:  # as the end of _draft_context
            s.L += 1
            s.root = s.tokens[-1]
        if s.req.tree is not None:  # a request that can draft: the draft reads this token later
            self._keep_lag([s], 1)
        opened = self.backend.open_s - opened0
        self._account([s], [False], time.perf_counter() - t0 - opened)
        return self._retire()

    def _judge(self, slots: list[Slot], spec: list[bool]) -> None:
        """The guard's verdict for every guarded slot that goes on: its next round's mode, from what this round
        committed and what a speculative round costs (``RoundCosts``). A slot that stops speculating skips this
        round's tree growth: its tokens go to the lag rows instead (``_keep_lag``)."""
        a = len(slots)
        rows = max(s.L for s in slots)
        for b, s in enumerate(slots):
            if not s.guarded or s.reason is not None or s.error is not None:
                continue
            before = s.guard.switches
            committed: float = len(s.tokens)
            # a plain round only counts down (or ends a calibration): no cost figure needed
            ratio = self._cost_ratio(a, s.base, rows) if spec[b] else None
            c = s.chain if spec[b] else None
            if c is not None:
                measured = self._chain_costs(a, s)
                if s.drafted != s.base:  # the guard judges the base chain: this round's tokens in its cost's units
                    ran, base = c.cost(s.drafted, measured), c.cost(s.base, measured)
                    if ran and base:
                        committed *= base / ran
                        if ratio is None:  # the base not run lately: its ratio from the chain that ran
                            r = self._cost_ratio(a, s.drafted, rows)
                            ratio = None if r is None else r * base / ran
            if spec[b]:
                self.costs.note_tau(s.base, committed)
            nxt = s.guard.after(SPEC if spec[b] else PLAIN, committed, ratio)
            if c is not None and not s.guard.calibrating:
                # the next round's chain, grown at this round's end; a request the guard was leaving that moves to
                # the other chain is judged afresh on it (Guard.rejudge)
                t = c.after(s.drafted, len(s.tokens) - 1, measured)
                if t != s.tree:
                    if s.guard.switches > before:
                        nxt = s.guard.rejudge()
                    if nxt == SPEC:
                        self._set_tree(s, t)
            s.stats.guard_switches += s.guard.switches - before
            s.leaving = spec[b] and nxt == PLAIN

    def _spec_tree(self, s: Slot) -> TreeParams | None:
        """The tree slot s drafts with in a speculative round: its base, or for a guarded chain the chain its
        ``ChainLength`` picked (a backend whose tree engines grow a fixed depth gains nothing from a shorter chain's
        draft: none there)."""
        if s.chain_base != s.base:
            s.chain_base = s.base
            short = (short_of(s.base, self.guard.chain_short) if s.guard is not None and s.base is not None
                     and not self._fixed_depth else None)
            s.chain = None if short is None else ChainLength(s.base, short)
        return s.base if s.chain is None else s.chain.tree

    def _chain_costs(self, active: int, s: Slot):
        """A chain's measured round cost, as slot s's ``ChainLength`` reads it: the median wall time of its recent
        rounds (``RoundCosts.spec_seconds``), or with the guard's pinned ``cost_ratio`` that ratio for the base alone
        (the short chain's is then modelled from it, ``ChainLength.cost``)."""
        pinned = self.guard.cost_ratio
        if pinned is not None:
            return lambda t, n: pinned if t == s.base else None
        return lambda t, n: self.costs.spec_seconds(active, t, n)

    def _cost_ratio(self, active: int, tree: TreeParams, rows: int) -> float | None:
        """A speculative round's cost in plain rounds, as the guard reads it (None: no fresh plain figure)."""
        if self.guard.cost_ratio is not None:
            return self.guard.cost_ratio
        if self.costs.stale(active, rows):
            return None
        return self.costs.ratio(active, tree)

    def _account(self, slots: list[Slot], spec: list[bool], wall: float) -> None:
        """The round's figures into every slot's stats (a batched round's graph and host time counts for each of its
        sequences) and its wall time into ``costs``, keyed by its drafting sequences' tree (None: none drafted)."""
        draft, target = self._t_draft, self._t_target
        host = max(wall - draft - target, 0.0)
        for b, s in enumerate(slots):
            st = s.stats
            st.spec_flags.append(spec[b])
            if spec[b]:
                n = s.vt.num_nodes if s.vt is not None else s.drafted.total_tokens + 1
                if s.chain is not None and s.drafted == s.chain.short:
                    st.short_rounds += 1
                st.spec_rounds += 1
                st.drafted_tokens += n - 1
                st.spec_drafts.append(n - 1)
                st.verified_tokens += n
            else:
                st.plain_rounds += 1
                st.verified_tokens += 1
            st.draft_s += draft
            st.target_s += target
            st.host_s += host
        if len(slots) == 1:  # most rounds (a plain step is ~1 ms on a small model: its host work counts)
            s = slots[0]
            if not spec[0] or s.tree is s.drafted or s.tree is None:  # a chain switch's round: verify and draft differ
                self.costs.record(1, s.drafted if spec[0] else None, wall, s.L)
            return
        trees = {s.drafted for s, sp in zip(slots, spec, strict=True) if sp}
        key = None if not trees else trees.pop() if len(trees) == 1 else MIXED
        self.costs.record(len(slots), key, wall, max(s.L for s in slots))

    def _grow_tree(self, slots: list[Slot], drafting: list[Slot]) -> None:
        """Every drafting slot's tree, level by level: one draft call per level feeds every slot's frontier (a
        slot whose tree is shallower or narrower pads, as does one whose tree the tree graph grew already); then
        each slot's verify tree is selected."""
        a = len(slots)
        kk = max(s.k for s in drafting)
        depth = max(s.depth for s in drafting)
        grow = [s.grower is not None and not s.ready for s in slots]
        for b, s in enumerate(slots):
            if grow[b]:
                s.grower.reset()
                s.frontier = s.grower.add_root_children(self.ctx_vals[b], self.ctx_ids[b])
        stride = self.dplan.stride
        np_out = self._np
        for level in range(1, depth + 1):
            one = slots[0]
            past = one.L + one.frontier.fed if a == 1 else stride
            mask = self._mask.take((a, kk, past + kk))
            if a > 1:  # one slot's rows are written whole below
                mask[:] = False
            ids = self._ids.array[:a * kk].reshape(a, kk)
            pos = self._pos.array[:a * kk].reshape(a, kk)
            bound = used = 0
            for b, s in enumerate(slots):
                fr = s.frontier
                k = s.k if grow[b] and s.depth >= level else 0
                if k:
                    fed, L = fr.fed, s.L
                    if level == 1:
                        self._set_hidden_in(b * kk, k, b)
                    else:
                        self._gather("dhidden_in", b * kk, "dhidden", fr.parent_rows + b * kk)
                    ids[b, :k] = fr.tokens
                    pos[b, :k] = L + level - 1
                    mask[b, :k, :L] = True
                    mask[b, :k, L:L + fed] = fr.tree_mask[:, :fed]
                    mask[b, :k, past:past + k] = fr.tree_mask[:, fed:]
                    used += L + fed
                for i in range(k, kk):  # padding rows: see only themselves
                    ids[b, i] = 0
                    pos[b, i] = s.L
                    mask[b, i, past + i] = True
                bound += past
            self.padding.bound += bound
            self.padding.used += used
            self._run_draft(a, kk, 0, past)
            for b, s in enumerate(slots):
                if not grow[b] or s.depth < level:
                    continue
                k, r0 = s.k, b * kk
                self.dcache.write(b * stride + s.L + s.frontier.fed, k, src=r0)
                self._note_draft_positions(s, s.L + level - 1)
                if np_out is not None:
                    s.frontier = s.grower.add_children(np_out["dvals"][r0:r0 + k], np_out["dids"][r0:r0 + k])
                else:
                    s.frontier = s.grower.add_children(self._rows_np("dvals", r0, r0 + k),
                                                       self._rows_np("dids", r0, r0 + k))

    def _verify(self, slots: list[Slot]) -> int:
        """Every slot's tree (without a draft: its root alone) through the target in one call; returns the
        call's rows per slot (the widest tree)."""
        a = len(slots)
        sizes = [s.vt.num_nodes if s.grower is not None else 1 for s in slots]
        tt = max(sizes)
        if self.tkv.per_sequence_trees and a > 1 and tt > 1:
            return self._verify_each(slots, sizes, tt)
        past = slots[0].L if a == 1 else self.tkv.batch_past([s.L for s in slots])
        mask = self._mask.take((a, tt, past + tt))
        if a > 1:  # one slot's rows are written whole below
            mask[:] = False
        ids = self._ids.array[:a * tt].reshape(a, tt)
        pos = self._pos.array[:a * tt].reshape(a, tt)
        lidx = self._lidx.array[:a * tt].reshape(a, tt)
        lidx[:] = self._arange[:tt]
        used = 0
        for b, s in enumerate(slots):
            L, T = s.L, sizes[b]
            if s.grower is None:  # no draft: the root alone, at position L
                ids[b, 0] = s.root
                pos[b, 0] = L
                mask[b, 0, :L] = True
                mask[b, 0, past] = True
            else:
                vt = s.vt
                ids[b, :T] = vt.tokens
                np.add(vt.depths, L, out=pos[b, :T])
                mask[b, :T, :L] = True
                mask[b, :T, past:past + T] = vt.mask
            for i in range(T, tt):
                ids[b, i] = 0
                pos[b, i] = L
                mask[b, i, past + i] = True
            used += L
        self.padding.bound += a * past
        self.padding.used += used
        for b in range(a):  # where this call's rows were written (an in-place cache's commit moves them from there)
            self.tkv.wrote(b, past)
        self._run_target(a, tt, tt, past)
        for s in slots:
            s.stats.rounds += 1
        return tt

    def _verify_on_device(self, slots: list[Slot]) -> int:
        """The verify of a device round (``_on_device``): its inputs made on the device from each slot's selection
        (the root, then the selected nodes by score: their tokens, positions L + depth, and a mask of the committed
        rows, the root and each node's ancestors; a slot without a draft, its root alone; padding rows see only
        themselves), as ``_verify`` lays them out, then the verify engine, which also accepts. Nothing is read."""
        a = len(slots)
        sizes = [s.tree.total_tokens + 1 if s.dev else 1 for s in slots]
        tt = max(sizes)
        past = slots[0].L if a == 1 else self.tkv.batch_past([s.L for s in slots])
        sel = self._slot_sel
        ids = self._dev_ids[:a * tt].view(a, tt)
        pos = self._dev_pos[:a * tt].view(a, tt)
        mask = self._dev_mask[:a * tt * (past + tt)].view(a, tt, past + tt)
        if a > 1 or tt > sizes[0]:
            ids.zero_()
            mask.fill_(False)
        for b, s in enumerate(slots):
            L, T = s.L, sizes[b]
            ids[b, :1].fill_(s.root)
            pos[b].fill_(L)
            mask[b, :T, :L].fill_(True)  # the committed rows and the root
            mask[b, :T, past].fill_(True)
            if T > 1:
                ids[b, 1:T].copy_(sel["tokens"][b, :T - 1])
                pos[b, 1:T].add_(sel["depths"][b, :T - 1])
                mask[b, 0, past + 1:].fill_(False)
                mask[b, 1:T, past + 1:past + T].copy_(sel["mask"][b, :T - 1, :T - 1])
            for i in range(T, tt):  # padding rows: see only themselves
                mask[b, i, past + i] = True
        self._lidx.array[:a * tt].reshape(a, tt)[:] = self._arange[:tt]
        self.padding.add(a * past, sum(s.L for s in slots))
        for b in range(a):
            self.tkv.wrote(b, past)
        self._run_target(a, tt, tt, past, device_inputs=True)
        for s in slots:
            s.stats.rounds += 1
        return tt

    def _verify_each(self, slots: list[Slot], sizes: list[int], tt: int) -> int:
        """Several sequences with trees on a cache that takes them one per call (``per_sequence_trees``: the fused
        graph, whose GroupQueryAttention writes more than one row over a past for one sequence per call only): each
        sequence's tree is a call of its own (exactly its rows over exactly its committed ones: no padding), its
        logits and features at rows [b * tt, b * tt + T) of the batch's buffers, as one call over the batch would
        leave them."""
        used = 0
        for b, s in enumerate(slots):
            L, T = s.L, sizes[b]
            ids, pos = self._ids.array[:T], self._pos.array[:T]
            mask = self._mask.take((1, T, L + T))
            mask[0, :, :L] = True
            if s.grower is None:
                ids[0], pos[0] = s.root, L
                mask[0, 0, L] = True
            else:
                vt = s.vt
                ids[:] = vt.tokens
                np.add(vt.depths, L, out=pos)
                mask[0, :, L:] = vt.mask
            self._lidx.array[:T] = self._arange[:T]
            self.tkv.wrote(b, L)
            self._run_target(1, T, T, L, b, b * tt)
            used += L
            s.stats.rounds += 1
        self.padding.bound += used
        self.padding.used += used
        return tt

    def _accept_and_commit(self, s: Slot, b: int, tt: int) -> None:
        """Slot b's accepted path (greedy, or sampled with its own random source), its K/V rows into
        the target cache after its committed rows, and its new tokens through its stop rule to its sink."""
        r0 = b * tt
        if s.grower is None:
            self._plain_step(s, b, r0)
            return
        vt = s.vt
        if vt is None:  # a device round: the verify engine accepted (one read: the count, the path, its argmaxes)
            got = self.acceptance()
            n, T = int(got["count"][b]), s.tree.total_tokens + 1
            rows = got["rows"][r0:r0 + n + 1].copy()
            if not 0 <= n < T or rows.min() < 0 or rows.max() >= T:
                raise ValueError(f"the verify engine's acceptance read back as {n} accepted tokens on rows "
                                 f"{rows.tolist()} of a {T}-node tree (a read before the engine wrote it?)")
            nxt = got["next_ids"][r0:r0 + tt]
            s.acc = acc = Accepted(indices=rows, tokens=nxt[rows[:-1]], bonus=int(nxt[rows[-1]]))
            s.stats.accept_lengths.append(n)
            self._commit_accepted(s, b, r0, acc)
            return
        T = vt.num_nodes
        if s.req.sampling is None:
            if self.in_graph_accept:  # the verify engine's argmaxes (the block a target call is read in)
                best = self.acceptance()["next_ids"][r0:r0 + T]
            elif self._np is not None:
                best = self._np["logits"][r0:r0 + T].argmax(-1)
            else:
                best = self.backend.to_host(self._t["logits"][r0:r0 + T].argmax(-1))
            acc = accept_greedy(vt, best)
        else:
            acc = accept_sampling(vt, LazyProbs(lambda i: self._rows_np("logits", r0 + i, r0 + i + 1)[0], T,
                                                s.req.sampling), s.req.rng)
        s.acc = acc
        s.stats.accept_lengths.append(int(acc.num_accepted))
        if s.req.on_round is not None and s.grower is not None:
            s.req.on_round(vt, acc)
        self._commit_accepted(s, b, r0, acc)

    def _commit_accepted(self, s: Slot, b: int, r0: int, acc: Accepted) -> None:
        """The accepted path's K/V rows into the target cache; its tokens through the stop rule to the sink."""
        self.tkv.commit(b, s.L, acc.indices, r0, b == len(self.active) - 1)
        s.tokens = [int(x) for x in acc.tokens] + [int(acc.bonus)]
        new, s.reason = s.stop.emit(s.tokens)
        if s.req.logprobs is not None and new:
            self._logprobs(s, r0 + acc.indices, new)
        if new:
            s.sink.push(new)

    def _plain_step(self, s: Slot, b: int, r0: int) -> None:
        """No draft: the next token from the root's logits row (argmax, or a draw from its processed
        distribution), the root's K/V row into the cache."""
        tok = self._token_at(s, r0)
        s.stats.accept_lengths.append(0)
        self.tkv.commit_root(b, s.L, r0, b == len(self.active) - 1)
        s.tokens = [tok]
        new, s.reason = s.stop.emit(s.tokens)
        if s.req.logprobs is not None and new:
            self._logprobs(s, [r0], new)
        if new:
            s.sink.push(new)

    def _logprobs(self, s: Slot, rows, new: list[int]) -> None:
        """Only for a request that asked (``Request.logprobs``), before its tokens are pushed: the kept tokens'
        log-probabilities under the target's raw distribution, from the logits rows that produced them (``rows``,
        in token order: the verify rows of the accepted path, root first), to ``sink.push_logprobs``."""
        rows = np.asarray(rows[:len(new)], dtype=np.int64)
        lo = int(rows.min())
        block = self._rows_np("logits", lo, int(rows.max()) + 1)
        s.sink.push_logprobs(token_logprobs(block[rows - lo], new, s.req.logprobs))

    def _draft_context(self, slots: list[Slot], tt: int) -> None:
        """Draft context for every continuing drafting slot: (feature of root/accepted node, next token)."""
        a = len(slots)
        go = [s.grower is not None and not s.leaving and s.reason is None and s.error is None for s in slots]
        widths = [len(s.tokens) if g else 0 for s, g in zip(slots, go, strict=True)]
        mm = max(widths)
        stride = self.dplan.stride
        # A tree graph grows every continuing slot's next tree in this call, when one graph (one top_k) can grow all
        # of them: cut to the deepest, a shallower tree reads its first levels' candidates.
        growing = [s for s, g in zip(slots, go, strict=True) if g]
        tree = (bool(self.tree_depths) and all(self._tree_fits(s) for s in growing)
                and len({s.k for s in growing}) <= 1)
        if mm:
            past = slots[0].L if a == 1 else stride
            mask = self._mask.take((a, mm, past + mm))
            if a > 1:  # one slot's rows are written whole below
                mask[:] = False
            ids = self._ids.array[:a * mm].reshape(a, mm)
            pos = self._pos.array[:a * mm].reshape(a, mm)
            used = 0
            for b, s in enumerate(slots):
                m, L = widths[b], s.L
                if m:
                    self._gather("dfeats_in", b * mm, "tfeats", s.acc.indices + b * tt)
                    used += L
                self._context_rows(ids, pos, mask, b, m, mm, past, L, s.tokens, L)
            self.padding.bound += a * past
            self.padding.used += used
            if tree:
                self._last_row.array[:a] = [max(m - 1, 0) for m in widths]  # a padding row for a slot that stops
                self._run_tree(a, mm, past, growing[0].k, max(s.depth for s in growing))
            else:
                self._run_draft(a, mm, mm, past)
            for b, s in enumerate(slots):
                m = widths[b]
                if m:
                    self.dcache.write(b * stride + s.L, m, src=b * mm)
                    self._note_draft_positions(s, s.L + m - 1)
                    if tree:
                        self._load_tree(s, b, s.L + m)
                    else:
                        self._keep_context_row(b, b * mm + m - 1)
        for s in slots:
            if s.reason is None and s.error is None:
                s.L += len(s.tokens)
                s.root = s.tokens[-1]

    def _context_rows(self, ids, pos, mask, b: int, m: int, mm: int, past: int, start: int, tokens,
                      pad_pos: int) -> None:
        """Slot b's rows of a context pass: its m tokens at positions [start, start + m), each seeing the slot's
        committed rows [0, start) and the context rows up to itself; rows [m, mm) padding that sees only itself."""
        if m:
            ids[b, :m] = tokens
            pos[b, :m] = self._arange[start:start + m]
            mask[b, :m, :start] = True
            mask[b, :m, past:past + m] = self._tri[:m, :m]
        for i in range(m, mm):
            ids[b, i] = 0
            pos[b, i] = pad_pos
            mask[b, i, past + i] = True

    def _retire(self) -> list[Slot]:
        """Remove finished (or failed) slots; the last active slot moves into each freed one."""
        done = [s for s in self.active if s.reason is not None or s.error is not None]
        for s in done:
            self._remove(s)
            if s.error is not None:
                s.sink.fail(s.error)
            else:
                self._finish(s, s.reason)
        return done

    def _remove(self, s: Slot) -> None:
        """Free s's slot: the last active slot moves into it (its cache regions and context row)."""
        b = self.active.index(s)
        last = len(self.active) - 1
        if b != last:
            t = self.active[last]
            self.tkv.move_slot(last, b, t.L)
            self.dcache.move(last * self.dplan.stride, b * self.dplan.stride, t.L)
            self.ctx_vals[b], self.ctx_ids[b] = self.ctx_vals[last], self.ctx_ids[last]
            self.ctx_hidden[b].copy_(self.ctx_hidden[last])
            if t.dev:  # its tree selected on the device, and its context row's top-k
                K = self.ctx_vals.shape[1]
                for v in self._slot_sel.values():
                    v[b].copy_(v[last])
                for v in self._slot_ctx.values():
                    v[b * K:(b + 1) * K].copy_(v[last * K:(last + 1) * K])
            if t.lag:
                P = self._lag_rows
                self._gather("lagfeats", b * P, "lagfeats", self._arange[last * P:last * P + len(t.lag)])
            self.active[b] = t
        self.active.pop()
        self._release_grower(s)

    # ---- per-batch trees: a sequence's tree may change between rounds ------------------------
    def _set_tree(self, s: Slot, tree: TreeParams | None) -> None:
        """Give slot s another tree for its next rounds (None: no draft), trading its grower (and a tree the tree graph
        grew for the old one) for one of that tree."""
        self._release_grower(s)
        s.set_tree(tree)
        if tree is not None:
            s.grower = self._take_grower(tree)

    def _keep_lag(self, slots: list[Slot], tt: int) -> None:
        """After a round: a continuing sequence that can draft but had no draft this round keeps its root's target
        feature and its new token for the draft's context pass (``_draft_lag``), run when it drafts again or
        when its lag rows are nearly full; one the guard has just turned plain (``Slot.leaving``) keeps its accepted
        path's features and tokens the same way, as its context pass would have fed them."""
        P = self._lag_rows
        for b, s in enumerate(slots):
            if s.req.tree is not None and (s.grower is None or s.leaving) and s.reason is None and s.error is None:
                rows = s.acc.indices + b * tt if s.leaving else self._arange[b * tt:b * tt + 1]
                self._gather("lagfeats", b * P + len(s.lag), "tfeats", rows)
                s.lag.extend(s.tokens)
        if all(len(s.lag) < s.read_at for s in slots):
            return  # the usual plain round: nothing is due before read_at, the figures are not looked at

        def due(s: Slot) -> bool:
            if s.reason is not None or s.error is not None:
                return False
            s.read_at = self._read_at(s, len(slots))
            return len(s.lag) >= s.read_at
        t0, opened0 = time.perf_counter(), self.backend.open_s
        if self._draft_lag(slots, due):
            opened = self.backend.open_s - opened0  # a session opened for it is not its cost
            self.costs.record_read(len(slots), time.perf_counter() - t0 - opened, max(s.L for s in slots))

    def _read_at(self, s: Slot, active: int) -> int:
        """The lag tokens from which slot s's lag rows are read: a flush, while the next round's rows still fit (a
        round adds at most max_context_rows), or a guarded slot's shadow read in plain rounds (``Guard.read_need``,
        spaced by what a read costs as measured; not with a pinned cost ratio: then only tokens decide), which tells
        its guard how the draft did. Kept in ``Slot.read_at`` until the lag reaches it or the slot's guard state
        changes (a read, a speculative round): a read's cost that falls meanwhile moves a read later, never
        earlier."""
        at = self._lag_rows - self.m.tree_limits.max_context_rows + 1
        g = s.guard
        need = None if g is None else g.read_need()
        if need is not None and need < at:
            if g.policy.cost_ratio is None:  # measured
                need = g.read_need(self.costs.read_ratio(active))
            at = min(at, need)
        return at

    def _draft_lag(self, slots: list[Slot], due, grow: bool = False) -> bool:
        """The draft's context pass over the lagging tokens of the slots ``due`` selects, in one call (as
        ``_draft_context`` over a round's accepted tokens): their draft cache rows, then their context row. grow:
        those slots draft this round: where the draft tree graph can grow all their trees, the same call grows
        them (one call, as after a speculative round). Returns whether it ran a call."""
        widths = [len(s.lag) if s.lag and due(s) else 0 for s in slots]
        mm = max(widths)
        if not mm:
            return False
        a, P, stride = len(slots), self._lag_rows, self.dplan.stride
        drafting = [s for s, m in zip(slots, widths, strict=True) if m]
        tree = (grow and bool(self.tree_depths) and all(self._tree_fits(s) for s in drafting)
                and len({s.k for s in drafting}) <= 1)
        past = slots[0].L - widths[0] if a == 1 else stride
        mask = self._mask.take((a, mm, past + mm))
        if a > 1:
            mask[:] = False
        ids = self._ids.array[:a * mm].reshape(a, mm)
        pos = self._pos.array[:a * mm].reshape(a, mm)
        used = 0
        for b, s in enumerate(slots):
            m = widths[b]
            L0 = s.L - m  # the lagging tokens' rows are [L0, L)
            if m:
                self._gather("dfeats_in", b * mm, "lagfeats", self._arange[b * P:b * P + m])
                used += L0
            self._context_rows(ids, pos, mask, b, m, mm, past, L0, s.lag, s.L)
        self.padding.add(a * past, used)
        if tree:
            self._last_row.array[:a] = [max(m - 1, 0) for m in widths]
            self._run_tree(a, mm, past, drafting[0].k, max(s.depth for s in drafting))
        else:
            self._run_draft(a, mm, mm, past)
        for b, s in enumerate(slots):
            m = widths[b]
            if m:
                self.dcache.write(b * stride + s.L - m, m, src=b * mm)
                self._note_draft_positions(s, s.L - 1)
                if tree:
                    self._load_tree(s, b, s.L)
                else:
                    self._keep_context_row(b, b * mm + m - 1)
                    if s.guard is not None and s.guard.mode == PLAIN and s.base is not None and m > 1:
                        self._shadow(s, b * mm, a)
                s.lag.clear()
                s.read_at = 0
        return True

    def _shadow(self, s: Slot, r0: int, active: int) -> None:
        """A guarded slot in plain rounds: the lag's context pass just predicted, at each of its rows, the token after
        the next (its top-k ids, rows [r0, r0 + m)); how often the base tree's top_k held the real one (the next lag
        token) over the last ``shadow_window`` of them is the draft's depth-1 acceptance on the text the next rounds
        continue, which the guard reads (``Guard.shadow``). The last ones, not all: a read 30 tokens after a switch
        that averaged a bad stretch with the perfect one after it kept a request plain that would have paid."""
        lag, k = s.lag, s.base.top_k
        n = min(len(lag) - 1, s.guard.policy.shadow_window)
        start = len(lag) - 1 - n  # rows [r0 + start, r0 + len(lag) - 1) predict lag[start + 1:]
        ids = self._rows_np("dids", r0 + start, r0 + len(lag) - 1)[:, :k]
        hits = sum(int(t in row) for t, row in zip(lag[start + 1:], ids.tolist(), strict=True))
        s.guard.shadow(hits, n, s.base.depth, self._cost_ratio(active, s.base, s.L))

    def _finish(self, s: Slot, reason: str) -> None:
        s.stats.decode_s = time.perf_counter() - s.t_join - s.stats.prefill_s
        s.sink.finish(GenerationResult(list(s.stop.out), reason, s.stats, len(s.req.prompt)))

    # ---- one sequence -------------------------------------------------------------------------
    def check_prompt(self, prompt_ids) -> np.ndarray:
        return self.check(prompt_ids, 1, use_draft=False).prompt

    def run(self, prompt_ids, max_new_tokens: int, tree: TreeParams | None = None, use_draft: bool = True,
            stop_on_eos: bool = True, sampling: SamplingParams | None = None,
            rng: np.random.Generator | None = None, on_round=None) -> PyGenerator[list[int], None, GenerationResult]:
        """One sequence through the same steps (a batch of one): yield committed tokens as they are accepted;
        return the GenerationResult. Settings are checked here, before the first token.

        sampling: None or temperature 0 = greedy. Otherwise tokens are sampled from the target's
        processed distribution, drawing from ``rng`` (default: a new one from ``sampling.seed``,
        owned by this request).

        on_round: optional trace hook, called after each verify round's acceptance with the round's
        ``VerifyTree`` and ``Accepted`` (read them in the call; their arrays are reused). Used by
        ``validate`` and the tests to compare rounds with the PyTorch oracle (runtime/oracle.py).
        """
        req = self.check(prompt_ids, max_new_tokens, tree, use_draft, stop_on_eos, sampling, rng, on_round)
        return self._solo(req)

    def _solo(self, req: Request):
        if self.active:
            raise GenerationError("this generator is serving a batch: submit the request to its scheduler")
        sink = _Collect()
        slot = self.join(req, sink)
        try:
            if sink.tokens:
                yield sink.take()
            while slot is not None and slot in self.active:
                self.round(self.m.batch_trees.pick(1) if req.tuned else KEEP)
                if sink.tokens:
                    yield sink.take()
        finally:
            if slot is not None and slot in self.active:  # closed early: the slot is freed, its rows forgotten
                self._remove(slot)
        if sink.error is not None:
            raise sink.error
        return sink.result

    def fail_all(self, exc: BaseException) -> None:
        """A graph call failed: every active request fails with it (none of them can go on)."""
        for s in self.active:
            self._release_grower(s)
            s.sink.fail(exc)
        self.active = []


class _Collect:
    """The sink of a sequence run alone: tokens since the last yield, then its result or error."""

    def __init__(self):
        self.tokens: list[int] = []
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None

    def push(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def take(self) -> list[int]:
        out, self.tokens = self.tokens, []
        return out

    def finish(self, result: GenerationResult) -> None:
        self.result = result

    def fail(self, exc: BaseException) -> None:
        self.error = exc


def _is_int_seq(x) -> bool:
    try:
        a = np.asarray(x)
    except Exception:  # noqa: BLE001 - anything numpy cannot read is not a list of ids
        return False
    return a.dtype.kind in "iu" or (a.size == 0 and a.dtype.kind == "f")
