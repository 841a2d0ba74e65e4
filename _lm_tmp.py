import time, torch
from course_lib import runtime
rt = runtime.setup()
from course_lib import tinylm
ds = tinylm.CharDataset()
cfg = tinylm.TinyLMConfig(vocab_size=ds.vocab_size, **tinylm.CPU_CONFIG)
res = {}
for name, fn in tinylm.ATTENTIONS.items():
    m = tinylm.TinyLM(cfg, fn, seed=0)
    t=time.time(); res[name] = tinylm.train(m, 20, seed=0); print(name, time.time()-t)
import numpy as np
a,b = np.array(res['flash']), np.array(res['sdpa'])
print(a[:3], a[-3:], b[-3:], np.abs(a-b).max())
