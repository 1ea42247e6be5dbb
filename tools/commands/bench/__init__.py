"""`eagle-export bench`: EAGLE against `--no-draft` on the same runtime, side by side in one run.

    from eagle_export.tools.commands.bench import bench
    report = bench("artifacts/tiny", max_new_tokens=64, threads=1)
    print(report.format())            # or json.dumps(report.to_dict())

For each prompt, one greedy EAGLE generation and one greedy `--no-draft` generation run on the same
runtime (the order alternates from prompt to prompt), after one warm-up generation of each mode;
``repeats`` > 1 does this R times over the prompts and reports per-prompt medians.
Generations ignore EOS (``stop_on_eos=False``) unless ``stop_at_eos``: then each stops at its first EOS, as the
reference implementation and transformers do. Either way both runs of a prompt can be compared (``lossless``).

``peer="ort-genai"`` adds ORT GenAI's greedy decoding of the same target (tools/commands/bench/peer.py) as a
third mode, interleaved with ours, with its tokens compared to our plain decoding's.

What is measured (see docs/bench.md):

- tau: committed tokens per target forward (bonus included) over every EAGLE round of every prompt, each round
  counted whole (accepted + 1), also the last one where the length or EOS cut its tokens: the reference's count;
- n-alpha: for d = 1 .. depth + 1, the fraction of rounds that accepted >= d draft tokens among the
  rounds that accepted >= d - 1 (None when no round got that far);
- tokens/s: generated tokens / (prefill_s + decode_s) per generation; the median over prompts;
- speedup: the median over prompts of eagle tokens/s / no-draft tokens/s;
- the split of EAGLE's decode time into draft graph calls, target graph calls and host work (the rest),
  timed by a proxy around the runtime's backend, installed for the bench only (no-draft's: target and host);
- with a peer: its tokens/s, the per-prompt ratios ours / peer (medians), and its tokens against our no-draft ones;
- peak memory: the process's peak resident set size (``resource.getrusage(...).ru_maxrss``).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle_export.errors import EagleExportError, GenerationError
from eagle_export.prompts import PromptSpec, prompt_ids, read_prompts  # the shared prompt-file reader
from eagle_export.runtime.results import tau
from eagle_export.runtime.timing import TimingBackend, TimingInstalled
from eagle_export.tree_params import TreeParams, tree_over_defaults

from .peer import choose_unused_id, first_divergence

# Built-in prompts: text when the artifact has a tokenizer, else id prompts (taken modulo the vocabulary).
TEXT_PROMPTS = ["The quick brown fox", "def main():", "Once upon a time", "import numpy as np"]
ID_PROMPT_RULES = [(7, 3, 12), (5, 4, 20), (11, 1, 8), (3, 2, 16)]  # ids (a * i + b) % vocab, i < n


class BenchError(EagleExportError):
    """A bad bench request: bad settings, --plot without matplotlib (prompt files: eagle_export.prompts)."""


MODES = ("eagle", "no_draft", "peer")  # the measured modes, in the order the rotation starts from
# With a peer, a pause after every run, outside the timings. ONNX Runtime's threads spin on after a call under the
# peer's own policy (onnxruntime-genai leaves spinning on), and took a core from whatever ran next: measured on the
# int4 fixture, our EAGLE runs that followed went from 1326-1392 tok/s with this pause to 1044-1065 without it, the
# peer and our no-draft runs unchanged (docs/bench.md, "The peer"). The peer's process burns a core for 50-60 ms after
# its last call (its own CPU time, sampled after a 64-token run of the fp32 fixture: 48-54 ms in the first 50 ms), so
# the pause outlasts that.
SETTLE_S = 0.1


# ---- prompts -----------------------------------------------------------------------------------


def builtin_prompts(has_tokenizer: bool, vocab: int) -> list[PromptSpec]:
    if has_tokenizer:
        return [PromptSpec(f"builtin {i + 1}", text=t) for i, t in enumerate(TEXT_PROMPTS)]
    return [PromptSpec(f"builtin {i + 1}", ids=tuple((a * j + b) % vocab for j in range(n)))
            for i, (a, b, n) in enumerate(ID_PROMPT_RULES)]


# ---- report ------------------------------------------------------------------------------------


@dataclass
class _Run:
    tokens: list[int]
    rounds: int
    accept_lengths: list[int]
    prefill_s: float
    decode_s: float
    draft_s: float  # draft graph calls during decode
    target_s: float  # target graph calls during decode
    spec_rounds: int = 0  # rounds that drafted (the guard, or a no-draft default, may make others plain)
    spec_accept_lengths: list[int] = field(default_factory=list)  # accepted draft tokens per drafting round
    spec_drafts: list[int] = field(default_factory=list)  # draft tokens verified per drafting round
    short_rounds: int = 0  # drafting rounds of a guarded chain's short chain (runtime/chain_length.py)

    @property
    def tok_s(self) -> float:
        return len(self.tokens) / max(self.prefill_s + self.decode_s, 1e-12)


# A divergence where no-draft's two best logits were closer than this is a near-tie: rounding can decide it (on the
# fixture, int4 kernels moved logits by up to 0.02 between a row decoded alone and the same row verified;
# tools/lab/results.md, "Why quantized EAGLE diverged"). A larger margin points at a bug.
NEAR_TIE = 0.05


@dataclass
class Divergence:
    """Where EAGLE's tokens first differ from no-draft's on one prompt, and how close no-draft's choice was there."""

    token: int  # index among the generated tokens (0: the prefill's token)
    position: int  # the sequence position it was generated at: prompt tokens + token
    eagle: int | None  # EAGLE's token there (None: EAGLE stopped before it)
    no_draft: int | None  # no-draft's token there (None: no-draft stopped before it)
    margin: float | None  # no-draft's top-2 logit margin there (None: not measured)

    @property
    def near_tie(self) -> bool | None:
        return None if self.margin is None else self.margin < NEAR_TIE

    def describe(self) -> str:
        what = (f"at generated token {self.token} (position {self.position}): EAGLE {self.eagle}, no-draft "
                f"{self.no_draft}")
        if self.margin is None:
            return what
        kind = ("a near-tie: kernel rounding can decide it" if self.near_tie
                else f"not a near-tie (>= {NEAR_TIE}): look for a bug")
        return f"{what}; no-draft top-2 logit margin {self.margin:.3g} ({kind})"

    def to_dict(self) -> dict:
        return {"token": self.token, "position": self.position, "eagle": self.eagle, "no_draft": self.no_draft,
                "no_draft_top2_margin": self.margin, "near_tie": self.near_tie}


