"""Context parallelism in a plan: each sequence of a micro-batch split over cp ranks (pass
`context_parallel`, its all-gather method, load-balanced), what it costs and saves per rank.

- compute: every rank runs its 1/cp of the tokens; with the head-tail split each rank's causal
  attention is 1/cp of the whole, so a micro-batch's compute (and activations) scale by 1/cp;
- attention's keys and values: each layer all-gathers the kv heads' K and V of the whole sequence
  in the forward (again in a full checkpoint's recompute) and reduce-scatters their gradients in
  the backward: b x T x kv_heads x head_dim x 2 (K, V) bf16 bytes each, over the cp x tp ranks'
  link, not overlapped (the all-gather method waits for them);
- memory: the gathered K and V (less the rank's own part, counted with its activations) stay
  for the backward of each layer the micro-batches in flight keep (one layer at a time under full
  checkpointing), and the backward holds one layer's gathered gradients before its reduce-scatter;
- gradients: summed over cp as over dp: the exchange spans dp x cp ranks (sharded: the shard group
  is dp_shard x cp, as torchtitan's FSDP x CP).

cp is planned where the sequence is long (LONG_SEQUENCE tokens or more) or where no layout without
it fits: cp dividing the GPUs left after tp and pp, the sequence divisible into 2 x cp chunks.
"""
from __future__ import annotations

from picofx.cost.comm import all_gather_seconds, reduce_scatter_seconds

LONG_SEQUENCE = 16384  # tokens per sequence from which plans consider cp beside the layouts without it
BF16 = 2


def cp_refusal(seq: int, cp: int) -> str | None:
    """Why a sequence of `seq` tokens cannot be split over `cp` ranks (None: it can)."""
    if cp > 1 and seq % (2 * cp):
        return (f"cp {cp} splits each sequence into 2 x {cp} = {2 * cp} chunks (the head-tail split that balances "
                f"causal attention), and {seq} tokens do not divide by {2 * cp}: make the sequence a multiple of "
                f"{2 * cp}, or choose a cp that divides it")
    return None


def cp_degrees(seq: int, ranks: int) -> list[int]:
    """The cp degrees (more than 1) of the `ranks` left after tp and pp that split `seq`."""
    return [cp for cp in range(2, ranks + 1) if ranks % cp == 0 and cp_refusal(seq, cp) is None]


def gathered_kv_bytes(config, seq: int, tp: int) -> int:
    """A layer's K and V of one whole sequence, bf16, of the kv heads one tp rank holds."""
    kv_heads = max(1, config.num_key_value_heads // tp)
    return 2 * kv_heads * config.head_dim * seq * BF16


def kv_exchange_seconds(config, seq: int, sequences: int, layers: int, tp: int, cp: int, link,
                        recompute_gathers: bool) -> float:
    """Per micro-batch of `sequences`: each of `layers` layers' K/V all-gather (twice where a full
    checkpoint recomputes the forward) and its gradients' reduce-scatter, over the cp ranks."""
    if cp == 1:
        return 0.0
    nbytes = sequences * gathered_kv_bytes(config, seq, tp)
    gathers = 2 if recompute_gathers else 1
    return layers * (gathers * all_gather_seconds(nbytes, cp, link) + reduce_scatter_seconds(nbytes, cp, link))


def gathered_kv_kept(config, seq: int, sequences: int, layers_kept: int, tp: int, cp: int) -> float:
    """Bytes per rank the gathered K and V add beyond the rank's own part: the other ranks' parts kept
    for `layers_kept` layers' backward, and one layer's gathered gradients before their reduce-scatter."""
    if cp == 1:
        return 0.0
    whole = sequences * gathered_kv_bytes(config, seq, tp)
    return layers_kept * whole * (1 - 1 / cp) + whole
