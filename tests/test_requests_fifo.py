"""`servers` cells at admission (theory/requests.md, *FIFO cells at admission*): the
recursions that fix a request's completion when it is admitted, replayed against an
event-by-event reference written here. The M/D/1 closed form and the comparison with ciw
are cases of tests/test_requests_servers.py's batch (one compiled program)."""

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dlbfluid._requests.fifo import serve

# ----------------------------------------------------------------------------------------
# Replay: the admission recursions against an event-by-event server
# ----------------------------------------------------------------------------------------


def reference_server(arrivals, prefill, decode, slots):
    """One App.-B server simulated event by event: a FIFO prefill engine, then `slots`
    decode slots fed FIFO from a queue in the order the prefills end; a request with no
    decode work leaves at the end of its prefill. Returns each request's completion."""
    n = len(arrivals)
    done = [0.0] * n
    events = [(t, 0, i) for i, t in enumerate(arrivals)]  # (time, kind, request)
    heapq.heapify(events)
    prefill_queue, decode_queue = [], []
    engine_busy, free_slots = False, slots
    while events:
        t, kind, i = heapq.heappop(events)
        if kind == 0:  # arrival
            prefill_queue.append(i)
        elif kind == 1:  # end of prefill
            engine_busy = False
            if decode[i] > 0:
                decode_queue.append(i)
            else:
                done[i] = t
        else:  # end of decode
            free_slots += 1
            done[i] = t
        if not engine_busy and prefill_queue:
            j = prefill_queue.pop(0)
            engine_busy = True
            heapq.heappush(events, (t + prefill[j], 1, j))
        while free_slots > 0 and decode_queue:
            j = decode_queue.pop(0)
            free_slots -= 1
            heapq.heappush(events, (t + decode[j], 2, j))
    return np.array(done)


@pytest.mark.parametrize("slots", [1, 3])
def test_admission_recursions_replay_the_event_by_event_server(slots):
    """400 admissions of random token counts (a tenth with no decode) through `serve`, the
    engine's per-server step, give the completion times of the event-by-event reference to
    rounding. Loads near 1 (both stages queue often). The negative control: a decode stage
    that ignores its slots (every decode starts at its prefill's end) is off."""
    rng = np.random.default_rng(slots)
    n, Q = 400, 512
    arrivals = np.cumsum(rng.exponential(1.0, n))
    prefill = rng.gamma(2.0, 0.45, n)
    decode = np.where(rng.random(n) < 0.1, 0.0, rng.gamma(1.5, 0.6 * slots, n))
    ref = reference_server(arrivals, prefill, decode, slots)

    def step(row, a):
        new, c, _, _ = serve(row, a[0], a[1], a[2], slots)
        return new, c

    row = jnp.concatenate([jnp.zeros(1 + slots), jnp.full(Q, -1.0)])
    xs = jnp.stack([jnp.asarray(arrivals), jnp.asarray(prefill), jnp.asarray(decode)], -1)
    _, got = jax.lax.scan(step, row, xs)
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-12, atol=1e-9)
    no_slots = np.maximum.accumulate(arrivals + prefill)  # (FIFO prefill ends) ...
    wrong = np.where(decode > 0, no_slots + decode, no_slots)  # ... decode never waits
    assert np.max(np.abs(wrong - ref)) > 1.0
