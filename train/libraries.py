"""Which optional libraries a job's process may load, decided from its spec before anything imports them.

A job imports what its stage uses (docs/how-it-works.md: a job imports what its stage uses). Two libraries would load whether used
or not, so they are hidden from the jobs that do not use them:
- bitsandbytes: peft imports it whenever it is installed (peft/import_utils.py `is_bnb_available` is a
  `find_spec`, and peft.helpers then imports it), and bitsandbytes imports torch's inductor and dynamo
  stacks and probes for CPU kernels, printing a warning into every log: ~1 s of CPU at every start of a
  LoRA job that never quantizes. Only QLoRA (training, or evaluating on the 4-bit base it trained on)
  uses it.
- TRL is imported by the DPO recipe alone (train/stage.py imports it lazily); nothing hides it.
The VL processor classes load with the first image-text model (train/vl_processor.py).

Hiding is `sys.modules[name] = None`: Python's import system then answers `importlib.util.find_spec`
with None, as for a library that is not installed, which is what peft, transformers and accelerate ask
before they import it; an `import` of it raises ImportError. Nothing here imports torch: it runs first.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

QUANTIZATION = "bitsandbytes"


def unused_libraries(spec: Mapping) -> tuple[str, ...]:
    """The optional libraries a job of this spec (a TrainJob's or an EvalJob's, as a dict) never uses.
    Only a spec that says its adapter's method is plain LoRA gives up bitsandbytes; anything else (QLoRA,
    an export, a spec without an adapter) keeps every library."""
    adapter = spec.get("adapter")
    method = adapter.get("method", "lora") if isinstance(adapter, Mapping) else None
    return (QUANTIZATION,) if method == "lora" else ()


def hide(names: tuple[str, ...]) -> None:
    """Make each library look uninstalled to this process. A library already imported is left alone
    (hiding it then would break the modules holding it)."""
    for name in names:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]  # find_spec → None; import → ImportError
