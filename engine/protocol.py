"""Messages between pdserve processes: typed structs, msgpack on the wire, never pickle.

Flow of one disaggregated request (each arrow one message, PUSH -> PULL sockets):
    coordinator --Allocate--> decode --Allocated/Rejected--> coordinator
    coordinator --Prefill--> prefill --(KV pages over the transfer engine, then KVReady)--> decode
    decode --TokenBatch (one per step, all its requests)--> coordinator
A colocated worker takes Generate instead of Allocate + Prefill. Abort goes to every worker holding the
request. Workers report themselves with Heartbeat (to the coordinator, or to Redis); when one leaves the
registry, the coordinator tells the others with PeerLeft, and it sends every worker the registry's list
now and then (LivePeers). The other way, a coordinator renews its Lease with every worker each second: the
requests of a coordinator that went silent are ended, as nobody would read their tokens.
"""

from __future__ import annotations

import logging

import msgspec

logger = logging.getLogger(__name__)


class WorkerLoad(msgspec.Struct):
    waiting: int = 0
    running: int = 0
    queued_prefill_tokens: int = 0
    pending_allocations: int = 0
    free_pages: int = 0
    cached_pages: int = 0
    total_pages: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    retracted: int = 0
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transfer_count: int = 0
    transfer_failures: int = 0
    transfer_peers: int = 0  # peers the transfer engines hold connections or mappings for
    outbox_backlog: int = 0  # messages waiting for a peer that falls behind (engine/outbox.py)


class KVLayout(msgspec.Struct, frozen=True):
    """What two pools must agree on to exchange pages."""

    num_layers: int
    page_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    order: str = "NHD"  # the pool's layout within a page (kvstore/pool.py)
    # Per-layer K and V scales of the stored values (kvstore/pool.py); empty: all 1.0.
    k_scale: tuple[float, ...] = ()
    v_scale: tuple[float, ...] = ()
    # Tensor parallelism: the pool holds rank tp_rank's share of tp_size. Workers pair only with workers of
    # the same tp_size (the registry shows rank 0's layout); rank r's pages go to the peer's rank r.
    tp_size: int = 1
    tp_rank: int = 0

    @classmethod
    def of(cls, pool) -> "KVLayout":
        unit = all(s == 1.0 for s in pool.k_scale + pool.v_scale)
        return cls(pool.num_layers, pool.page_size, pool.kv_heads, pool.head_dim,
                   str(pool.dtype).removeprefix("torch."), pool.layout,
                   () if unit else tuple(pool.k_scale), () if unit else tuple(pool.v_scale),
                   pool.tp_size, pool.tp_rank)


class WorkerInfo(msgspec.Struct):
    worker_id: str
    role: str  # "prefill" | "decode" | "colocated"
    host: str
    ctrl_addr: str  # where the worker's PULL socket listens
    model: str
    layout: KVLayout
    max_total_tokens: int
    max_model_len: int
    transfer: dict[str, bytes] = {}  # backend name -> what a peer needs to reach this worker
    load: WorkerLoad = msgspec.field(default_factory=WorkerLoad)
    pid: int = 0
    started_at: float = 0.0
    # Fingerprints (engine/weights.py, engine/tokenizer.py); empty: unknown. Prefill and decode workers pair
    # only with equal `weights`; a coordinator serves only workers whose `vocab` is its tokenizer's.
    weights: str = ""
    vocab: str = ""
    # "serving"; "draining" once told to stop (SIGTERM): it finishes what it has and takes nothing new;
    # "stopped" in its last heartbeat, which takes it out of a coordinator's in-process registry at once.
    state: str = "serving"


class Heartbeat(msgspec.Struct, tag=True):
    info: WorkerInfo


class Generate(msgspec.Struct, tag=True):
    rid: str
    prompt_ids: list[int]
    params: dict
    reply_to: str


class Allocate(msgspec.Struct, tag=True):
    rid: str
    prompt_ids: list[int]
    params: dict
    reply_to: str
    backend: str  # transfer backend the KV will arrive by
    wait_s: float  # how long the decode worker may hold the request before it has room


