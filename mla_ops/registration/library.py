"""The one `torch.library.Library` object for the `mla` namespace.

It must stay alive for the whole process: an op's registrations live as long as the Library
object that made them (vLLM's `direct_register_custom_op` notes the same). Kernels are attached with
`lib.impl(name, fn, dispatch_key)` and fakes with `lib._register_fake` — plain Library calls rather
than the `torch.library.custom_op` decorator, whose Python wrapper costs ~25 µs per call here (a
tenth of a decode-step kv_prolog).
"""
import torch

NAMESPACE = "mla"

lib = torch.library.Library(NAMESPACE, "DEF")
