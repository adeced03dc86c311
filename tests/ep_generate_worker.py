"""Worker of tests/test_expert_parallel.py's generation test: shared-prompt generation under expert parallelism on 2
CPU processes (gloo).

Launched through `tests.helpers.torchrun` (2 processes), one case per model: `main(MODEL_PATH, OUT)`. The trainer loads
the MoE model with `expert_parallel_size=2` (2 of the 4 experts of each MoE layer per rank, the rest under FSDP2), so
every decoding forward runs the experts' all-to-alls, which need both ranks. Each rank:

- greedy generation through the trainer (`_generate_single_turn`), with the prompt state sharded over both ranks
  (the ranks hold other rows of the same prompts) and without it (data parallelism: rank 0 holds 2 distinct prompts,
  rank 1 holds 3, of other lengths and numbers of prefill chunks), against single-process transformers' `generate`
  of an unsharded copy of the model on the same rows. Prompts of 1 to 13 tokens, prefilled in chunks of 3 and
  left-padded; more EOS tokens on rank 0 (tokens its greedy completions draw early) make its rows finish steps
  before rank 1's. Records the decoding forwards, the filler steps and the collectives of each run;
- one whole `train()` step in detached and exact mode without a sharded state (each rank one prompt, of 11 and 5
  tokens), and with it in the GLM-5.2 config's shape (exact mode, LoRA, gradient checkpointing), counting per prompt
  position how often the policy's backbone embeds it, in generation and in the whole step.

Rank 0 writes every rank's results to `OUT`.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

PROMPTS = ["a b c d e f g h i j k l m", "h i j k l m n", "x", "o p q r s t u v w y", "n o p q"]
# Rows per rank: sharded, both ranks hold the same prompts; data-parallel, different ones (2 and 3 distinct).
ROWS = {"sharded": {0: [0, 1, 0, 2], 1: [2, 1, 0, 2]}, "data_parallel": {0: [0, 1, 0, 1], 1: [2, 3, 4, 2]}}
# train(): one prompt per rank without a sharded state (all tokens distinct, none the pad token 0).
TRAIN_PROMPTS = ["a b c d e f g h i j k", "l m n o p"]
CHUNK = 3


class PositionCounter:
    """Counts how often a backbone runs each `(token, position)`."""

    def __init__(self, backbone):
        self.counts: dict[tuple[int, int], int] = {}
        backbone.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(input_ids.shape[1])[None]
        positions = positions.expand_as(input_ids)
        for pair in zip(input_ids.flatten().tolist(), positions.flatten().tolist(), strict=True):
            self.counts[pair] = self.counts.get(pair, 0) + 1

    def prompt_passes(self, tokens: list[int]) -> list[int]:
        """How often each position before the last of a prompt `tokens` ran (at its unpadded position)."""
        return [self.counts.get((t, i), 0) for i, t in enumerate(tokens[:-1])]


def main(model_path: str, out_path: str) -> None:
    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    from datasets import Dataset
    from dist_worker import count_collectives
    from ep_worker import count_expert_exchanges
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, GenerationConfig

    import trl_longstraw.generation as generation
    from trl_longstraw import LongStrawGRPOConfig, LongStrawGRPOTrainer
    from trl_longstraw.generation import trim_after_eos
    from trl_longstraw.trainer import _causal_lm

    def reward(completions, **kwargs):
        return [float(len(c)) + i % 3 for i, c in enumerate(completions)]

    settings = dict(
        report_to=[],
        use_cpu=True,
        bf16=False,
        beta=0.0,
        prefill_progress=False,
        per_device_train_batch_size=2,
        num_generations=4,
        max_completion_length=8,
        prefill_chunk_size=CHUNK,
        shard_prompt_state=True,
        expert_parallel_size=2,
        save_only_model=True,
        router_aux_loss_coef=0.0,
        # The pad token is never drawn: its zero embedding gives glm_moe_dsa indexer keys that tie at the top-k
        # cut-off, where stock's order is unspecified (see glm_moe_dsa.py and decode_worker.py).
        generation_kwargs={"do_sample": False, "suppress_tokens": [0]},
    )
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    trainer = LongStrawGRPOTrainer(
        model_path, reward, LongStrawGRPOConfig(output_dir=tempfile.mkdtemp(), **settings), train_dataset=dataset
    )
    world, rank = dist.get_world_size(), dist.get_rank()  # the process group is the trainer's
    assert world == 2, f"the expert-parallel generation test needs 2 processes, got {world}"
    assert trainer._shared_generation, "expert parallelism fell back to transformers' generate"
    assert trainer._prompt_shards is not None and trainer._prompt_shards.world == 2
    model = trainer.model
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)  # single-process reference
    tokenizer = trainer.processing_class
    base_eos = list(trainer.eos_token_ids)

    log: list = []
    count_collectives(log)
    count_expert_exchanges(log)
    forwards = [0]
    model.register_forward_pre_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    fillers = [0]
    filler_step = generation._filler_step

    def counting_filler(*args, **kwargs):
        fillers[0] += 1
        return filler_step(*args, **kwargs)

    generation._filler_step = counting_filler

    def reference(ids: list[list[int]], eos: list[int]) -> list[list[int]]:
        width = max(len(x) for x in ids)
        padded = torch.tensor([[0] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        config = GenerationConfig.from_dict(trainer.generation_config.to_dict())
        config.eos_token_id = eos
        with torch.no_grad():
            out = plain.generate(input_ids=padded, attention_mask=mask, generation_config=config)
        return trim_after_eos(out[:, width:], eos)

    results: dict = {}
    shards = trainer._prompt_shards
    for mode in ("sharded", "data_parallel"):
        trainer._prompt_shards = shards if mode == "sharded" else None
        trainer._engines.clear()
        ids = [tokenizer(text=PROMPTS[i])["input_ids"] for i in ROWS[mode][rank]]
        # Ragged EOS: rank 0 also stops at the token its row k draws at step k + 2 (or its last), so all its rows end
        # before rank 1's longest.
        drawn = reference(ids, base_eos)
        eos = base_eos + ([row[min(k + 1, len(row) - 1)] for k, row in enumerate(drawn)] if rank == 0 else [])
        expected = reference(ids, eos)
        trainer.generation_config.eos_token_id = trainer.eos_token_ids = eos
        forwards[0] = fillers[0] = 0
        start = len(log)
        got, _ = trainer._generate_single_turn(ids, None, {}, 4)
        engine = trainer._engine(model)
        results[mode] = {
            "got": got,
            "expected": expected,
            "forwards": forwards[0],
            "fillers": fillers[0],
            "lockstep": engine.lockstep,
            "collectives": [(name, None if name.startswith("ep_") else shapes) for name, shapes in log[start:]],
        }
    generation._filler_step = filler_step
    trainer.generation_config.eos_token_id = trainer.eos_token_ids = base_eos
    del log[:]

    # Whole train() steps, TRL's defaults otherwise (beta = 0, num_iterations = 1).
    steps = {}
    # The sharded run has the GLM-5.2 config's shape: exact mode, LoRA, non-reentrant gradient checkpointing.
    lora = dict(
        peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["o_proj"]),
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    runs = [("dp_detached", False, "detached", {}), ("dp_exact", False, "exact", {}), ("sharded", True, "exact", lora)]
    # Completions never hold a prompt token, so a prompt token at its position is always that prompt's.
    prompt_tokens = sorted({t for p in TRAIN_PROMPTS for t in tokenizer(text=p)["input_ids"]})
    for name, sharded, mode, extra in runs:
        extra = dict(extra)
        peft_config = extra.pop("peft_config", None)
        prompts = TRAIN_PROMPTS[:1] if sharded else TRAIN_PROMPTS
        config = LongStrawGRPOConfig(
            output_dir=tempfile.mkdtemp(),
            **{
                **settings,
                "shard_prompt_state": sharded,
                "prompt_gradient": mode,
                # Without a sharded state, each rank holds one prompt's 2 rows: the ranks hold different prompts.
                "num_generations": 4 if sharded else 2,
                "generation_kwargs": {"do_sample": False, "suppress_tokens": [0, *prompt_tokens]},
            },
            max_steps=1,
            logging_steps=1,
            save_strategy="no",
            **extra,
        )
        dataset = Dataset.from_dict({"prompt": prompts})
        step = LongStrawGRPOTrainer(model_path, reward, config, train_dataset=dataset, peft_config=peft_config)
        assert step._shared_generation and (step._prompt_shards is not None) == sharded
        counter = PositionCounter(_causal_lm(step.model).model)
        generate = step._generate_single_turn
        in_generation: dict = {}

        def counted(*args, _generate=generate, _counter=counter, _seen=in_generation, **kwargs):
            before = dict(_counter.counts)
            out = _generate(*args, **kwargs)
            for key, value in _counter.counts.items():
                _seen[key] = _seen.get(key, 0) + value - before.get(key, 0)
            return out

        step._generate_single_turn = counted
        step.train()
        tokens = [tokenizer(text=p)["input_ids"] for p in prompts]
        generation_counter = PositionCounter.__new__(PositionCounter)
        generation_counter.counts = in_generation
        engine = next(iter(step._engines.values()))
        steps[name] = {
            "step": [counter.prompt_passes(t) for t in tokens],
            "generation": [generation_counter.prompt_passes(t) for t in tokens],
            "reused": step.state.log_history[0].get("longstraw/prompt_positions_reused", 0.0),
            "context_parallel": engine.context_parallel,
            "global_step": step.state.global_step,
        }

    everyone: list = [None] * world
    dist.all_gather_object(everyone, {"generation": results, "train": steps})
    if rank == 0:
        torch.save(everyone, out_path)
    dist.barrier()
