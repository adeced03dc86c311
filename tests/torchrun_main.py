"""The `__main__` of the 2-process test workers (`dist_worker`, `ep_worker`, `cp_worker`, `decode_worker`)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

import torch.distributed as dist


def run(main: Callable[..., None], args: list[str]) -> None:
    """Runs `main(*args)`, prints any exception, destroys the process group and exits with 0 or 1.

    The exit is explicit (`os._exit`): gloo FSDP runs can abort while the interpreter tears down after passing.
    """
    code = 0
    try:
        main(*args)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(code)
