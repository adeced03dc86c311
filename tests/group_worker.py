"""Worker of tests/test_shard_groups.py: one rank of a 4-process CPU (gloo) run with the prompt state sharded over
shard groups of 2 ranks (ranks 0-1 and 2-3) and the model under FSDP2 over all 4.

Launched by the test through `tests.helpers.torchrun` (4 processes), one case per model: `main(MODEL_PATH, BATCHES,
OUT)`. `BATCHES` is a `torch.save`d dict of global micro-batches (each row tagged with the rank that runs it, see
`make_group_batches`). The worker applies `fully_shard` to every decoder layer and the root and runs, through
`trainer.training_step`:

- `exact`: exact mode with non-reentrant gradient checkpointing, `G` under `set_requires_gradient_sync(False)`
  (gradient accumulation), then `H`;
- `detached`: detached mode, `G`.

The two groups hold different prompts, numbers of prompts, chunks and completions, so they run different numbers of
passes; the engine pads each group's passes to the world's agreed counts, and FSDP2 gathers and frees the layers pass
by pass. Each rank records its collectives (`dist_worker.count_collectives`) and, whenever FSDP2 gathers, how many
decoder layers are gathered (`dist_worker.probe_gathers`).

Then each rank generates greedily on the FSDP2 model with the trainer's engine (`generate_in_lockstep`): group 0
holds two prompts of 13 and 7 tokens (left-padded to 13), group 1 one of 22, in chunks of 5; each rank stops on other
EOS tokens, taken from a free-running `generate` of its rows, so that rank 0's rows end after 1 token, rank 1's after
2 or 3, rank 2's within 5 and rank 3's rows run to the maximum of 8: rank 0 steps on in its group's branch
rounds, group 0 runs filler steps while group 1 decodes, and group 1 filler prefills and steps through group 0's
second prompt. The reference is transformers' `generate` on the unsharded model with the same rows and EOS tokens.
The ranks generate once more offering the prompt states to an exact-mode loss pass, as in training (prefilled with
chunk boundaries after each prompt's left padding).

Rank 0 writes the full (gathered) parameter gradients and every rank's records to `OUT`.

`expert_parallel` (a case of its own, `group_worker:expert_parallel`) runs the MoE model (glm_moe_dsa) loaded
expert-parallel by the trainer over all 4 processes (`EP_SIZE`: one expert per rank, the EP group spanning both shard
groups) with the same shard groups: the same gradient scenarios and generation.

`whole_step` (`group_worker:whole_step`, one case per mode) runs one whole `trainer.train()` step (generation + loss)
of a model loaded
under FSDP2 by transformers (`distributed_config={"fsdp_size": 4}`) with the same shard groups, and writes each
rank's micro-batch and the gradients before the optimizer step for a single-process comparison.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

WORLD = 4
GROUP_SIZE = 2


def make_group_batches(vocab_size: int) -> dict[str, dict]:
    """Global micro-batches of 12 rows, 3 per rank; `rank` says which rank runs each row.

    `G`: group 0 (ranks 0, 1) holds two prompts of 13 and 7 tokens with 2 + 1 and 1 + 2 completions, group 1 (ranks 2,
    3) one prompt of 22 tokens with 3 + 3 completions: in chunks of 5, 2 prompts against 1, different numbers of
    prefill and reverse passes and of branch rounds. `H`: the other way round, group 0 one prompt of 17 tokens, group 1
    two of 9 and 4 tokens. Completions of 1 to 9 tokens.
    """
    from trl_longstraw.testing import random_micro_batch

    layouts = {
        # (prompt lengths, completion lengths, prompt of row, rank of row)
        "G": (
            [13, 7, 22],
            [9, 1, 5, 3, 4, 6, 2, 8, 1, 7, 1, 6],
            [0, 0, 1, 0, 1, 1, 2, 2, 2, 2, 2, 2],
            [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3],
        ),
        "H": (
            [17, 9, 4],
            [4, 2, 7, 3, 5, 1, 6, 9, 2, 1, 3, 5],
            [0, 0, 0, 0, 0, 0, 1, 1, 2, 1, 2, 2],
            [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3],
        ),
    }
    batches = {}
    for i, (key, (prompts, completions, prompt_of_row, rank_of_row)) in enumerate(layouts.items()):
        batch = random_micro_batch(prompts, completions, prompt_of_row, vocab_size, seed=40 + i, completion_width=9)
        g = torch.Generator().manual_seed(50 + i)
        batch["ref_per_token_logps"] = -torch.rand(batch["completion_ids"].shape, generator=g) * 5
        batch["rank"] = torch.tensor(rank_of_row)
        batches[key] = batch
    return batches


# Generation: prompts (lengths), the rows of each rank (prompt indices) and the maximum of new tokens. The ranks of a
# group hold the same prompts; group 0's two are left-padded to the longer one.
GEN_PROMPTS = [13, 7, 22]
GEN_ROWS = {0: [0, 1, 0], 1: [1, 0, 1], 2: [2, 2, 2], 3: [2, 2, 2]}
GEN_MAX_NEW_TOKENS = 8


def generation_prompts(vocab_size: int) -> list[list[int]]:
    """`GEN_PROMPTS` of random ids, without the tokenizer's special tokens (pad 0, eos 1, unk 2)."""
    g = torch.Generator().manual_seed(60)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in GEN_PROMPTS]


