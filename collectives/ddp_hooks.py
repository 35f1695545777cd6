"""The DDP communication hooks under their documented name (they live in
integrations/ddp_hooks.py): `from collectives.ddp_hooks import int8_hook`."""

from collectives.integrations.ddp_hooks import (
    OnebitHookState,
    TopKHookState,
    allreduce_hook,
    fp16_hook,
    int4_hook,
    int8_hook,
    onebit_hook,
    topk_hook,
)

__all__ = ["OnebitHookState", "TopKHookState", "allreduce_hook", "fp16_hook", "int4_hook",
           "int8_hook", "onebit_hook", "topk_hook"]
