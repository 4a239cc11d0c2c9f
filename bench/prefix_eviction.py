"""Prefix-aware eviction: traces, the offline optimum and policy simulators.

Pure Python (numpy only for the seeded traces): ``bench/eviction_policy.py --study prefix``
runs it; the unit tests import it without the native extension.

**The model.** A trace is a list of requests; a request is its block keys in prefix order
(a key names its whole prefix: every request holding key k holds the same keys before it,
which ``check_prefix_keyed`` verifies).  Request i's *prefix hits* are the longest run of
its leading keys that are cached when it arrives (what a prefix cache serves); then every
present key of the request is read and every absent one is inserted.  A request longer than
the cache is truncated to its first ``cap`` keys for every policy alike (keys past ``cap``
cannot be a prefix hit; their reads still count in the total).  While a request's keys are
inserted its present keys are pinned (as the store pins what it reads): never victims.

**The bound** (``replay_opt``): at each request the cache may become any ``cap`` keys of
(the old cache + the request's keys); keep those whose next use (the next request holding
them) is nearest, ties kept shallowest-first.  Belady's exchange argument makes that the
maximum of *per-block* hits over every policy of the model, admission included (a request's
keys may be dropped at once: bypass).  A key's ancestors are next used no later than it and
are shallower, so they are always kept before it: the cache stays prefix-closed, every cached
key a request holds is in its leading run, and prefix hits equal per-block hits.  So this is
the exact optimum of prefix hits, not a heuristic; the replay checks the equality and raises
if it ever fails.  ``replay_opt(admit_all=True)`` is the optimum among policies that cache
every key of the request (no admission control) by the same argument.

``replay_belady_block`` is the textbook reference: every key cached, the farthest next use
evicted, ties (keys next used by the same request) broken oldest-touched first, as an
order-blind heap does: a request touches its head first, so this evicts chain heads.
"""

from __future__ import annotations

import collections
import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

INF = 1 << 62
Trace = list[list[int]]

# --------------------------------------------------------------------------- traces


@dataclass
class TraceInfo:
    name: str
    trace: Trace
    block_tokens: int
    about: str
    params: dict[str, object] = field(default_factory=dict)


