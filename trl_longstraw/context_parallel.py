"""Context-parallel prompt passes for a sharded prompt state (`shard_prompt_state`).

Without context parallelism every rank of a shard group runs every prefill and reverse chunk (only the prompt
attention is split, see `sharding`). With it, the prompt is cut into *rounds* of W consecutive chunks and, in round
`j`, rank `r` runs chunk `j * W + r` alone: the chunk it owns (`PromptShards.owner`). So each rank runs 1/W of the
prompt's tokens through every token-wise layer (embeddings, norms, projections, MLPs), in the prefill and in the
reverse pass, and keeps the records of the chunks it ran. MoE layers route each rank's own tokens, also under expert
parallelism (transformers' `all_to_all` sends every (token, expert) pair to the expert's rank: `expert_parallel`).

Token mixers see the other ranks' chunks of the round through collectives:

- attention (`sharding.sharded_prefix_attention` in a round, `PromptShards.cp_round`): the queries, keys and values
  of every rank are gathered; each rank attends every rank's queries to its own earlier chunks and the first half of
  each later rank's queries to its own chunk, and the partial outputs and log-sum-exps go back to the query owners,
  which merge them with their causal part and with their other half attended to the round's earlier chunks (the
  branch-round exchange; the halves keep the ranks' work equal within the round, `sharding._RoundSplit`);
- Gated DeltaNet (`qwen3_5`): head-parallel (Ulysses). One all-to-all (`exchange`) gives every rank the conv inputs
  and gates of `H / W` heads for all the round's tokens; it convolves them and runs the delta rule chunk after chunk
  from the conv history and state at the start of the round, as one process does; another all-to-all returns the
  outputs to the token owners, and one all-gather (`gather`) joins the heads' end-of-chunk conv tails and states
  into whole records;
- MLA with DSA (`glm_moe_dsa`): every rank gathers the round's compressed rows (`kv_lora_rank + qk_rope_head_dim`
  latent and rope key, and the indexer key: small, one row per token) and numbers them after the prefix; the
  indexer's top-k over the prefix chunks is taken as in a branch round (every rank's queries scored against each
  rank's chunks, the candidates merged by the query owners in key order), then over the round's rows causally, so it
  is the global top-k of one process, ties included; absorbed MLA attends the round's rows locally and the prefix
  through the branch-round exchange, merged by log-sum-exp. The exchanges run in slices of at most
  `glm_moe_dsa.EXCHANGE_ROWS` gathered queries (checkpointed with autograd), which bounds their memory whatever the
  chunk size and group size.

A round's tokens are split as the chunks fall: W chunks of `chunk_size`, and the last round's remainder evenly over
the ranks (`plan_rounds`); a remainder shorter than W runs as one replicated chunk (every rank runs it, the path
without context parallelism). Every collective here is differentiable with the semantics of `sharding`: each rank
back-propagates its own share of the loss, and the backward of a gather sums the shares of each rank's slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CPRound:
    """One context-parallel round of a prompt pass: rank `r` runs chunk `first + r` of `lengths[r]` tokens."""

    first: int
    lengths: list[int]
    rank: int

    @property
    def chunk(self) -> int:
        """The chunk this rank runs."""
        return self.first + self.rank

    @property
    def chunks(self) -> range:
        return range(self.first, self.first + len(self.lengths))


def plan_rounds(n: int, chunk_size: int, world: int) -> list[list[tuple[int, int]]]:
    """The passes of a prompt prefix of `n` tokens, as `(start, end)` per rank (a round of `world` chunks) or one
    `(start, end)` that every rank runs (a replicated chunk, for a remainder of fewer than `world` tokens).

    Rounds of `world` chunks of `chunk_size` tokens; the last, shorter round gives `remainder // world` tokens to each
    rank and one more to the first `remainder % world` ranks.
    """
    rounds: list[list[tuple[int, int]]] = []
    start = 0
    while start < n:
        remaining = n - start
        if remaining >= world * chunk_size:
            sizes = [chunk_size] * world
        elif remaining >= world:
            sizes = [remaining // world + (r < remaining % world) for r in range(world)]
        else:
            rounds.append([(start, n)])
            break
        bounds = []
        for size in sizes:
            bounds.append((start, start + size))
            start += size
        rounds.append(bounds)
    return rounds


# The exchanges of `sharding` (`_ReturnTokens`, `_GatherTokens`) without their token padding; `sharding` imports the
# engine (through `generation`), which imports this module, so they are not shared.
def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """`x` `[W, ...]`: slice `j` goes to rank `j`; the result's slice `s` came from rank `s`. Its own inverse."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group), None


class _AllGather(torch.autograd.Function):
    """`x` of every rank stacked `[W, ...]`; the backward gives each rank the sum of every rank's gradient of its
    slice (its share and the others')."""

    @staticmethod
    def forward(ctx, x, world: int, group):
        ctx.group = group
        out = x.new_empty(world, *x.shape)
        dist.all_gather_single(out, x.contiguous()[None], group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group).sum(0), None, None


def pad_tokens(x: torch.Tensor, t: int) -> torch.Tensor:
    """Zero-pads dim 0 of `x` to `t`."""
    if x.shape[0] == t:
        return x
    return torch.cat([x, x.new_zeros(t - x.shape[0], *x.shape[1:])])


def exchange(x: torch.Tensor, group) -> torch.Tensor:
    """All-to-all: `x` `[W, ...]`, slice `j` for rank `j` -> `[W, ...]`, slice `s` from rank `s`. Collective,
    differentiable (the backward is the all-to-all of the gradients)."""
    return _AllToAll.apply(x, group)


def gather(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """All-gather: `x` of every rank, stacked `[W, ...]`. Collective, differentiable (each rank's slice gets the sum of
    every rank's share of its gradient)."""
    return _AllGather.apply(x, world, group)
