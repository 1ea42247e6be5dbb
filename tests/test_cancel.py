"""``RequestStream.cancel`` and ``Scheduler.on_round``, the two runtime hooks the server needs: a cancelled active
request leaves its slot at the next round boundary, a cancelled waiting request never joins, the others are
untouched; the round hook sees every batched round."""

from __future__ import annotations

import time

import pytest

from eagle_export.errors import GenerationError
from eagle_export.runtime import EagleRuntime
from eagle_export.tools.testing.tiny_models import TINY_CHAT_TEMPLATE


@pytest.fixture(scope="module")
def art(models):
    """test_serve's model (one export per session)."""
    return models("mha", vocab=256, with_tokenizer=True, chat_template=TINY_CHAT_TEMPLATE, max_batch=4,
                  max_seq_len=512)[2]


def test_cancel_frees_the_slot_and_drops_waiting_requests(art):
    rt = EagleRuntime.open(art, max_batch=1)
    try:
        seen: list[tuple[float, int]] = []
        rt.scheduler.on_round = lambda s, n: seen.append((s, n))
        long = dict(max_new_tokens=400, stop_on_eos=False)
        a = rt.submit(prompt_ids=[1, 2, 3], **long)
        b = rt.submit(prompt_ids=[4, 5, 6], **long)  # waits: one slot
        it = iter(a)
        next(it)  # a is in the slot
        b.cancel()
        a.cancel()
        t0 = time.perf_counter()
        for s in (a, b):
            with pytest.raises(GenerationError, match="cancelled"):
                s.wait(timeout=30)
        assert time.perf_counter() - t0 < 5
        made = 0
        with pytest.raises(GenerationError, match="cancelled"):  # the iteration ends with the same error
            for t in it:
                made += len(t)
        assert made < 100  # what a committed after its first round, before it left (not 400)
        assert len(rt.scheduler.join_rounds) == 1  # b never joined
        c = rt.submit(prompt_ids=[7, 8, 9], max_new_tokens=12, stop_on_eos=False).wait(timeout=30)
        ref = EagleRuntime.open(art)
        assert c.tokens == ref.generate(prompt_ids=[7, 8, 9], max_new_tokens=12, stop_on_eos=False).tokens
        assert len(seen) == rt.scheduler.rounds and all(sec > 0 and n == 1 for sec, n in seen)
    finally:
        rt.close()