def rank_eos(free: list[list[int]], rank: int, pad: int) -> list[int]:
    """This rank's EOS tokens, from the free-running completions `free` of its rows: rank 0 each row's first token (its
    rows end after 1 token), rank 1 its first row's second and its second row's third (its rows end within 2 and 3
    tokens), rank 2 its first row's fifth (within 5); rank 3 none but the pad token, which is never drawn (its rows
    run to the maximum)."""
    if rank == 0:
        return sorted({row[0] for row in free})
    if rank == 1:
        return sorted({free[0][1], free[1][2]})
    if rank == 2:
        return [free[0][4]]
    return [pad]


def generate_in_lockstep(trainer, fsdp, log: list, reference=None) -> list[dict]:
    """Greedy completions of this rank's `GEN_ROWS` from the FSDP2 model `fsdp` with the trainer's engine (shard
    groups of 2, in the world lockstep) and from transformers' `generate` on the unsharded `reference` (default
    `trainer.model`); every rank's results, the FSDP2 collectives of the decoding and whether the parameters stayed
    DTensors."""
    reference = trainer.model if reference is None else reference
    from torch.distributed.tensor import DTensor
    from transformers import GenerationConfig

    from trl_longstraw.generation import generate_shared, trim_after_eos

    rank = dist.get_rank()
    pad = trainer._tokenizer.pad_token_id
    prompts = generation_prompts(trainer.model.config.get_text_config().vocab_size)
    ids = [prompts[i] for i in GEN_ROWS[rank]]
    width = max(len(x) for x in ids)
    padded = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])

    def config(eos: list[int]) -> GenerationConfig:
        # The pad token is never drawn: its zero embedding gives glm_moe_dsa indexer keys that tie at the top-k
        # cut-off, where stock's order is unspecified (see glm_moe_dsa.py).
        return GenerationConfig(
            max_new_tokens=GEN_MAX_NEW_TOKENS,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=eos,
            suppress_tokens=[pad],
            disable_compile=True,
        )

    def stock(eos: list[int]) -> list[list[int]]:
        with torch.no_grad():
            out = reference.generate(input_ids=padded, attention_mask=mask, generation_config=config(eos))
        return trim_after_eos(out[:, width:], eos)

    free = stock([pad])
    eos = rank_eos(free, rank, pad)
    expected = stock(eos)
    assert trainer._shared_generation, "the trainer generates with transformers' generate"
    engine = trainer._engine(fsdp)
    assert engine.lockstep and engine.shards is not None and engine.shards.world < dist.get_world_size()
    start = len(log)
    with torch.no_grad():
        got = generate_shared(fsdp, engine, ids, config(eos), pad, eos, None, torch.device("cpu"))
    collectives = log[start:]
    # Again as in training, offering each prompt's state to an exact-mode loss pass: prefilled with chunk boundaries
    # at the positions the loss pass gives it (after its left padding), which the ranks of a group agree on.
    offers: list[tuple[int, int]] = []
    offer = engine.offer
    engine.offer = lambda group, state: (offers.append((group.pad, len(group.tokens))), offer(group, state))
    with torch.no_grad():
        offered = generate_shared(fsdp, engine, ids, config(eos), pad, eos, None, torch.device("cpu"), True)
    engine.offer = offer
    engine.release()
    mine = {
        "got": got,
        "expected": expected,
        "free": free,
        "offered": offered,
        "offers": offers,
        "dtensors": all(isinstance(p, DTensor) for p in fsdp.parameters()),
        "collectives": collectives,
    }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def full_grads(model) -> dict[str, torch.Tensor | None]:
    """Every parameter's whole gradient, gathered from its DTensor."""
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = None if g is None else g.detach().clone()
    return grads