def no_draft_margin(rt, ids: list[int], token: int, stop_on_eos: bool = False) -> float | None:
    """No-draft's top-2 logit margin at generated token ``token`` of prompt ``ids``: a no-draft generation of
    token + 1 tokens with the top-2 log-probabilities of each (a log-softmax keeps logit differences)."""
    stream = rt.submit(prompt_ids=ids, max_new_tokens=token + 1, use_draft=False, stop_on_eos=stop_on_eos,
                       logprobs=2)
    stream.wait()
    lp = stream.logprobs
    if len(lp) <= token or len(lp[token].top) < 2:
        return None
    return float(lp[token].top[0][1] - lp[token].top[1][1])


def find_divergence(rt, ids: list[int], eagle: list[int], no_draft: list[int],
                    stop_on_eos: bool = False) -> Divergence | None:
    """None when the token lists are equal; else where they first differ, with no-draft's margin there (one more
    no-draft generation, untimed)."""
    i = first_divergence(eagle, no_draft)
    if i is None:
        return None
    margin = no_draft_margin(rt, ids, i, stop_on_eos) if i < len(no_draft) else None
    return Divergence(i, len(ids) + i, eagle[i] if i < len(eagle) else None,
                      no_draft[i] if i < len(no_draft) else None, margin)


@dataclass
class PromptRow:
    source: str
    prompt_tokens: int
    new_tokens: int
    tau: float
    rounds: int
    eagle_tok_s: float
    no_draft_tok_s: float
    speedup: float
    lossless: bool
    decode_s: float
    draft_s: float
    target_s: float
    host_s: float
    accept_lengths: list[int] = field(default_factory=list)
    no_draft_decode_s: float = 0.0
    no_draft_target_s: float = 0.0
    # With a peer: its tokens/s, its token count, and the first index where its tokens differ from our no-draft
    # tokens (None: equal).
    peer_tok_s: float | None = None
    peer_new_tokens: int | None = None
    peer_divergence: int | None = None
    divergence: Divergence | None = None  # where EAGLE first differs from no-draft (None: lossless)
    # EAGLE's rounds over every repeat: how many drafted and how many ran plain (the guard, a no-draft default), and
    # the accepted draft tokens of the drafting ones (n-alpha and the drafting rounds' tau come from those).
    spec_rounds: int = 0
    plain_rounds: int = 0
    spec_accept_lengths: list[int] = field(default_factory=list)
    spec_drafts: list[int] = field(default_factory=list)  # per drafting round, the draft tokens it verified
    short_rounds: int = 0  # drafting rounds that ran the short chain (runtime/chain_length.py)

    @property
    def peer_equal(self) -> bool | None:
        return None if self.peer_tok_s is None else self.peer_divergence is None

    def to_dict(self) -> dict:
        d = {"source": self.source, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
             "tau": self.tau, "rounds": self.rounds, "eagle_tok_s": self.eagle_tok_s,
             "no_draft_tok_s": self.no_draft_tok_s, "speedup": self.speedup, "lossless": self.lossless,
             "eagle_decode_s": self.decode_s, "draft_s": self.draft_s, "target_s": self.target_s,
             "host_s": self.host_s, "accept_lengths": list(self.accept_lengths),
             "no_draft_decode_s": self.no_draft_decode_s, "no_draft_target_s": self.no_draft_target_s,
             "spec_rounds": self.spec_rounds, "plain_rounds": self.plain_rounds, "short_rounds": self.short_rounds}
        if self.divergence is not None:
            d["divergence"] = self.divergence.to_dict()
        if self.peer_tok_s is not None:
            d.update(peer_tok_s=self.peer_tok_s, peer_new_tokens=self.peer_new_tokens, peer_equal=self.peer_equal,
                     peer_first_divergence=self.peer_divergence,
                     eagle_vs_peer=self.eagle_tok_s / max(self.peer_tok_s, 1e-12),
                     no_draft_vs_peer=self.no_draft_tok_s / max(self.peer_tok_s, 1e-12))
        return d