def conversations(requests: int, users: int, zipf: float, prompts: int, prompt_blocks: int,
                  seed: int, round_blocks: tuple[int, int] = (2, 8), new_conv: float = 0.15,
                  max_rounds: int = 12) -> Trace:
    """bench/eviction_policy.py's native-policy study's trace (``make_trace``), the same keys for the
    same arguments: multi-round conversations of Zipf-popular users from shared prompts."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, users + 1) ** zipf
    who = rng.choice(users, size=requests, p=weights / weights.sum())
    conv = np.full(users, -1)
    length = np.zeros(users, dtype=np.int64)
    rounds = np.zeros(users, dtype=np.int64)
    next_conv = 0
    trace: Trace = []
    for u in who.tolist():
        if conv[u] < 0 or rounds[u] >= max_rounds or rng.random() < new_conv:
            conv[u], length[u], rounds[u] = next_conv, 0, 0
            next_conv += 1
        prompt = u % prompts
        grow = int(rng.integers(round_blocks[0], round_blocks[1] + 1))
        base = (1 << 40) + int(conv[u]) * 4096
        keys = [prompt * 4096 + i for i in range(prompt_blocks)]
        keys += [base + j for j in range(int(length[u]) + grow)]
        length[u] += grow
        rounds[u] += 1
        trace.append(keys)
    return trace


def agentic(requests: int, active: int, tools_blocks: int, turn_blocks: tuple[int, int],
            turns: tuple[int, int], seed: int) -> Trace:
    """Long agentic sessions: ``active`` sessions run at once, each re-sending its whole
    context every turn (a shared tool/system prefix of ``tools_blocks``, then every earlier
    turn) and growing by ``turn_blocks`` (tool output and the model's step); a session ends
    after ``turns`` turns and a new one takes its place.  The next turn comes from a random
    active session, busier ones (Zipf 1 over the session's rank) more often."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) for r in range(active)]
    sess = list(range(active))
    length = [0] * active
    left = [rng.randint(*turns) for _ in range(active)]
    nxt = active
    trace: Trace = []
    for _ in range(requests):
        a = rng.choices(range(active), weights)[0]
        length[a] += rng.randint(*turn_blocks)
        base = (2 << 40) + sess[a] * 65536
        trace.append([i for i in range(tools_blocks)] + [base + j for j in range(length[a])])
        left[a] -= 1
        if left[a] == 0:
            sess[a], length[a], left[a] = nxt, 0, rng.randint(*turns)
            nxt += 1
    return trace


def shared_prompts(requests: int, prompts: int, prompt_blocks: tuple[int, int], zipf: float,
                   query_blocks: tuple[int, int], followup: float, seed: int) -> Trace:
    """Many users sharing a few system prompts: each request is one of ``prompts`` system
    prompts (Zipf ``zipf``, lengths in ``prompt_blocks``) and a user's own query; with
    probability ``followup`` it is a follow-up of one of the last 200 requests (that
    request's keys, its answer and a new query), else a new user."""
    rng = random.Random(seed)
    lens = [rng.randint(*prompt_blocks) for _ in range(prompts)]
    weights = [1.0 / (p + 1) ** zipf for p in range(prompts)]
    recent: collections.deque[list[int]] = collections.deque(maxlen=200)
    trace: Trace = []
    nxt = 0
    for _ in range(requests):
        if recent and rng.random() < followup:
            prev = rng.choice(recent)
            tail = prev[-1]
            keys = prev + [tail + 1 + j for j in range(rng.randint(*query_blocks))]
        else:
            p = rng.choices(range(prompts), weights)[0]
            base = (3 << 40) + nxt * 65536
            nxt += 1
            keys = [(4 << 40) + p * 65536 + i for i in range(lens[p])]
            keys += [base + j for j in range(rng.randint(*query_blocks))]
        recent.append(keys)
        trace.append(keys)
    return trace


def documents(requests: int, doc_share: float, doc_blocks: tuple[int, int], reread: float,
              chat: Trace, seed: int) -> Trace:
    """One-off long documents among chat traffic: a request is, with probability
    ``doc_share``, a long document (``doc_blocks``) under a short shared instruction (4
    blocks), asked about once; with probability ``reread`` it gets one follow-up question
    a few requests later.  Otherwise the next request of ``chat`` (a conversation trace)."""
    rng = random.Random(seed)
    trace: Trace = []
    pending: list[tuple[int, list[int]]] = []
    ci = 0
    nd = 0
    for i in range(requests):
        if pending and pending[0][0] <= i:
            trace.append(pending.pop(0)[1])
            continue
        if rng.random() < doc_share:
            base = (5 << 40) + nd * 65536
            nd += 1
            keys = [(6 << 40) + j for j in range(4)] + \
                [base + j for j in range(rng.randint(*doc_blocks))]
            trace.append(keys)
            if rng.random() < reread:
                pending.append((i + rng.randint(2, 50), keys + [keys[-1] + 1]))
                pending.sort(key=lambda x: x[0])
        else:
            trace.append(chat[ci % len(chat)])
            ci += 1
    return trace


def serving_replay(users: int = 12, rounds: int = 5, system_tokens: int = 1024,
                   message_tokens: int = 256, answer_tokens: int = 16, rate: float = 2.0,
                   block: int = 128, seed: int = 0) -> Trace:
    """bench/vllm_serving.py's conversation workload as block keys, without an engine.

    Round r of user u sends the system prompt, its whole history and a new message; the
    answer (``answer_tokens``) joins the history.  The engine stores full blocks of
    ``block`` tokens keyed by their prefix, so the request's keys are the system prompt's
    blocks (shared by every user) then the user's own, one per full block of the prompt.
    Order: as the bench's dispatcher, every user's round 0 first, then users in the order
    their answers complete; a request is sent ``1/rate`` s after the last and takes a
    seeded 0.5-1.5x of a nominal service time (prefill of the uncached tokens and decode)
    -- the bench's own order varies with the engine in the same way."""
    rng = random.Random(seed)
    trace: Trace = []
    ready: list[tuple[float, int, int]] = [(0.0, u, 0) for u in range(users)]
    now = 0.0
    history = [system_tokens] * users
    while ready:
        ready.sort()
        t, u, r = ready.pop(0)
        now = max(now + 1.0 / rate, t)
        prompt = history[u] + message_tokens
        full = prompt // block
        sys_blocks = system_tokens // block
        keys = [(7 << 40) + j for j in range(min(full, sys_blocks))]
        keys += [(8 << 40) + u * 65536 + j for j in range(sys_blocks, full)]
        trace.append(keys)
        history[u] = prompt + answer_tokens
        service = (0.002 * (prompt - 0) + 0.05 * answer_tokens) * rng.uniform(0.5, 1.5)
        if r + 1 < rounds:
            ready.append((now + service, u, r + 1))
    return trace


def check_prefix_keyed(trace: Trace) -> None:
    """Every key has one predecessor (and so one depth) across the trace."""
    parent: dict[int, int] = {}
    for keys in trace:
        prev = -1
        for k in keys:
            p = parent.setdefault(k, prev)
            if p != prev:
                raise ValueError(f"key {k} follows {prev} here and {p} elsewhere")
            prev = k


def default_traces(scale: float = 1.0, seed: int = 40) -> list[TraceInfo]:
    """The study's traces; ``scale`` multiplies the request counts (the tests use small
    ones).  At scale 1 each replays in about a second per policy and size."""
    def n(x: int) -> int:
        return max(20, int(x * scale))

    high = conversations(n(10_000), 3000, 1.1, 4, 32, 26)
    low = conversations(n(10_000), 20_000, 0.8, 16, 8, 26)
    return [
        TraceInfo("high-reuse", high, 16, "the native-policy study's default trace, first 10,000 requests: "
                  "3,000 Zipf-1.1 users, 4 prompts of 32 blocks, conversations of up to 12 "
                  "rounds of 2-8 blocks",
                  {"requests": n(10_000), "users": 3000, "zipf": 1.1, "prompts": 4,
                   "prompt_blocks": 32, "seed": 26}),
        TraceInfo("low-reuse", low, 16, "the native-policy study's low-reuse trace, first 10,000 requests: "
                  "20,000 Zipf-0.8 users, 16 prompts of 8 blocks",
                  {"requests": n(10_000), "users": 20_000, "zipf": 0.8, "prompts": 16,
                   "prompt_blocks": 8, "seed": 26}),
        TraceInfo("agentic", agentic(n(4_000), 64, 48, (1, 4), (20, 120), seed), 16,
                  "64 concurrent agent sessions of 20-120 turns (Zipf 1 over sessions), each "
                  "re-sending its context (48-block shared tool prefix + every earlier turn) "
                  "and growing 1-4 blocks a turn",
                  {"requests": n(4_000), "active": 64, "tools_blocks": 48,
                   "turn_blocks": [1, 4], "turns": [20, 120], "seed": seed}),
        TraceInfo("shared-prompts", shared_prompts(n(8_000), 300, (8, 64), 0.9, (1, 4), 0.3,
                                                   seed), 16,
                  "300 system prompts of 8-64 blocks (Zipf 0.9) under single-shot user "
                  "queries of 1-4 blocks; 30 % are follow-ups of one of the last 200 requests",
                  {"requests": n(8_000), "prompts": 300, "prompt_blocks": [8, 64],
                   "zipf": 0.9, "query_blocks": [1, 4], "followup": 0.3, "seed": seed}),
        TraceInfo("documents", documents(n(6_000), 0.1, (100, 400), 0.2,
                                         conversations(n(6_000), 3000, 1.1, 4, 32, seed + 1),
                                         seed), 16,
                  "10 % one-off long documents (100-400 blocks under a 4-block instruction; "
                  "20 % asked once more within 50 requests) among high-reuse conversations",
                  {"requests": n(6_000), "doc_share": 0.1, "doc_blocks": [100, 400],
                   "reread": 0.2, "seed": seed}),
        TraceInfo("vllm-serving", serving_replay(), 128,
                  "bench/vllm_serving.py's defaults replayed: 12 users x 5 rounds, 1,024-token "
                  "system prompt, 256-token messages, 16-token answers, 128-token blocks",
                  {"users": 12, "rounds": 5, "system_tokens": 1024, "message_tokens": 256,
                   "answer_tokens": 16, "rate": 2.0, "seed": 0}),
        TraceInfo("vllm-serving-48x8", serving_replay(users=48, rounds=8), 128,
                  "the same workload with --users 48 --rounds 8 (the default is 60 requests)",
                  {"users": 48, "rounds": 8, "system_tokens": 1024, "message_tokens": 256,
                   "answer_tokens": 16, "rate": 2.0, "seed": 0}),
    ]


# --------------------------------------------------------------------------- results


@dataclass
class Result:
    hits: int = 0          # prefix hits (blocks)
    block_hits: int = 0    # cached keys read, prefix or not
    reads: int = 0         # keys of every request (untruncated)
    examined: int = 0      # records a victim search looked at (CLOCK family), or heap pops
    victims: int = 0

    @property
    def ratio(self) -> float:
        return self.hits / self.reads if self.reads else 0.0


def truncate(trace: Trace, cap: int) -> tuple[Trace, int]:
    return [keys[:cap] for keys in trace], sum(len(keys) for keys in trace)


def lead(keys: Sequence[int], cached: object) -> int:
    h = 0
    for k in keys:
        if k not in cached:  # type: ignore[operator]
            break
        h += 1
    return h


# --------------------------------------------------------------------------- LRU, S3-FIFO


def replay_lru(trace: Trace, cap: int, tail_first: bool = False) -> Result:
    """Exact LRU (an ``OrderedDict``): present keys move to the end, absent ones are
    inserted, in the request's order (``tail_first``: in reverse, so the head is newest).
    The victim is the least recent key not in the request (its keys are pinned)."""
    tr, reads = truncate(trace, cap)
    res = Result(reads=reads)
    lru: collections.OrderedDict[int, None] = collections.OrderedDict()
    for keys in tr:
        res.hits += lead(keys, lru)
        res.block_hits += sum(1 for k in keys if k in lru)
        cur = set(keys)
        for k in (reversed(keys) if tail_first else keys):
            if k in lru:
                lru.move_to_end(k)
                continue
            lru[k] = None
            if len(lru) > cap:
                aside = []
                while True:
                    v, _ = lru.popitem(last=False)
                    res.examined += 1
                    if v not in cur:
                        break
                    aside.append(v)
                for v in reversed(aside):
                    lru[v] = None
                    lru.move_to_end(v, last=False)
                res.victims += 1
    return res


def replay_s3fifo(trace: Trace, cap: int, small: float = 0.10) -> Result:
    """S3-FIFO (Yang et al., SOSP '23): a small FIFO (``small`` of the cache) for new keys, a
    main FIFO with a 2-bit frequency (reinsertion while > 0, decremented), a ghost FIFO of
    keys evicted from the small one (as many as the main holds) that admits straight to
    main.  A key leaving the small FIFO goes to main when read again since (freq > 0), as
    in the authors' libCacheSim code; pinned keys (the request's) are passed over."""
    tr, reads = truncate(trace, cap)
    res = Result(reads=reads)
    s_cap = max(1, int(cap * small))
    s_q: collections.deque[int] = collections.deque()
    m_q: collections.deque[int] = collections.deque()
    ghost: collections.OrderedDict[int, None] = collections.OrderedDict()
    freq: dict[int, int] = {}
    where: dict[int, int] = {}  # key -> 0 small, 1 main
    for keys in tr:
        res.hits += lead(keys, where)
        pinned = set(keys)
        new = []
        for k in keys:
            if k in where:
                freq[k] = min(3, freq[k] + 1)
                res.block_hits += 1
            else:
                new.append(k)
        for k in new:
            while len(where) >= cap:
                # evict one: from the small FIFO while it is over its share (or main is
                # empty), else from main; a run of pinned keys sends it to the other queue
                stuck_s = stuck_m = 0
                while True:
                    if stuck_s > len(s_q) and stuck_m > len(m_q):
                        raise RuntimeError("no victim: the cache is smaller than a request")
                    use_small = bool(s_q) and stuck_s <= len(s_q) and (
                        len(s_q) >= s_cap or not m_q or stuck_m > len(m_q))
                    res.examined += 1
                    if use_small:
                        v = s_q.popleft()
                        if v in pinned:
                            s_q.append(v)
                            stuck_s += 1
                            continue
                        if freq[v] > 0:
                            freq[v] = 0
                            where[v] = 1
                            m_q.append(v)
                            continue
                        del where[v], freq[v]
                        ghost[v] = None
                        if len(ghost) > cap - s_cap:
                            ghost.popitem(last=False)
                        break
                    if not m_q:
                        stuck_m = len(m_q) + 1
                        stuck_s = 0
                        continue
                    v = m_q.popleft()
                    if v in pinned:
                        m_q.append(v)
                        stuck_m += 1
                        continue
                    if freq[v] > 0:
                        freq[v] -= 1
                        m_q.append(v)
                        continue
                    del where[v], freq[v]
                    break
                res.victims += 1
            freq[k] = 0
            if k in ghost:
                del ghost[k]
                where[k] = 1
                m_q.append(k)
            else:
                where[k] = 0
                s_q.append(k)
    return res


# --------------------------------------------------------------------------- CLOCK family

# chance(i, n, new) -> the counter a key gets when read (new=False) or inserted (new=True)
# at position i of a request of n keys.
Chance = Callable[[int, int, bool], int]


def native_clock(i: int, n: int, new: bool) -> int:
    """csrc/blocks.c: the reference bit set at every read, not at commit."""
    return 0 if new else 1


def replay_clock(trace: Trace, cap: int, chance: Chance = native_clock,
                 probation: float = 0.0, window: int = 0, orphans_first: bool = False,
                 leaf_first: bool = False, gclock: int = 0) -> Result:
    """The native table's CLOCK (csrc/blocks.c ``victims_clock``), generalised to a small
    counter per slot.  Slots 0..cap-1; free slots are handed out lowest first; the hand
    passes slots in order, skips pinned ones (the request's present keys: their counter
    untouched), decrements a counter > 0, and takes a slot at 0 that this call did not take
    already; the request's new keys go into the slots taken, in order.  With
    ``native_clock`` this is the native policy exactly (the unit tests compare it with
    ``BlockTable`` on the same trace).

    ``probation`` > 0 adds S3-FIFO-style probation: new keys also enter a FIFO ring of
    refs; while the ring holds more than ``probation`` of the cache its oldest entry is
    looked at first: taken if it was not read since it came in, else it simply leaves the
    ring (it stays in its slot, with its counter, and the hand treats it as any other).
    The main hand passes over keys still in the ring.

    ``window`` > 0 (deepest-of-window): the hand gathers ``window`` x the victims still
    needed of slots it would take, and takes the deepest of them (a key's depth: its
    position in the request that inserted it, which the store learns from the order of a
    put's keys); the others stay, and the hand has passed them.

    ``gclock`` > 0 (GCLOCK): a read adds its chance to the counter, up to ``gclock``,
    instead of raising it to the chance: a key read often survives more passes of the
    hand, and a chain's head, read by every request of the chain, outlives its tail.

    ``orphans_first``: the hand takes a slot whose key's predecessor is not cached (an
    orphan: no prefix hit can reach it, and the next request holding it re-inserts the
    predecessor anyway) whatever its counter.  ``leaf_first``: the hand passes over a slot
    whose key has a cached successor (a child count per key) unless it has gone a whole
    revolution without a victim.  Both keep each key's predecessor (the key before it in
    the request that inserted it): ideal versions, the native cost of each in the docs."""
    tr, reads = truncate(trace, cap)
    res = Result(reads=reads)
    key_at: list[int | None] = [None] * cap
    cnt = [0] * cap
    read_since = [False] * cap
    in_ring = [False] * cap
    ring: collections.deque[tuple[int, int]] = collections.deque()  # (slot, key)
    ring_cap = int(cap * probation)
    dep = [0] * cap
    parent: dict[int, int] = {}
    kids: collections.Counter[int] = collections.Counter()
    where: dict[int, int] = {}
    filled = 0
    hand = 0
    for keys in tr:
        res.hits += lead(keys, where)
        n = len(keys)
        pinned: set[int] = set()
        new: list[int] = []
        pos: list[int] = []
        for i, k in enumerate(keys):
            s = where.get(k)
            if s is None:
                new.append(k)
                pos.append(i)
            else:
                res.block_hits += 1
                if gclock:
                    cnt[s] = min(gclock, cnt[s] + chance(i, n, False))
                else:
                    cnt[s] = max(cnt[s], chance(i, n, False))
                read_since[s] = True
                pinned.add(s)
        take = min(cap - filled, len(new))
        slots = list(range(filled, filled + take))
        filled += take
        chosen: set[int] = set()
        short = len(new) - take
        spins = 0
        cands: list[int] = []
        walked = 0
        while short:
            spins += 1
            if spins > 8 * cap + len(ring):
                raise RuntimeError("no victim: the cache is smaller than a request")
            if ring_cap and ring and (len(ring) > ring_cap or spins > 4 * cap):
                s, k = ring.popleft()
                res.examined += 1
                if key_at[s] != k:
                    continue  # stale: the slot changed hands
                in_ring[s] = False  # a pinned key was read by this request: it graduates
                if not read_since[s]:
                    chosen.add(s)
                    slots.append(s)
                    short -= 1
                    spins = 0
                continue
            s = hand
            res.examined += 1
            hand = (hand + 1) % cap
            if s in pinned or s in chosen or in_ring[s]:
                continue
            if orphans_first or leaf_first:
                walked += 1
                k = key_at[s]
                p = parent.get(k, -1)  # type: ignore[arg-type]
                if orphans_first and p != -1 and p not in where:
                    chosen.add(s)
                    slots.append(s)
                    short -= 1
                    spins = walked = 0
                    continue
                if leaf_first and kids[k] and spins < cap:  # type: ignore[index]
                    continue
            if cnt[s] > 0:
                cnt[s] -= 1
                continue
            if window:
                walked += 1
                if s not in cands:
                    cands.append(s)
                if len(cands) < window * short and spins < cap:
                    continue
                best = sorted(range(len(cands)), key=lambda j: (-dep[cands[j]], j))[:short]
                for j in sorted(best):
                    chosen.add(cands[j])
                    slots.append(cands[j])
                short -= len(best)
                cands, walked, spins = [], 0, 0
                continue
            chosen.add(s)
            slots.append(s)
            short -= 1
            spins = walked = 0
        res.victims += len(new) - take
        for k, s, i in zip(new, slots, pos, strict=True):
            old = key_at[s]
            if old is not None:
                del where[old]
                kids[parent.pop(old)] -= 1
            parent[k] = keys[i - 1] if i else -1
            kids[parent[k]] += 1
            where[k] = s
            key_at[s] = k
            cnt[s] = chance(i, n, True)
            dep[s] = i
            read_since[s] = False
            if ring_cap:
                in_ring[s] = True
                ring.append((s, k))
    return res


# --------------------------------------------------------------------------- Belady


def next_uses(tr: Trace) -> list[list[int]]:
    """For each request and key: the index of the next request holding the key, or INF."""
    last: dict[int, int] = {}
    out: list[list[int]] = [[]] * len(tr)
    for i in range(len(tr) - 1, -1, -1):
        keys = tr[i]
        out[i] = [last.get(k, INF) for k in keys]
        for k in keys:
            last[k] = i
    return out


def replay_opt(trace: Trace, cap: int, admit_all: bool = False) -> Result:
    """The offline optimum of prefix hits (module docstring): after each request keep the
    ``cap`` keys of (cache + request) whose next use is nearest, ties shallowest first;
    ``admit_all``: the request's keys must all stay (the optimum without admission)."""
    tr, reads = truncate(trace, cap)
    nu_of = next_uses(tr)
    res = Result(reads=reads)
    nu: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []
    for i, keys in enumerate(tr):
        h = lead(keys, nu)
        res.hits += h
        bh = sum(1 for k in keys if k in nu)
        res.block_hits += bh
        if bh != h:
            raise AssertionError(f"request {i}: the optimum's cache is not prefix-closed")
        for d, (k, n) in enumerate(zip(keys, nu_of[i], strict=True)):
            nu[k] = n
            heapq.heappush(heap, (-n, -d, k))
        aside = []
        while len(nu) > cap:
            negn, negd, k = heapq.heappop(heap)
            res.examined += 1
            if nu.get(k) != -negn:
                continue  # stale
            if admit_all and -negd < len(keys) and keys[-negd] == k:
                aside.append((negn, negd, k))
                continue
            del nu[k]
            res.victims += 1
        for e in aside:
            heapq.heappush(heap, e)
    return res


def replay_belady_block(trace: Trace, cap: int) -> Result:
    """Textbook Belady (MIN) per block: every key cached, the farthest next use evicted,
    ties oldest-touched first (a request touches its head first)."""
    tr, reads = truncate(trace, cap)
    nu_of = next_uses(tr)
    res = Result(reads=reads)
    nu: dict[int, tuple[int, int]] = {}
    heap: list[tuple[int, int, int]] = []
    seq = 0
    for i, keys in enumerate(tr):
        res.hits += lead(keys, nu)
        res.block_hits += sum(1 for k in keys if k in nu)
        cur = set(keys)
        for k, n in zip(keys, nu_of[i], strict=True):
            seq += 1
            nu[k] = (n, seq)
            heapq.heappush(heap, (-n, seq, k))
        aside = []
        while len(nu) > cap:
            e = heapq.heappop(heap)
            res.examined += 1
            if nu.get(e[2]) != (-e[0], e[1]):
                continue
            if e[2] in cur:
                aside.append(e)
                continue
            del nu[e[2]]
            res.victims += 1
        for e in aside:
            heapq.heappush(heap, e)
    return res


# --------------------------------------------------------------------------- the study


def leaf_bit(i: int, n: int, new: bool) -> int:
    """Two chances for a key with a successor in its request, one for the request's last
    key (the chain's leaf); a new key gets one chance less (CLOCK gives it none)."""
    return (1 if i < n - 1 else 0) + (0 if new else 1)


def tail_distance(i: int, n: int, new: bool) -> int:
    """Chances by distance from the request's last key: 1 for the last 4 keys, 2 for the
    4 before, 3 further in (a 2-bit counter); new keys one less."""
    return min(3, (0 if new else 1) + (n - 1 - i) // 4)


@dataclass
class PolicySpec:
    name: str
    kind: str   # reference, native, candidate, offline
    run: Callable[[Trace, int], Result]
    state: str  # per-block state a native version needs


POLICIES: list[PolicySpec] = [
    PolicySpec("exact LRU", "reference", replay_lru,
               "an ordered list: two links and a hash entry per block"),
    PolicySpec("exact LRU, tail first", "reference",
               lambda t, c: replay_lru(t, c, tail_first=True),
               "as exact LRU; a request's keys touched last to first"),
    PolicySpec("CLOCK (native today)", "native", replay_clock,
               "1 reference bit (csrc/blocks.c R_REF)"),
    PolicySpec("S3-FIFO", "reference", replay_s3fifo,
               "2-bit frequency, queue links, a ghost FIFO of 90 % of the blocks' keys"),
    PolicySpec("CLOCK + leaf bit", "candidate", lambda t, c: replay_clock(t, c, leaf_bit),
               "2-bit counter: 1 bit more than today (a spare bit of `bits`)"),
    PolicySpec("CLOCK + tail distance", "candidate",
               lambda t, c: replay_clock(t, c, tail_distance),
               "2-bit counter: 1 bit more than today"),
    PolicySpec("GCLOCK, 2-bit", "candidate", lambda t, c: replay_clock(t, c, gclock=3),
               "2-bit counter: 1 bit more than today"),
    PolicySpec("CLOCK, deepest of 2x", "candidate", lambda t, c: replay_clock(t, c, window=2),
               "16-bit depth (the record's spare u16) + a window of 2n candidates per call"),
    PolicySpec("CLOCK + orphans first", "candidate",
               lambda t, c: replay_clock(t, c, orphans_first=True),
               "parent slot (u32) + 8-bit slot epochs (own, parent's): 16 B a record"),
    PolicySpec("CLOCK + leaf first", "candidate",
               lambda t, c: replay_clock(t, c, leaf_first=True),
               "parent slot (u32) + child count (u16) + epochs: 18 B, over the 16 B budget"),
    PolicySpec("CLOCK + probation 10 %", "candidate",
               lambda t, c: replay_clock(t, c, probation=0.10),
               "1 bit (in the ring) + a ring of refs, 10 % of the slots: +0.8 B a block"),
    PolicySpec("Belady per block", "offline", replay_belady_block,
               "offline: the whole future"),
    PolicySpec("OPT, every key admitted", "offline",
               lambda t, c: replay_opt(t, c, admit_all=True), "offline: the whole future"),
    PolicySpec("OPT (the bound)", "offline", replay_opt, "offline: the whole future"),
]
BOUND = "OPT (the bound)"
BASE = "exact LRU"
CLOCK_NAME = "CLOCK (native today)"


def study(traces: list[TraceInfo], sizes: list[float], bytes_per_token: int,
          policies: list[PolicySpec] | None = None, out: Callable[[str], None] = print,
          ) -> list[dict[str, object]]:
    """Every policy on every trace and cache size; one row per (trace, size, policy)."""
    import time

    policies = policies or POLICIES
    rows: list[dict[str, object]] = []
    for ti in traces:
        check_prefix_keyed(ti.trace)
        distinct = len({k for keys in ti.trace for k in keys})
        reads = sum(len(keys) for keys in ti.trace)
        out(f"\n{ti.name}: {len(ti.trace)} requests, {reads} block reads, {distinct} distinct "
            f"blocks of {ti.block_tokens} tokens, longest request {max(map(len, ti.trace))}"
            f" blocks\n  {ti.about}")
        out(f"  {'policy':<26}" + "".join(f"{f'{s:.0%}: ratio (vs LRU) gap%':>30}"
                                          for s in sizes))
        cells: dict[str, list[dict[str, object]]] = {}
        for size in sizes:
            cap = max(1, int(size * distinct))
            got: dict[str, tuple[Result, float]] = {}
            for p in policies:
                t0 = time.perf_counter()
                r = p.run(ti.trace, cap)
                got[p.name] = (r, time.perf_counter() - t0)
            lru = got[BASE][0].ratio
            opt = got[BOUND][0].ratio if BOUND in got else float("nan")
            clock = got.get(CLOCK_NAME)
            clock_ns = (clock[1] / max(1, clock[0].victims) * 1e9) if clock else None
            for p in policies:
                r, sec = got[p.name]
                gap = opt - lru
                closed = (r.ratio - lru) / gap if gap > 1e-9 else (1.0 if r.ratio >= lru
                                                                 else 0.0)
                ns = sec / max(1, r.victims) * 1e9
                gib = cap * ti.block_tokens * bytes_per_token / (1 << 30)
                row = {"trace": ti.name, "size": size, "cap_blocks": cap, "policy": p.name,
                       "kind": p.kind, "state": p.state, "hit_ratio": r.ratio,
                       "block_hit_ratio": r.block_hits / r.reads,
                       "prefix_hits": r.hits, "reads": r.reads,
                       "hit_tokens_per_gib": r.hits * ti.block_tokens / gib,
                       "minus_lru_points": 100 * (r.ratio - lru),
                       "gap_closed": closed, "victims": r.victims,
                       "examined_per_victim": r.examined / max(1, r.victims),
                       "sim_ns_per_victim": ns,
                       "sim_cost_vs_clock": (ns / clock_ns) if clock_ns else None,
                       "seconds": sec}
                rows.append(row)
                cells.setdefault(p.name, []).append(row)
        for p in policies:
            out(f"  {p.name:<26}" + "".join(
                f"{c['hit_ratio']:>12.4f} ({c['minus_lru_points']:+6.2f}) "  # type: ignore[str-format]
                f"{100 * c['gap_closed']:>7.0f}%" for c in cells[p.name]))  # type: ignore[operator]
    return rows


def verdicts(rows: list[dict[str, object]], sizes: tuple[float, ...] = (0.10, 0.25),
             ) -> dict[str, dict[str, object]]:
    """Per candidate: does it close >= half the LRU-to-OPT gap and never fall below exact
    LRU, at each of ``sizes`` on every trace; the worst cell of each."""
    out: dict[str, dict[str, object]] = {}
    for row in rows:
        if row["size"] not in sizes or row["kind"] in ("offline",) or row["policy"] == BASE:
            continue
        v = out.setdefault(str(row["policy"]), {"meets": True, "worst_gap_closed": 1e9,
                                                "worst_minus_lru_points": 1e9, "cells": 0,
                                                "cells_meeting": 0})
        ok = row["gap_closed"] >= 0.5 and row["minus_lru_points"] >= -1e-9  # type: ignore[operator]
        v["cells"] += 1  # type: ignore[operator]
        v["cells_meeting"] += int(ok)  # type: ignore[operator]
        v["meets"] = bool(v["meets"]) and ok
        v["worst_gap_closed"] = min(v["worst_gap_closed"], row["gap_closed"])  # type: ignore[type-var]
        v["worst_minus_lru_points"] = min(v["worst_minus_lru_points"],  # type: ignore[type-var]
                                          row["minus_lru_points"])
    return out
