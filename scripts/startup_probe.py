"""What ``focus-jax serve`` spends before its weights begin to load: the imports, the device's
start and the folder's description (config.json and the tokenizer), timed in its order in one
process. Prints one JSON object of cumulative seconds.

    python3 scripts/startup_probe.py /tmp/sdar8b              # the tokenizer loaded in line
    python3 scripts/startup_probe.py /tmp/sdar8b --beside     # as the server: on its own thread
"""

import json
import sys
import time

T0 = time.perf_counter()
marks = {}


def mark(name):
    marks[name] = round(time.perf_counter() - T0, 3)


import jax  # noqa: E402

mark("import jax")
import focus_jax.cli  # noqa: E402,F401

mark("import focus_jax.cli")
from focus_jax.checkpoint import TokenizerLoad, describe  # noqa: E402
from focus_jax.engine import AsyncEngine  # noqa: E402,F401

mark("import checkpoint, engine")
from focus_jax.serve import ServeSettings, create_app  # noqa: E402,F401

mark("import focus_jax.serve")
import transformers  # noqa: E402,F401

mark("import transformers")
devices = jax.devices()
mark(f"jax.devices() ({devices[0].platform})")
x = jax.numpy.ones(4).block_until_ready()
mark("first array on the device")
if "--beside" in sys.argv[2:]:
    pending = TokenizerLoad(sys.argv[1])
    described = describe(sys.argv[1], tokenizer=pending)
    mark("describe(folder), the tokenizer loading beside")
    pending.result()
    mark("the tokenizer loaded")
else:
    described = describe(sys.argv[1])
    mark("describe(folder)")
print(json.dumps(marks))