@dataclass
class PeerSummary:
    """The peer's side of a bench: what ran and its aggregate figures (the medians over prompts)."""

    name: str
    precision: str
    version: str
    model_dir: str
    build_s: float | None  # None: the built model came from the cache
    eos: list[int]  # the EOS ids it was given (EOS ignored: one id neither side generated)
    tok_s: float
    eagle_vs_peer: float  # median over prompts of eagle_tok_s / peer_tok_s
    no_draft_vs_peer: float
    equal_prompts: int  # prompts whose peer tokens equal our no-draft tokens
    prompts: int

    def to_dict(self) -> dict:
        return {"name": self.name, "precision": self.precision, "version": self.version, "model_dir": self.model_dir,
                "build_s": self.build_s, "eos_token_ids": list(self.eos), "tokens_per_s": self.tok_s,
                "eagle_vs_peer": self.eagle_vs_peer, "no_draft_vs_peer": self.no_draft_vs_peer,
                "equal_prompts": self.equal_prompts, "equal": self.equal_prompts == self.prompts}


def n_alpha(accept_lengths: list[int], max_depth: int, drafts: list[int] | None = None) -> list[float | None]:
    """For d = 1..max_depth: P(accepted >= d | accepted >= d - 1) over the rounds; None where no round reached d - 1.
    drafts: each round's draft tokens, where rounds differ (a guarded chain's short rounds): a round counts at depth d
    only if it drafted d tokens or more (a 3-token round that accepted 3 says nothing of a fourth)."""
    out: list[float | None] = []
    rounds = list(zip(accept_lengths, drafts if drafts is not None else [max_depth] * len(accept_lengths),
                      strict=True))
    for d in range(1, max_depth + 1):
        reached = sum(1 for a, n in rounds if a >= d - 1 and n >= d)
        out.append(sum(1 for a, n in rounds if a >= d and n >= d) / reached if reached else None)
    return out


