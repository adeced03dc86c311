"""Done-when (b): `trainer.train()` for 3 optimizer steps gives stock's loss trajectory (fp32, exact mode).

beta > 0 (a separate reference model, or the PEFT model with adapters disabled), num_iterations = 2, fixed seed.
Step 1 is the first iteration over a generation batch (old-policy log-probs come from the loss passes), step 2 the
second iteration over it (old and current policy differ), step 3 generates again with the updated weights.

- greedy: the G greedy completions of a prompt are identical, so their advantages cancel and the policy term has
  no gradient; an entropy bonus makes the weights move from step 1, then the KL term takes part. Four prompts per
  generation batch, all in one micro-batch: the entropy bonus is a mean per micro-batch, so stock's row shuffle
  and LongStraw's group shuffle must not split the batch differently. Plain SGD: this gradient is small, and
  Adam's first updates divide each element by its own magnitude, which turns elements whose gradient is at rounding
  level into moves of +-lr in either run.
- sampled: one prompt per generation batch, so stock's `generate` draws from the random stream exactly as the
  shared-prompt decoder does for that prompt: same completions, nonzero advantages, clipped ratios in step 2.
  group_shuffle=False keeps stock's row shuffle, hence the same random stream afterwards.
"""

import pytest
from grpo_pair import make_pair, position_reward
from peft import LoraConfig
from tolerances import GRAD_RTOL, LOSS_ATOL
from transformers import set_seed

CASES = {
    "greedy": dict(
        generation_kwargs={"do_sample": False},
        entropy_coef=0.1,
        per_device_train_batch_size=12,
        gradient_accumulation_steps=1,
        optim="sgd",
        learning_rate=5.0,
    ),
    "sampled": dict(
        per_device_train_batch_size=3,
        gradient_accumulation_steps=1,
        learning_rate=1e-2,
        longstraw={"group_shuffle": False},
    ),
}


def history(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


@pytest.mark.slow
@pytest.mark.parametrize("case,peft", [("greedy", False), ("sampled", False), ("sampled", True)])
def test_three_steps_match_stock(tiny_model_path, case, peft):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    settings = dict(CASES[case])
    longstraw = {"prompt_gradient": "exact", **settings.pop("longstraw", {})}
    stock, ours = make_pair(
        tiny_model_path("llama"),
        peft_config=lora if peft else None,
        longstraw=longstraw,
        reward=position_reward,
        beta=0.1,
        num_iterations=2,
        num_generations=3,
        max_steps=3,
        max_completion_length=6,
        loss_type="dapo",
        **settings,
    )
    for trainer in (stock, ours):
        set_seed(0)
        trainer.train()
    stock_loss, our_loss = history(stock, "loss"), history(ours, "loss")
    assert len(stock_loss) == len(our_loss) == 3
    for step, (a, b) in enumerate(zip(stock_loss, our_loss, strict=True)):
        assert abs(a - b) <= LOSS_ATOL, f"step {step + 1}: stock {a} ours {b}"
    for a, b in zip(history(stock, "grad_norm"), history(ours, "grad_norm"), strict=True):
        assert abs(a - b) <= GRAD_RTOL * a
    # A trajectory that moves: real gradients at every step, and the reference term active after step 1.
    assert all(g > 1e-3 for g in history(stock, "grad_norm"))
    assert all(kl > 0 for kl in history(stock, "kl")[1:])
