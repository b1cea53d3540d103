"""Tensor-parallel KV topology between a prefill and a decode instance (pure arithmetic).

Rank r of an instance with TP size T holds KV heads [r*H/T, (r+1)*H/T) of the model's H
KV heads when T <= H; when T > H each head is replicated on T/H consecutive ranks (rank r
holds head r // (T/H)); MLA caches hold one latent "head" replicated on every rank. The
ideas follow vLLM's ``TpKVTopology`` (0.32) / ``TransferTopology`` (0.33): ``tp_ratio``,
the remote ranks a rank talks to, replicated KV. Symmetric TP (same size both sides) maps
rank r to rank r with whole blocks; the rest is described by ``Piece``s: which heads of
which remote rank land in which of this rank's heads.
"""

from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    """A prefill/decode pair whose KV cannot be mapped head for head."""


@dataclass(frozen=True, slots=True)
class TpSide:
    tp_size: int
    num_kv_heads: int  # the model's total KV heads (1 for MLA)
    is_mla: bool = False

    @property
    def replicas(self) -> int:
        """Ranks holding the same heads (1: heads are split, not replicated)."""
        if self.is_mla:
            return self.tp_size
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def local_heads(self) -> int:
        return 1 if self.is_mla else max(1, self.num_kv_heads // self.tp_size)

    def heads_of(self, rank: int) -> range:
        """The global heads rank ``rank`` holds."""
        if self.is_mla:
            return range(0, 1)
        first = (rank // self.replicas) * self.local_heads
        return range(first, first + self.local_heads)


@dataclass(frozen=True, slots=True)
class Piece:
    """Heads ``remote_heads`` (local indices on ``remote_rank``) are this rank's heads
    ``local_heads`` (local indices here)."""

    remote_rank: int
    remote_heads: slice
    local_heads: slice

    @property
    def whole(self) -> bool:
        return self.remote_heads == self.local_heads


def check(prefill: TpSide, decode: TpSide) -> None:
    """Raise TopologyError (naming both sides) when the pair cannot be mapped."""
    both = f"prefill tp={prefill.tp_size} heads={prefill.num_kv_heads} mla={prefill.is_mla}, " \
           f"decode tp={decode.tp_size} heads={decode.num_kv_heads} mla={decode.is_mla}"
    for side in (prefill, decode):
        if side.tp_size < 1 or side.num_kv_heads < 1:
            raise TopologyError(f"tp size and kv heads must be >= 1 ({both})")
    if prefill.is_mla != decode.is_mla:
        raise TopologyError(f"one side uses MLA and the other does not ({both})")
    if prefill.num_kv_heads != decode.num_kv_heads:
        raise TopologyError(f"different numbers of KV heads: not the same model ({both})")
    big, small = max(prefill.tp_size, decode.tp_size), min(prefill.tp_size, decode.tp_size)
    if big % small:
        raise TopologyError(f"TP sizes must divide each other ({both})")
    for side in (prefill, decode):
        if not side.is_mla and side.tp_size > side.num_kv_heads and side.tp_size % side.num_kv_heads:
            raise TopologyError(f"TP size {side.tp_size} is not a multiple of the {side.num_kv_heads} KV heads "
                                f"({both})")
        if not side.is_mla and side.tp_size <= side.num_kv_heads and side.num_kv_heads % side.tp_size:
            raise TopologyError(f"{side.num_kv_heads} KV heads do not split evenly over TP {side.tp_size} ({both})")


def tp_ratio(prefill: TpSide, decode: TpSide) -> int:
    """decode TP / prefill TP when >= 1, else -(prefill TP / decode TP) (vLLM's sign
    convention: negative when the decode side has fewer ranks)."""
    if decode.tp_size >= prefill.tp_size:
        return decode.tp_size // prefill.tp_size
    return -(prefill.tp_size // decode.tp_size)


def sources(prefill: TpSide, decode: TpSide, decode_rank: int) -> list[Piece]:
    """Where decode rank ``decode_rank`` gets each of its heads from. Replicated heads come
    from one prefill rank among those holding them, chosen by the decode rank (spreads load)."""
    check(prefill, decode)
    wanted = decode.heads_of(decode_rank)
    pieces: list[Piece] = []
    for i, head in enumerate(wanted):
        owners = [r for r in range(prefill.tp_size) if head in prefill.heads_of(r)]
        src = owners[decode_rank % len(owners)]
        remote = head - prefill.heads_of(src).start
        last = pieces[-1] if pieces else None
        if last is not None and last.remote_rank == src and last.remote_heads.stop == remote \
                and last.local_heads.stop == i:
            pieces[-1] = Piece(src, slice(last.remote_heads.start, remote + 1), slice(last.local_heads.start, i + 1))
        else:
            pieces.append(Piece(src, slice(remote, remote + 1), slice(i, i + 1)))
    return pieces


def targets(prefill: TpSide, decode: TpSide, prefill_rank: int) -> list[tuple[int, Piece]]:
    """The decode ranks prefill rank ``prefill_rank`` sends to, each with its piece (the
    inverse of ``sources``)."""
    out = []
    for d in range(decode.tp_size):
        out += [(d, p) for p in sources(prefill, decode, d) if p.remote_rank == prefill_rank]
    return out


@dataclass(frozen=True, slots=True)
class Route:
    """What a prefill rank sends to one decode rank: ``piece`` is entry ``index`` of that
    decode rank's ``sources`` (``count`` entries), so the decode rank knows which key
    each piece arrives under and when it has all of them."""

    decode_rank: int
    index: int
    count: int
    piece: Piece


def routes(prefill: TpSide, decode: TpSide, prefill_rank: int) -> list[Route]:
    """``targets`` with each piece's place in its decode rank's list (empty: this rank's
    heads are all fetched from another replica)."""
    out = []
    for d in range(decode.tp_size):
        src = sources(prefill, decode, d)
        out += [Route(d, i, len(src), p) for i, p in enumerate(src) if p.remote_rank == prefill_rank]
    return out


def piece_key(transfer_key: str, index: int) -> str:
    """The receive-buffer key of piece ``index`` of a transfer split over prefill ranks."""
    return f"{transfer_key}/{index}"


def supported_by_data_path(prefill: TpSide, decode: TpSide, get_mode: bool = False) -> str | None:
    """Why this pair cannot transfer with the data path, or None. Heterogeneous TP ships
    head slices per target rank (PUT, PUT_ASYNC); GET pulls whole blocks from the same
    rank, so it needs equal TP."""
    check(prefill, decode)
    if get_mode and prefill.tp_size != decode.tp_size:
        return (f"heterogeneous tensor parallelism (prefill tp={prefill.tp_size}, decode tp={decode.tp_size}) "
                "is not supported with send_type GET: use PUT or PUT_ASYNC, or run prefill and decode "
                "with the same --tensor-parallel-size")
    return None