class Allocated(msgspec.Struct, tag=True):
    rid: str
    worker_id: str
    pages: list[int]
    skip_pages: int  # leading pages the decode worker already has (from its prefix cache)
    # Seconds from this reply within which the KV must start on its way (--transfer-timeout); None: no limit.
    kv_timeout_s: float | None = None


class Rejected(msgspec.Struct, tag=True):
    rid: str
    worker_id: str
    reason: str
    retryable: bool = True


class Prefill(msgspec.Struct, tag=True):
    rid: str
    prompt_ids: list[int]
    params: dict
    reply_to: str
    decode_id: str
    decode_ctrl: str
    backend: str  # transfer backend agreed for this pair
    decode_endpoint: bytes  # the decode worker's transfer endpoint for that backend
    dst_pages: list[int]
    skip_pages: int
    # Seconds left to start sending the KV: past them the decode worker may reuse the pages, so nothing may be
    # written into them (the prefill worker fails the request instead). None: no limit.
    kv_deadline_s: float | None = None


# A prompt token's logprob and the top (token id, logprob) pairs at its position (params.prompt_logprobs); the
# token itself is the prompt's. Entry i of a list scores prompt token i + 1.
PromptLogprob = tuple[float, list[tuple[int, float]]]


class KVReady(msgspec.Struct, tag=True):
    """Prefill -> decode: the request's KV is in the decode pool; here is the first token."""

    rid: str
    first_token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[PromptLogprob] | None = None


class Abort(msgspec.Struct, tag=True):
    rid: str


class PeerLeft(msgspec.Struct, tag=True):
    """Coordinator -> workers: this worker left the registry; release what the transfer engines hold for it
    (a CUDA IPC mapping keeps the dead worker's whole KV pool allocated)."""

    worker_id: str


class Introduce(msgspec.Struct, tag=True):
    """Coordinator -> a prefill worker, once for each decode worker it may send KV to, when the coordinator
    first sees the two pair: connect now (a NIXL agent's metadata, a CUDA IPC mapping of the peer's pool, a
    socket), ahead of the first request between them, whose time to first token would pay for it."""

    peer_id: str
    backend: str
    endpoint: bytes


class LivePeers(msgspec.Struct, tag=True):
    """Coordinator -> workers, when it starts and every half minute: the workers in the registry. A worker
    lets go of transfer peers missing from it that it has not used for a while: peers whose PeerLeft it never
    got (it was sent while the coordinator was down, or dropped on a full queue)."""

    worker_ids: list[str]


class Lease(msgspec.Struct, tag=True):
    """Coordinator -> workers, before its first request to a worker and every second after: the coordinator
    whose socket is `reply_to` still reads what is sent there. A worker that hears nothing more from it for
    `ttl_s` ends the requests it placed (it crashed, or is cut off): they would decode for nobody, holding
    pages and batch slots, until their max_tokens. A `ttl_s` of 0 gives the lease back: the coordinator is
    stopping, and its requests end now."""

    reply_to: str
    ttl_s: float


class TokenDelta(msgspec.Struct):
    rid: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    cached_tokens: int = 0
    error: str | None = None
    # The error is the placement's, not the request's (its KV transfer failed): placing it again may succeed.
    retryable: bool = False
    prompt_logprobs: list[PromptLogprob] | None = None  # with a request's first token, when asked for


class TokenBatch(msgspec.Struct, tag=True):
    worker_id: str
    items: list[TokenDelta]


Message = (Heartbeat | Generate | Allocate | Allocated | Rejected | Prefill | KVReady | Abort | PeerLeft | Introduce
           | LivePeers | Lease | TokenBatch)

def wire_prompt_logprobs(req) -> list[PromptLogprob] | None:
    """A request's prompt logprobs as the wire carries them, or None when it did not ask for them."""
    if req.params.prompt_logprobs is None:
        return None
    return [(lp.logprob, list(lp.top)) for lp in req.prompt_logprobs]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes):
    """The message, or None for a malformed frame (logged): a bad frame never takes a process down."""
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        logger.warning("dropped a malformed message (%d bytes): %s", len(data), e)
        return None
