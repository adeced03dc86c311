"""GRPO post-training with prompts of hundreds of thousands to millions of tokens, as a TRL extension."""

from .config import LongStrawGRPOConfig
from .trainer import LongStrawGRPOTrainer

__version__ = "0.1.0.dev0"

__all__ = ["LongStrawGRPOConfig", "LongStrawGRPOTrainer", "__version__"]