def peak_rss_mb() -> float:
    """The process's peak resident set size in MiB (ru_maxrss: KiB on Linux, bytes on macOS)."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


@dataclass
class BenchReport:
    artifact: str
    backend: str
    threads: int | None
    max_new_tokens: int
    tree: TreeParams | None  # what EAGLE ran: the given tree, or the artifact's default (None: its default is no draft)
    rows: list[PromptRow]
    tau: float
    n_alpha: list[float | None]
    eagle_tok_s: float  # median over prompts
    no_draft_tok_s: float
    speedup: float  # median over prompts of the per-prompt ratio
    time_split: dict[str, float]  # fractions of EAGLE's decode time: draft, target, host
    peak_rss_mb: float
    lossless: bool
    warmup: bool = True
    stop_on_eos: bool = False
    repeats: int = 1
    no_draft_split: dict[str, float] = field(default_factory=dict)  # fractions of no-draft decode: target, host
    peer: PeerSummary | None = None
    default: bool = False  # EAGLE ran the artifact's default decoding (no tree given)
    guard: bool = True  # the speculation guard was on (docs/runtime.md)
    spec_tau: float = 0.0  # tau over the rounds that drafted
    weights: str = ""  # the artifact's weights (``Manifest.weights_label``)

    @property
    def spec_share(self) -> float | None:
        """Share of EAGLE's rounds that drafted (None: no round)."""
        spec = sum(r.spec_rounds for r in self.rows)
        total = spec + sum(r.plain_rounds for r in self.rows)
        return spec / total if total else None

    @property
    def short_share(self) -> float | None:
        """Share of EAGLE's rounds that drafted a guarded chain's short chain (None: no round)."""
        total = sum(r.spec_rounds + r.plain_rounds for r in self.rows)
        return sum(r.short_rounds for r in self.rows) / total if total else None

    def to_dict(self) -> dict:
        agg = {"tau": self.tau, "speedup": self.speedup,
               "tokens_per_s": {"eagle": self.eagle_tok_s, "no_draft": self.no_draft_tok_s},
               "n_alpha": list(self.n_alpha), "time_split": dict(self.time_split),
               "no_draft_time_split": dict(self.no_draft_split),
               "peak_rss_mb": self.peak_rss_mb, "lossless": self.lossless, "prompts": len(self.rows),
               "max_new_tokens": self.max_new_tokens, "tree": None if self.tree is None else self.tree.to_dict(),
               "default": self.default, "guard": self.guard, "spec_tau": self.spec_tau,
               "mode_share": {"spec": self.spec_share, "plain": None if self.spec_share is None else
                              1 - self.spec_share, "short_chain": self.short_share},
               "backend": self.backend, "threads": self.threads, "greedy": True, "stop_on_eos": self.stop_on_eos,
               "repeats": self.repeats, "artifact": self.artifact, "weights": self.weights}
        if self.peer is not None:
            agg["tokens_per_s"]["peer"] = self.peer.tok_s
            agg["peer"] = self.peer.to_dict()
        return {"aggregate": agg, "prompts": [r.to_dict() for r in self.rows]}

    def format(self) -> str:
        t = self.tree
        pe = self.peer
        head = (f"{'#':>2}  {'prompt':>6}  {'new':>4}  {'tau':>5}  {'eagle tok/s':>11}  {'no-draft tok/s':>14}  "
                f"{'speedup':>7}  {'draft':>6}  {'target':>6}  {'host':>6}  lossless")
        if pe is not None:
            head += f"  {'peer tok/s':>10}  {'eagle/peer':>10}  {'plain/peer':>10}  peer tokens"
        eos = "stop at EOS" if self.stop_on_eos else "EOS ignored"
        reps = f", medians of {self.repeats} interleaved repeats" if self.repeats > 1 else ""
        tree = "no draft" if t is None else f"tree {t.label}"
        how = (" (the artifact's default" + (", from `eagle-export tune`" if t is None else "") + ")"
               if self.default else "")
        weights = f"weights {self.weights}; " if self.weights else ""
        lines = [f"bench {self.artifact} (backend {self.backend}, threads {self.threads or 'default'}; {weights}"
                 f"{tree}{how}; guard {'on' if self.guard else 'off'}; {self.max_new_tokens} new tokens, greedy, "
                 f"{eos}{reps})",
                 "", head, "-" * len(head)]
        for i, r in enumerate(self.rows, 1):
            d = max(r.decode_s, 1e-12)
            line = (f"{i:>2}  {r.prompt_tokens:>6}  {r.new_tokens:>4}  {r.tau:>5.2f}  {r.eagle_tok_s:>11.1f}  "
                    f"{r.no_draft_tok_s:>14.1f}  {r.speedup:>6.2f}x  {r.draft_s / d:>6.1%}  "
                    f"{r.target_s / d:>6.1%}  {r.host_s / d:>6.1%}  {'yes' if r.lossless else 'NO':>8}")
            if r.peer_tok_s is not None:
                same = "equal" if r.peer_equal else f"differ at {r.peer_divergence}"
                line += (f"  {r.peer_tok_s:>10.1f}  {r.eagle_tok_s / r.peer_tok_s:>9.2f}x  "
                         f"{r.no_draft_tok_s / r.peer_tok_s:>9.2f}x  {same}")
            lines.append(line)
        s = self.time_split
        na = ", ".join(f"{i}: {'-' if a is None else f'{a:.2f}'}" for i, a in enumerate(self.n_alpha, 1))
        lines += [
            "",
            f"tau (committed tokens per target forward, bonus included): {self.tau:.2f} (every round counted whole)"
            + (f"; over the drafting rounds {self.spec_tau:.2f}" if self.spec_share not in (None, 1.0) else ""),
            f"acceptance per depth (n-alpha, drafting rounds): {na}",
            "EAGLE's rounds: " + ("none" if self.spec_share is None else
                                  f"{self.spec_share:.1%} drafted"
                                  + (f" ({self.short_share:.1%} the short chain)" if self.short_share else "")
                                  + f", {1 - self.spec_share:.1%} plain"
                                  + (" (the speculation guard, docs/runtime.md)" if self.guard and self.tree else "")),
            f"tokens/s (median over {len(self.rows)} prompts): EAGLE {self.eagle_tok_s:.1f}, "
            f"no-draft {self.no_draft_tok_s:.1f}" + (f", {pe.name} {pe.precision} {pe.tok_s:.1f}" if pe else ""),
            f"speedup (median of per-prompt ratios, measured side by side): {self.speedup:.2f}x",
            f"EAGLE decode time: draft graph {s['draft']:.1%}, target graph {s['target']:.1%}, host {s['host']:.1%}",
        ]
        if self.no_draft_split:
            lines.append(f"no-draft decode time: target graph {self.no_draft_split['target']:.1%}, "
                         f"host {self.no_draft_split['host']:.1%}")
        if pe is not None:
            built = "from the cache" if pe.build_s is None else f"built in {pe.build_s:.1f} s"
            lines += [
                f"peer: {pe.name} {pe.version} {pe.precision} ({built}: {pe.model_dir}; EOS ids given: {pe.eos})",
                f"vs peer (median of per-prompt ratios): EAGLE {pe.eagle_vs_peer:.2f}x, "
                f"no-draft {pe.no_draft_vs_peer:.2f}x",
                f"peer tokens == our no-draft tokens: {pe.equal_prompts} of {pe.prompts} prompts",
            ]
            if self.threads is None:
                lines.append("threads: each decoder's own default, which differ (onnxruntime-genai's ran 10-25% slower "
                             "than on 2 threads on a 2-core machine): --threads N gives both N, like for like")
        lines += [
            f"peak memory: {self.peak_rss_mb:.0f} MiB (the process's peak resident set size, ru_maxrss)",
            f"lossless (EAGLE tokens == no-draft tokens on every prompt): {self.lossless}",
        ]
        lines += [f"  prompt {i} ({r.source}) diverges {r.divergence.describe()}"
                  for i, r in enumerate(self.rows, 1) if r.divergence is not None]
        return "\n".join(lines)


