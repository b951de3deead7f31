"""What only an in-place transport needs: a CE block a PE may still write into is never freed
or handed to another request before that PE's push (or abort) arrives or the timeout passes.

The other P/D claims run with Mooncake through tests/test_pd.py's ``connector`` parameter.
"""

from __future__ import annotations

import time

import pytest
from test_pd import GREEDY, all_free, ce_engine, pe_engine

from pdinfer.engine.completion_engine import NoRoomError
from pdinfer.engine.pd_common import DEFAULT_DECODE_MARGIN_TOKENS
from pdinfer.engine.pd_pair import PDPair
from pdinfer.kv_transfer.mooncake import INSTALL_HINT, mooncake_available
from pdinfer.kv_transfer.protocol import KVAbort

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not mooncake_available(), reason=INSTALL_HINT)]


def _step_until(engines, done, limit_s=60):
    """Step until ``done()``; the last output per request of each engine, in engine order."""
    end, outs = time.monotonic() + limit_s, [{} for _ in engines]
    while not done():
        assert time.monotonic() < end, "engines did not settle"
        for engine, seen in zip(engines, outs):
            for out in engine.step():
                seen[out.request_id] = out
        time.sleep(0.005)
    return outs


def _written(ce, blocks) -> bool:  # a fresh CE's cache is all zeros
    return bool(ce.model_runner.cache.kv[blocks].abs().sum() > 0)


def test_blocks_aborted_on_the_ce_stay_taken_until_the_pe_write_is_over(prompt_ids):
    prompt = {"prompt_token_ids": prompt_ids[3]}
    room = -(-(len(prompt_ids[3]) + DEFAULT_DECODE_MARGIN_TOKENS) // 16)  # one reservation, no more
    params = GREEDY.clone(max_tokens=DEFAULT_DECODE_MARGIN_TOKENS + 1)  # fits the room exactly
    pe = pe_engine(connector="mooncake")
    ce = ce_engine(num_kv_blocks=room, connector="mooncake", reservation_timeout_s=30)
    PDPair(pe, ce).add_request("r", prompt, params)
    reserved = list(next(iter(ce.role.reservations.values())).block_table)
    ce.abort_request("r")  # the client left the CE; the PE has not heard and will write
    ce.step()
    assert ce.get_num_free_blocks() == 0
    with pytest.raises(NoRoomError):  # blocks the PE may write into go to no other request
        ce.role.reserve("other", prompt, params)
    pe_outs, _ = _step_until([pe, ce], lambda: not pe.has_unfinished_requests())
    assert "aborted on the completion engine" in pe_outs["r"].error  # its push was refused
    assert _written(ce, reserved)  # the PE did write after the abort, into quarantined blocks
    assert "r" not in ce.role.quarantined  # released once the push said the write was over
    all_free(pe, ce)
    other = ce.role.reserve("other", prompt, params)
    ce.abort_request("other")
    ce.step()
    assert ce.get_num_free_blocks() == 0
    # A PE's abort ("I will not write") ends a quarantine at once.
    pe.role.connector.abort(other.address, KVAbort(transfer_id=other.transfer_id, request_id="other"))
    _step_until([ce], lambda: not ce.has_unfinished_requests(), limit_s=10)
    all_free(pe, ce)
    pe.shutdown()
    ce.shutdown()


def test_a_quarantine_without_a_pe_ends_at_the_timeout():
    ce = ce_engine(connector="mooncake", reservation_timeout_s=1.0)
    reservation = ce.role.reserve("r", {"prompt_token_ids": list(range(1, 40))}, GREEDY)
    ce.abort_request("r")
    ce.step()
    assert ce.get_num_free_blocks() == ce.num_blocks - len(reservation.block_ids)
    _step_until([ce], lambda: not ce.has_unfinished_requests(), limit_s=20)
    all_free(ce)
    ce.shutdown()


def test_pe_never_writes_after_the_reservation_expired(prompt_ids):
    pe = pe_engine(connector="mooncake")
    ce = ce_engine(connector="mooncake", reservation_timeout_s=0.5)
    prompt = {"prompt_token_ids": prompt_ids[3]}
    reservation = ce.role.reserve("r", prompt, GREEDY)
    pe.add_request("r", prompt, GREEDY, reservation=reservation)
    time.sleep(0.6)  # the prefill finishes after the CE's reservation timeout
    pe_outs, _ = _step_until([pe, ce], lambda: not (pe.has_unfinished_requests() or ce.has_unfinished_requests()))
    assert "reservation expired" in pe_outs["r"].error
    assert not _written(ce, reservation.block_ids)
    all_free(pe, ce)
    pe.shutdown()
    ce.shutdown()