def main(model_path: str, batches_path: str, out_path: str) -> None:
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    from accelerate import PartialState
    from datasets import Dataset
    from dist_worker import count_collectives, probe_gathers, rows_of, trainer_config
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trl_longstraw import LongStrawGRPOTrainer

    PartialState()  # the process group, as the trainers' accelerator sets it up
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == WORLD, f"the shard group tests need {WORLD} processes, got {world}"
    batches = torch.load(batches_path)
    log: list = []
    count_collectives(log)
    mesh = init_device_mesh("cpu", (world,))
    config = trainer_config(
        tempfile.mkdtemp(), num_generations=8, shard_prompt_state=True, prompt_shard_group_size=GROUP_SIZE
    )
    trainer = LongStrawGRPOTrainer(
        model_path,
        lambda completions, **kw: [0.0] * len(completions),
        config,
        Dataset.from_dict({"prompt": ["a"] * 8}),
    )
    assert trainer.accelerator.num_processes == WORLD
    shards = trainer._prompt_shards
    assert shards is not None and shards.world == GROUP_SIZE
    assert dist.get_process_group_ranks(shards.group) == [r for r in range(world) if r // 2 == rank // 2]
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    # FSDP2 applied directly: on CPU, accelerate would silently turn an FSDP config into DDP.
    fsdp = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    add_fused_lm_head(fsdp, temperature=trainer.temperature, outputs=("log_probs", "entropy"))
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in fsdp.parameters()), "FSDP2 is not active"
    gathered, most_gathered = probe_gathers(fsdp)
    per_family: dict = {"grads": {}, "collectives": {}, "gathered": {}}
    for name, mode, micro_batches in [("exact", "exact", "GH"), ("detached", "detached", "G")]:
        start = len(log)
        fsdp.zero_grad(set_to_none=True)
        gathered.clear()
        if mode == "exact":  # as the recipes run FSDP2: recomputed layers are gathered again by FSDP2
            fsdp.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer.args.prompt_gradient = mode
        for i, key in enumerate(micro_batches):
            fsdp.set_requires_gradient_sync(i == len(micro_batches) - 1)
            batch = batches[key]
            trainer.training_step(fsdp, rows_of(batch, rank), batch["num_items_in_batch"])
        fsdp.gradient_checkpointing_disable()
        assert trainer._engine(fsdp).lockstep, "the engine does not pad the groups' passes"
        assert all(isinstance(p, DTensor) for p in fsdp.parameters()), "parameters left unsharded"
        per_family["grads"][name] = full_grads(fsdp)
        per_family["collectives"][name] = log[start:]
        per_family["gathered"][name] = most_gathered()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (per_family["collectives"], per_family["gathered"]))
    results = {
        "grads": per_family["grads"],
        "collectives": [e[0] for e in everyone],
        "gathered": [e[1] for e in everyone],
        "layers": len(fsdp.model.layers),
        "generation": generate_in_lockstep(trainer, fsdp, log),
    }
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()


# Expert parallelism over all 4 processes (1 of the tiny glm_moe_dsa's 4 experts per rank): the EP group spans both
# shard groups.
EP_SIZE = 4


def expert_parallel(model_path: str, batches_path: str, out_path: str) -> None:
    """A MoE model loaded expert-parallel by the trainer (`expert_parallel_size=EP_SIZE`, FSDP2 by transformers) with
    shard groups of 2. Rank 0 writes to `out_path` the gradients of the `exact` and `detached` scenarios, how many
    experts the expert modules held in their forwards on each rank, and the generation of `generate_in_lockstep`
    (against `generate` on the model loaded whole)."""
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    from accelerate import PartialState
    from datasets import Dataset
    from dist_worker import count_collectives, rows_of, trainer_config
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from trl_longstraw import LongStrawGRPOTrainer
    from trl_longstraw.expert_parallel import local_experts

    PartialState()
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD, f"the shard group tests need {WORLD} processes"
    batches = torch.load(batches_path)
    log: list = []
    count_collectives(log)
    config = trainer_config(
        tempfile.mkdtemp(),
        num_generations=8,
        shard_prompt_state=True,
        prompt_shard_group_size=GROUP_SIZE,
        expert_parallel_size=EP_SIZE,
        save_only_model=True,
        router_aux_loss_coef=0.0,
    )
    dataset = Dataset.from_dict({"prompt": ["a"] * 8})
    trainer = LongStrawGRPOTrainer(model_path, lambda completions, **kw: [0.0] * len(completions), config, dataset)
    assert trainer._prompt_shards is not None and trainer._prompt_shards.world == GROUP_SIZE
    model = trainer.model
    assert all(isinstance(p, DTensor) for p in model.parameters()), "FSDP2/EP is not active on every parameter"
    trainer._prepare_inputs = lambda x: x
    trainer.current_gradient_accumulation_steps = 1
    # The experts each expert module holds while it runs: 1 of 4 if they are never gathered across the EP group.
    experts: set[int] = set()

    def watch(module, args):
        experts.add(module.gate_up_proj.to_local().shape[0])

    for name in local_experts(model):
        model.get_submodule(name).register_forward_pre_hook(watch)
    grads = {}
    for name, mode, micro_batches in [("exact", "exact", "GH"), ("detached", "detached", "G")]:
        model.zero_grad(set_to_none=True)
        trainer.args.prompt_gradient = mode
        if mode == "exact":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for i, key in enumerate(micro_batches):
            model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            trainer.training_step(model, rows_of(batches[key], rank), batches[key]["num_items_in_batch"])
        model.gradient_checkpointing_disable()
        assert trainer._engine(model).lockstep, "the engine does not pad the groups' passes"
        grads[name] = full_grads(model)
    whole = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    generation = generate_in_lockstep(trainer, model, log, whole)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(experts))
    if rank == 0:
        torch.save({"grads": grads, "experts": everyone, "generation": generation}, out_path)
    dist.barrier()