# ---- the bench ---------------------------------------------------------------------------------


def _generate(rt, proxy: TimingBackend, ids: list[int], max_new: int, tree: TreeParams | None, use_draft: bool,
              stop_on_eos: bool = False) -> _Run:
    stream = rt.stream(prompt_ids=ids, max_new_tokens=max_new, tree=tree, use_draft=use_draft,
                       stop_on_eos=stop_on_eos)
    first = True
    for _ in stream:
        if first:  # the first chunk is the prefill's token: every graph call from here on is decode
            proxy.reset()
            first = False
    res = stream.result
    s = res.stats
    return _Run(list(res.tokens), s.rounds, list(s.accept_lengths), s.prefill_s, s.decode_s,
                proxy.draft_seconds, proxy.target_seconds, s.spec_rounds, s.spec_accept_lengths, list(s.spec_drafts),
                s.short_rounds)


def check_run_settings(max_new_tokens, threads, repeats: int = 1) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise BenchError(f"--max-new-tokens must be >= 1, got {max_new_tokens!r}")
    if threads is not None and threads < 1:
        raise BenchError(f"--threads must be >= 1, got {threads}")
    if not isinstance(repeats, int) or repeats < 1:
        raise BenchError(f"--repeats must be >= 1, got {repeats!r}")


def mode_order(i: int, parity: int, modes: tuple[str, ...]) -> tuple[str, ...]:
    """The order of the modes for prompt i (of repeat r: parity r + parity): the list rotated by i + parity, so each
    mode goes first equally often and slow drift of the machine favours none. Two modes: EAGLE first on even."""
    k = (i + parity) % len(modes)
    return modes[k:] + modes[:k]


