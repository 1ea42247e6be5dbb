"""The scheduler's side of a server's cancellation (serve cancels a request's streams when its client goes away, a
stop string appears, or the timeout passes): with one slot, a cancelled request's slot goes to the waiting request
at the very next round boundary, and the cancelled stream gets no token from a round after its cancellation."""

from __future__ import annotations

from eagle_export.runtime import EagleRuntime
from eagle_export.runtime.scheduler import RequestStream


class _Marked(RequestStream):
    """A RequestStream that notes, for each push, how many rounds the scheduler had finished."""

    def __init__(self, sched):
        super().__init__()
        self.sched, self.pushed_after = sched, []

    def push(self, tokens):
        self.pushed_after.append(self.sched.rounds)
        super().push(tokens)


def test_cancelled_slot_is_taken_in_the_same_boundary(tiny):
    rt = EagleRuntime.open(tiny[2], max_batch=1)
    try:
        sched = rt.scheduler
        gen = sched.gen
        a, b = _Marked(sched), _Marked(sched)
        cancelled_at = []

        def on_round(seconds, active):  # the scheduler thread, right after a round: cancel A after its 3rd
            if sched.rounds == 3 and not cancelled_at:
                a.cancel()
                cancelled_at.append(sched.rounds)

        sched.on_round = on_round
        sched.submit(lambda: gen.check([5, 6, 7], 200, None, True, False, None), a)
        sched.submit(lambda: gen.check([8, 9], 6, None, True, False, None), b)
        assert b.wait(60).tokens
        assert a.done.wait(60) and a.error is not None and "cancelled" in str(a.error)
        r = cancelled_at[0]
        # A joined at round 0 and got tokens from its prefill and its rounds 1..r, none from a round r + 1
        assert max(a.pushed_after) == r - 1 and len(a.pushed_after) == r + 1
        # B joined at the boundary right after round r: the join, and its prefill push, saw r rounds done
        assert sched.join_rounds[-1] == r and b.pushed_after[0] == r
    finally:
        rt.close()