# The whole-step case: two prompts of these lengths in tokens (one per shard group; chunks of 5), 8 completions each.
STEP_PROMPT_TOKENS = (13, 22)


def step_prompts() -> list[str]:
    """`STEP_PROMPT_TOKENS` words of the tiny tokenizer's vocabulary (one token each), no word shared."""
    from trl_longstraw.testing import WORDS

    words = iter(sorted(WORDS))
    return [" ".join(next(words) for _ in range(n)) for n in STEP_PROMPT_TOKENS]


def step_reward(completions, **kwargs) -> list[float]:
    """Rewards that differ within a group (nonzero advantages), from each completion's text alone."""
    return [float(sum(map(ord, str(c))) % 7) for c in completions]


def whole_step(model_path: str, mode: str, out_path: str) -> None:
    """One whole `trainer.train()` step (generation + loss, `prompt_gradient=mode`, TRL's `beta=0`,
    `num_iterations=1`; gradient checkpointing in exact mode, as the recipes run it) with shard groups of 2 under
    FSDP2 over all 4 processes.

    FSDP2 comes from transformers' distributed loading (`model_init_kwargs={"distributed_config": {"fsdp_size": 4}}`:
    `fully_shard` on the embeddings, every decoder layer, the final norm with the head, and the root), which the
    trainer takes as it takes an expert-parallel model: Trainer neither wraps it in DDP nor shards it again, as
    accelerate would turn an FSDP config into DDP on CPU. The step generates with the trainer's decoder in the world
    lockstep (group 0 one prompt, group 1 another, sampled completions), the loss pass takes generation's prompt
    states, and the optimizer steps. Rank 0 writes every rank's micro-batch (as `training_step` received it), the
    whole gradients just before the optimizer step (clipping off) and the checks of the setup."""
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    from accelerate import PartialState
    from datasets import Dataset
    from dist_worker import trainer_config
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from transformers import TrainerCallback

    from trl_longstraw import LongStrawGRPOTrainer

    PartialState()
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD, f"the shard group tests need {WORLD} processes"
    config = trainer_config(
        tempfile.mkdtemp(),
        num_generations=8,
        shard_prompt_state=True,
        prompt_shard_group_size=GROUP_SIZE,
        beta=0.0,
        prompt_gradient=mode,
        gradient_checkpointing=mode == "exact",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        model_init_kwargs={"distributed_config": {"fsdp_size": WORLD}},
        max_steps=1,
        max_grad_norm=0.0,
        save_strategy="no",
        shuffle_dataset=False,
        disable_tqdm=True,
        seed=7,
    )
    trainer = LongStrawGRPOTrainer(model_path, step_reward, config, Dataset.from_dict({"prompt": step_prompts()}))
    model = trainer.model
    layers = model.model.layers
    setup = {
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "layers_sharded": [isinstance(layer, FSDPModule) for layer in layers] + [isinstance(model, FSDPModule)],
        "shard_group": dist.get_process_group_ranks(trainer._prompt_shards.group),
        "shared_generation": trainer._shared_generation,
    }
    seen: dict = {}
    prepare = trainer._prepare_inputs

    def capture(generation_batch):
        batch = prepare(generation_batch)
        seen["batch"] = {k: v.detach().clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
        return batch

    class BeforeUpdate(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen["grads"] = full_grads(model)
            seen["dtensors_after"] = all(isinstance(p, DTensor) for p in model.parameters())
            # The loss pass's prompt positions, prefilled by itself or taken from generation's offer (logged later).
            metrics = trainer._metrics["train"]
            seen["positions"] = [
                metrics[f"longstraw/{k}"][-1] for k in ("prompt_positions", "prompt_positions_reused")
            ]

    trainer._prepare_inputs = capture
    trainer.add_callback(BeforeUpdate())
    trainer.train()
    setup["lockstep"] = [engine.lockstep for engine in trainer._engines.values()]
    setup["dtensors_after"], setup["loss_pass_positions"] = seen["dtensors_after"], seen["positions"]
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, (seen["batch"], setup))
    if rank == 0:
        torch.save(
            {"batches": [e[0] for e in everyone], "setup": [e[1] for e in everyone], "grads": seen["grads"]}, out_path
        )
    dist.barrier()
