"""kvtierd's KV events decode with vLLM's own decoder (the format routers consume)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs kvtier[vllm] (make install)")
msgspec = pytest.importorskip("msgspec")
kv_events = pytest.importorskip("vllm.distributed.kv_events")

from kvtierd.events import CLEARED, encode_batch, removed_event, stored_event  # noqa: E402


def test_vllms_decoder_reads_kvtierds_batches() -> None:
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    payload = encode_batch([stored_event([b"k1", b"k2"], "CPU"),
                            removed_event([b"k1"], "STORAGE"), dict(CLEARED)], ts=12.5)
    batch = decoder.decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank is None
    stored, removed, cleared = batch.events
    assert isinstance(stored, kv_events.BlockStored)
    assert (stored.block_hashes, stored.medium, stored.token_ids, stored.block_size,
            stored.parent_block_hash) == ([b"k1", b"k2"], "CPU", [], 0, None)
    assert isinstance(removed, kv_events.BlockRemoved)
    assert (removed.block_hashes, removed.medium) == ([b"k1"], "STORAGE")
    assert isinstance(cleared, kv_events.AllBlocksCleared)
    # A heartbeat is an empty batch.
    assert decoder.decode(encode_batch([], ts=1.0)).events == []
    # And vLLM's encoder writes what kvtierd's subscribers read the same way.
    ours = msgspec.msgpack.decode(payload)
    theirs = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert ours[:2] == theirs[:2]
