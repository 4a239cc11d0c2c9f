"""kv_role policy of the vLLM connector and the producer's announcement (kvtier._vllm_roles).

The roles against real engines are tests/vllm/test_pd.py; this is the table and the
validation of what a client may put in ``kv_transfer_params``.
"""

from __future__ import annotations

import time

import pytest

from kvtier._vllm_roles import Role, Waits, announced_blocks, producer_params


def test_each_role_saves_and_loads_as_vllm_connectors_do() -> None:
    both = Role.of("kv_both", save=True, load=True, async_save=True)
    assert (both.save, both.load, both.async_save) == (True, True, True)
    assert Role.of(None, save=False, load=True, async_save=False).role == "kv_both"
    producer = Role.of("kv_producer", save=False, load=True, async_save=True)
    # A producer always saves, and within the step: its answer must find them committed.
    assert (producer.save, producer.load, producer.async_save) == (True, True, False)
    assert producer.producer and not producer.consumer
    assert Role.of("kv_producer", save=True, load=False, async_save=False).load is False
    consumer = Role.of("kv_consumer", save=True, load=True, async_save=True)
    assert (consumer.save, consumer.load, consumer.async_save) == (False, True, False)
    assert consumer.consumer and not consumer.producer


def test_a_consumer_that_cannot_load_and_unknown_roles_are_refused() -> None:
    with pytest.raises(ValueError, match='load_mode "off"'):
        Role.of("kv_consumer", save=False, load=False, async_save=False)
    with pytest.raises(ValueError, match="kv_role must be one of"):
        Role.of("kv_prefill", save=True, load=True, async_save=False)


def test_only_a_well_formed_announcement_counts() -> None:
    assert announced_blocks(producer_params(7)) == 7
    assert announced_blocks({"kvtier": {"blocks": 7}, "do_remote_prefill": True}) == 7
    for garbage in (None, {}, {"kvtier": 7}, {"kvtier": {"blocks": -1}},
                    {"kvtier": {"blocks": "9"}}, {"kvtier": {"blocks": True}},
                    {"kvtier": {"blocks": 2.5}}, {"other": {"blocks": 3}}):
        assert announced_blocks(garbage) == 0, garbage  # type: ignore[arg-type]


def test_a_request_is_held_until_its_blocks_show_or_the_limit_passes() -> None:
    w = Waits(0.2)
    assert not w.hold("a", found=4, wanted=4)  # all there: never held
    assert len(w) == 0
    assert w.hold("b", found=1, wanted=4)
    assert not w.recheck("b")  # just looked: the next step does not look again at once
    time.sleep(Waits.RECHECK)
    assert w.recheck("b")
    assert not w.hold("b", found=4, wanted=4)  # they arrived
    assert w.hold("c", found=0, wanted=2)
    time.sleep(0.25)
    assert not w.hold("c", found=0, wanted=2)  # waited long enough: recompute
    assert not w.hold("c", found=0, wanted=2)  # and never held again
    w.forget("c")
    w.forget("b")
    assert len(w) == 0
    assert not Waits(0).hold("d", found=0, wanted=3)


def test_the_wait_of_a_held_request_is_reported_once_when_it_goes() -> None:
    w = Waits(5.0)
    assert not w.hold("a", found=2, wanted=2)
    assert w.waited("a") == 0.0  # never held: no wait
    assert w.hold("b", found=0, wanted=2)
    time.sleep(0.02)
    assert w.hold("b", found=1, wanted=2)  # the wait runs from the first hold
    time.sleep(0.02)
    assert not w.hold("b", found=2, wanted=2)
    assert 0.04 <= w.waited("b") < 1.0
    assert w.waited("b") == 0.0  # reported once
    assert w.hold("c", found=0, wanted=1)
    w.forget("c")
    assert w.waited("c") == 0.0


def test_a_held_request_is_looked_up_again_no_sooner_than_its_last_lookup_took() -> None:
    w = Waits(5.0)
    assert w.due_in("a") == 0.0 and w.recheck("a")  # never held: look now
    assert w.hold("a", found=0, wanted=2, looked=0.05)  # a slow lookup (the cluster)
    assert 0.03 < w.due_in("a") <= 0.05
    time.sleep(Waits.RECHECK)
    assert not w.recheck("a")  # not after RECHECK: after as long as the lookup took
    time.sleep(0.05)
    assert w.recheck("a")
    assert w.hold("a", found=1, wanted=2, looked=0.0001)  # a fast one: RECHECK apart
    assert 0 < w.due_in("a") <= Waits.RECHECK