def median_run(runs: list):
    """The run of median tokens/s (the lower median for an even count): its split is the one reported."""
    return sorted(runs, key=lambda r: r.tok_s)[(len(runs) - 1) // 2]


class PairedSession:
    """One opened runtime with the timing proxy installed and the prompts resolved to ids: the measuring core
    shared by ``bench`` and ``tune`` (tools/commands/tune/).

        with PairedSession(artifact, prompts=None, backend="ort", threads=1) as s:
            s.warm_up(tree, max_new_tokens)
            rows = s.measure(tree, max_new_tokens)    # one PromptRow per prompt: EAGLE and no-draft side by side

    ``--threads`` also sets PyTorch's intra-op threads while the session is open (restored on exit).
    """

    def __init__(self, artifact: str | Path, *, prompts: str | Path | list[PromptSpec] | None = None,
                 backend: str = "ort", threads: int | None = None, spin: str | None = None, guard: bool = True):
        self.artifact = artifact
        self._prompts = prompts
        self.backend = backend
        self.threads = threads
        self.spin = spin  # ONNX Runtime's spin policy (None: the runtime's default)
        self.guard = guard  # the speculation guard (tune measures trees without it: what they do when they draft)

    def __enter__(self) -> PairedSession:
        import torch

        from eagle_export.runtime import EagleRuntime

        specs = read_prompts(self._prompts) if isinstance(self._prompts, (str, Path)) else self._prompts
        self._threads_before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            self.rt = EagleRuntime.open(self.artifact, backend=self.backend, threads=self.threads, spin=self.spin,
                                        guard=self.guard)
            if specs is None:
                specs = builtin_prompts(self.rt.tokenizer is not None, self.rt.manifest.target.vocab_size)
            self.specs: list[PromptSpec] = specs
            self.prompt_ids = [prompt_ids(self.rt, s) for s in specs]
            self._installed = TimingInstalled(self.rt)
            self.proxy = self._installed.__enter__()
        except BaseException:
            torch.set_num_threads(self._threads_before)
            raise
        return self

    def __exit__(self, *exc) -> None:
        import torch

        self._installed.__exit__(*exc)
        torch.set_num_threads(self._threads_before)

    @property
    def manifest(self):
        return self.rt.manifest

    def check_tree(self, tree: TreeParams) -> TreeParams:
        """The tree against the artifact's limits and the backend's own check (TensorRT: its engines' sizes)."""
        tree.validate(self.rt.manifest.tree_limits)
        self.rt.backend.check_tree(tree)
        return tree

    def warm_up(self, tree: TreeParams | None, max_new_tokens: int, *, stop_on_eos: bool = False) -> None:
        """One EAGLE and one no-draft generation of the first prompt, not counted."""
        for use_draft in (True, False):
            self.run(0, max_new_tokens, tree, use_draft, stop_on_eos)

    @contextlib.contextmanager
    def guarded(self):
        """Inside, requests that draft run with the speculation guard's default policy, as the runtime runs them by
        default (runtime/guard.py), whatever the session was opened with; its round costs are the ones measured so
        far."""
        from eagle_export.runtime.guard import DEFAULT_POLICY

        gen = self.rt.generator
        before, gen.guard = gen.guard, DEFAULT_POLICY.validate()
        try:
            yield self
        finally:
            gen.guard = before

    def prepare(self, tree: TreeParams, tokens: int = 8) -> None:
        """A short EAGLE generation of the first prompt with ``tree``, not counted: what the runtime opens for a tree
        the first time it drafts one (a draft tree graph cut to its depth) opens here, not inside a timed run."""
        self.run(0, tokens, tree, True)

    def run(self, i: int, max_new_tokens: int, tree: TreeParams | None, use_draft: bool,
            stop_on_eos: bool = False) -> _Run:
        """One generation of prompt i (a GenerationError becomes a BenchError naming the prompt)."""
        return _run_checked(self.rt, self.proxy, self.specs[i], self.prompt_ids[i], max_new_tokens, tree, use_draft,
                            stop_on_eos)

    def measure(self, tree: TreeParams | None, max_new_tokens: int, *, parity: int = 0, log=None,
                stop_on_eos: bool = False, repeats: int = 1, peer=None,
                only: list[int] | None = None) -> list[PromptRow]:
        """For each prompt, one EAGLE and one no-draft generation one right after the other; the order alternates
        from prompt to prompt (EAGLE first on even ``i + parity``). ``repeats`` R: R passes over the prompts (pass r
        rotates the order by r more), per-prompt tokens/s the median of the R. ``peer``: a third mode (an object
        with ``generate(ids, max_new) -> PeerRun``) in the rotation, given as many tokens as our no-draft run made
        when EOS is ignored (so a peer that stops early is caught). ``only``: the indices of the prompts to run
        (default: every prompt); one row each."""
        modes = MODES if peer is not None else MODES[:2]
        capacity = self.rt.manifest.max_seq_len
        chosen = range(len(self.specs)) if only is None else only
        runs: list[dict[str, list]] = [{m: [] for m in modes} for _ in self.specs]
        for r in range(repeats):
            for i in chosen:
                spec, ids = self.specs[i], self.prompt_ids[i]
                done = {}
                for mode in mode_order(i, parity + r, modes):
                    if mode == "peer":  # EOS ignored: as many tokens as ours make (the capacity may cut them)
                        done[mode] = _peer_run(peer, spec, ids, max_new_tokens if stop_on_eos else
                                               min(max_new_tokens, capacity - len(ids)), exact=not stop_on_eos)
                    else:
                        done[mode] = self.run(i, max_new_tokens, tree, mode == "eagle", stop_on_eos)
                    runs[i][mode].append(done[mode])
                    if peer is not None:  # untimed: let the last run's spinning threads stop before the next starts
                        time.sleep(SETTLE_S)
                if log is not None:
                    e, n = done["eagle"], done["no_draft"]
                    more = f", {peer.name} {done['peer'].tok_s:.1f} tok/s" if peer is not None else ""
                    rep = f" (repeat {r + 1}/{repeats})" if repeats > 1 else ""
                    log(f"prompt {i + 1}/{len(self.specs)}{rep}: tau {tau(e.accept_lengths):.2f}, EAGLE "
                        f"{e.tok_s:.1f} tok/s, no-draft {n.tok_s:.1f} tok/s{more}")
        rows = [_row(self.specs[i], self.prompt_ids[i], runs[i]) for i in chosen]
        for row, i in zip(rows, chosen, strict=True):
            if not row.lossless:  # the first repeat whose EAGLE tokens differ, against no-draft's (untimed)
                rr = runs[i]
                e = next(x for x in rr["eagle"] if any(x.tokens != y.tokens for y in rr["no_draft"]))
                n = next(y for y in rr["no_draft"] if y.tokens != e.tokens)
                row.divergence = find_divergence(self.rt, self.prompt_ids[i], e.tokens, n.tokens, stop_on_eos)
        return rows


def _peer_run(peer, spec: PromptSpec, ids: list[int], max_new: int, exact: bool):
    """One peer generation; ``exact`` (EOS ignored): it must make all MAX_NEW tokens, or its EOS id was met."""
    run = peer.generate(ids, max_new)
    if exact and (run.stopped_at or len(run.tokens) != max_new):
        raise BenchError(f"{spec.source}: {peer.name} stopped after {run.count} of {max_new} tokens with EOS ignored "
                         f"(it generated the id given as its EOS, {peer.eos}): its figures would not be comparable")
    return run


def _row(spec: PromptSpec, ids: list[int], runs: dict[str, list]) -> PromptRow:
    """One prompt's row from its runs per mode (one per repeat): medians of tokens/s, the median EAGLE run's split."""
    es, ns = runs["eagle"], runs["no_draft"]
    e, n = median_run(es), median_run(ns)
    e_tok_s, n_tok_s = statistics.median(x.tok_s for x in es), statistics.median(x.tok_s for x in ns)
    first = es[0]  # greedy: every repeat makes the same tokens and rounds (lossless checks them all)
    row = PromptRow(
        spec.source, len(ids), len(first.tokens), tau(first.accept_lengths), first.rounds,
        e_tok_s, n_tok_s, e_tok_s / max(n_tok_s, 1e-12),
        all(x.tokens == y.tokens for x in es for y in ns),
        e.decode_s, e.draft_s, e.target_s, max(e.decode_s - e.draft_s - e.target_s, 0.0), list(first.accept_lengths),
        no_draft_decode_s=n.decode_s, no_draft_target_s=n.target_s,
        spec_rounds=sum(x.spec_rounds for x in es), plain_rounds=sum(x.rounds - x.spec_rounds for x in es),
        spec_accept_lengths=[a for x in es for a in x.spec_accept_lengths],
        spec_drafts=[n for x in es for n in x.spec_drafts], short_rounds=sum(x.short_rounds for x in es))
    if "peer" in runs:
        ps = runs["peer"]
        row.peer_tok_s = statistics.median(x.tok_s for x in ps)
        row.peer_new_tokens = ps[0].count
        divs = [first_divergence(ns[0].tokens, x.as_ours(ns[0].tokens)) for x in ps]
        row.peer_divergence = next((d for d in divs if d is not None), None)
    return row


def tau_of(rows: list[PromptRow]) -> float:
    """Committed tokens per target forward (bonus included) over every EAGLE round of the rows."""
    return tau([a for r in rows for a in r.accept_lengths])


def time_splits(rows: list[PromptRow]) -> tuple[dict[str, float], dict[str, float]]:
    """EAGLE's decode time split {draft, target, host} and no-draft's {target, host}, as fractions of the decode time
    summed over the rows."""
    decode = sum(r.decode_s for r in rows)
    parts = {"draft": sum(r.draft_s for r in rows), "target": sum(r.target_s for r in rows),
             "host": sum(r.host_s for r in rows)}
    split = {k: (v / decode if decode > 0 else 0.0) for k, v in parts.items()}
    nd = sum(r.no_draft_decode_s for r in rows)
    nt = sum(r.no_draft_target_s for r in rows)
    plain = {"target": nt / nd if nd > 0 else 0.0, "host": max(nd - nt, 0.0) / nd if nd > 0 else 0.0}
    return split, plain


def peer_summary(peer, rows: list[PromptRow]) -> PeerSummary:
    return PeerSummary(
        name=peer.name, precision=peer.precision, version=peer.version, model_dir=str(peer.model_dir),
        build_s=peer.build_s, eos=list(peer.eos), tok_s=statistics.median(r.peer_tok_s for r in rows),
        eagle_vs_peer=statistics.median(r.eagle_tok_s / r.peer_tok_s for r in rows),
        no_draft_vs_peer=statistics.median(r.no_draft_tok_s / r.peer_tok_s for r in rows),
        equal_prompts=sum(1 for r in rows if r.peer_equal), prompts=len(rows))


def open_peer(session: PairedSession, name: str, *, precision: str | None, target: str | Path | None,
              cache: str | Path | None, threads: int | None, log=None):
    """The peer NAME for the session's artifact: built (or taken from the cache: default ARTIFACT/peers) from the
    target folder (default: the one the artifact was exported from), at the artifact's precision unless given."""
    from . import peer as pog

    if name not in pog.PEERS:
        raise BenchError(f"--peer must be one of {', '.join(pog.PEERS)}, got {name!r}")
    pog.import_genai()  # a clear error before anything is built
    raw = json.loads((Path(session.artifact) / "manifest.json").read_text())
    prec = pog.choose_precision(raw, precision)
    target_dir = pog.resolve_target(session.manifest.target.source, target)
    cache_dir = Path(cache) if cache is not None else Path(session.artifact) / "peers"
    return pog.ChildPeer(pog.OrtGenaiPeer.prepare(target_dir, precision=prec, cache=cache_dir, threads=threads,
                                                  log=log))


def bench(artifact: str | Path, *, prompts: str | Path | list[PromptSpec] | None = None, max_new_tokens: int = 64,
          tree: TreeParams | None = None, top_k: int | None = None, depth: int | None = None,
          total_tokens: int | None = None, threshold: float | None = None, backend: str = "ort",
          threads: int | None = None, warmup: bool = True, stop_at_eos: bool = False, repeats: int | None = None,
          peer: str | None = None, peer_precision: str | None = None, peer_target: str | Path | None = None,
          peer_cache: str | Path | None = None, spin: str | None = None, guard: bool = True,
          log=None) -> BenchReport:
    """Run the bench on ARTIFACT; see the module docstring. tree: full tree settings, or top_k/depth/total_tokens/
    threshold overriding the artifact's tree_defaults one by one; none of them: the artifact's default decoding (its
    tree_defaults, or its per-batch table's row for one sequence, which may be no draft: then EAGLE's runs are plain).
    guard: the speculation guard on (the runtime's default) or off. repeats: passes over the prompts (default 3 with
    a peer, else 1).
    peer: "ort-genai" (peer_precision fp32|int4, default the artifact's; peer_target: the Hugging Face folder to
    build it from, default the artifact's target source; peer_cache: where built models are kept, default
    ARTIFACT/peers). spin: ONNX Runtime's spin policy for our sessions ("off", "run", "on"; None: the runtime's
    default). log: optional callable for progress lines."""
    if repeats is None:
        repeats = 3 if peer is not None else 1
    check_run_settings(max_new_tokens, threads, repeats)
    say = log or (lambda msg: None)
    with PairedSession(artifact, prompts=prompts, backend=backend, threads=threads, spin=spin, guard=guard) as s:
        given = tree
        if given is None and (top_k, depth, total_tokens, threshold) != (None, None, None, None):
            given = tree_over_defaults(s.manifest.tree_defaults, top_k, depth, total_tokens, threshold)
        if given is not None:
            given.validate(s.manifest.tree_limits)
        tree = given if given is not None else s.manifest.default_tree(s.rt.max_batch)  # what EAGLE runs
        weights = s.manifest.weights_label()
        the_peer = None
        try:
            if peer is not None:
                the_peer = open_peer(s, peer, precision=peer_precision, target=peer_target, cache=peer_cache,
                                     threads=threads, log=say)
                eos = list(s.manifest.target.eos_token_ids)
                if stop_at_eos:
                    the_peer.set_eos(eos)
                else:  # an id our plain decoding of these prompts never makes (fp32: neither does the peer; checked)
                    say("our plain decoding of every prompt once, to choose an EOS id the peer never meets "
                        "(not counted)")
                    made = {t for i in range(len(s.specs)) for t in s.run(i, max_new_tokens, given, False).tokens}
                    the_peer.set_eos([choose_unused_id(s.manifest.target.vocab_size, made, set(eos))])
            if warmup:
                say("warm-up")
                s.warm_up(given, max_new_tokens, stop_on_eos=stop_at_eos)
                if the_peer is not None:
                    the_peer.generate(s.prompt_ids[0], max_new_tokens)
            rows = s.measure(given, max_new_tokens, log=say, stop_on_eos=stop_at_eos, repeats=repeats,
                             peer=the_peer)
        finally:
            if the_peer is not None:
                the_peer.close()
    spec_accepts = [a for r in rows for a in r.spec_accept_lengths]
    split, plain = time_splits(rows)
    return BenchReport(
        artifact=str(artifact), backend=backend, threads=threads, max_new_tokens=max_new_tokens, tree=tree, rows=rows,
        tau=tau_of(rows),
        n_alpha=n_alpha(spec_accepts, 0 if tree is None else tree.depth + 1,
                        [n for r in rows for n in r.spec_drafts]),
        eagle_tok_s=statistics.median(r.eagle_tok_s for r in rows),
        no_draft_tok_s=statistics.median(r.no_draft_tok_s for r in rows),
        speedup=statistics.median(r.speedup for r in rows),
        time_split=split, peak_rss_mb=peak_rss_mb(), lossless=all(r.lossless for r in rows), warmup=warmup,
        stop_on_eos=stop_at_eos, repeats=repeats, no_draft_split=plain,
        peer=None if the_peer is None else peer_summary(the_peer, rows), default=given is None, guard=guard,
        spec_tau=tau(spec_accepts), weights=weights)


def _run_checked(rt, proxy, spec: PromptSpec, ids, max_new, tree, use_draft, stop_on_eos: bool = False) -> _Run:
    try:
        return _generate(rt, proxy, ids, max_new, tree, use_draft, stop_on_eos)
    except GenerationError as e:
        raise BenchError(f"{spec.source}: {e}") from None


# ---- plot --------------------------------------------------------------------------------------


def require_matplotlib():
    """matplotlib.pyplot with the Agg backend, or a BenchError saying how to install it (it is optional)."""
    try:
        import matplotlib
    except ImportError:
        raise BenchError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                         "(or pip install 'eagle-export[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_n_alpha(report: BenchReport, path: str | Path) -> Path:
    """Draw the n-alpha curve (acceptance rate per depth) to PATH (a PNG)."""
    plt = require_matplotlib()
    pts = [(d, a) for d, a in enumerate(report.n_alpha, 1) if a is not None]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([d for d, _ in pts], [a for _, a in pts], marker="o")
    ax.set_xlabel("depth d")
    ax.set_ylabel("P(accept >= d | accept >= d-1)")
    ax.set_ylim(0, 1.05)
    ax.set_xticks(range(1, len(report.n_alpha) + 1))
    t = report.tree
    ax.set_title(f"n-alpha (tau {report.tau:.2f}; " + ("no draft" if t is None else t.label) + ")", fontsize=9)
    return save_figure(plt, fig, ax, path)


def save_figure(plt, fig, ax, path: str | Path) -> Path:
    """Finish a bench/tune plot (grid, tight layout), write it to PATH and close it; an unwritable PATH is a
    BenchError."""
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    try:
        fig.savefig(path)
    except OSError as e:
        raise BenchError(f"cannot write the plot {path}: {e}") from None
    finally:
        plt.close(fig)
    return path
