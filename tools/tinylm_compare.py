"""Train the tiny LM with course_lib.flash_attention and with SDPA (same seed); print the gap.

Run on either machine: ``python tools/tinylm_compare.py`` (sizes follow the runtime's mode).
"""

import time

from course_lib.platform import runtime
from course_lib.integrations import tinylm

rt = runtime.setup()
size = tinylm.run_size(rt.on_gpu)
dataset = tinylm.CharDataset()
losses = {}
for name, attention in tinylm.ATTENTIONS.items():
    config = tinylm.TinyLMConfig(vocab_size=dataset.vocab_size, **size.model)
    model = tinylm.TinyLM(config, attention, seed=0).to(rt.device)
    start = time.perf_counter()
    losses[name] = tinylm.train(model, size.steps, seed=0, batch_size=size.batch_size, dataset=dataset)
    print(f"{name}: {size.steps} steps in {time.perf_counter() - start:.1f} s, "
          f"loss {losses[name][0]:.4f} -> {losses[name][-1]:.4f}")
gap = max(abs(a - b) for a, b in zip(losses["flash"], losses["sdpa"]))
tol = tinylm.loss_tolerance(rt.on_gpu)
print(f"model {size.model}, batch {size.batch_size}: max |loss_flash - loss_sdpa| over "
      f"{size.steps} steps = {gap:.2e} (tolerance {tol:g}) -> {'OK' if gap <= tol else 'TOO LARGE'}")
