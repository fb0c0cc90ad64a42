"""sparkv: cloud-edge KV-cache streaming for on-device LLMs."""

import os as _os

# The edge runs PyTorch from several threads (layer steps, frame decoding, generation). GNU OpenMP
# gives every calling thread its own team whose workers busy-wait after each parallel region; on a
# small CPU those spinning teams steal the cores from whichever thread works next (measured here:
# the question prefill after a stream-only load took 2.5 s instead of 0.15 s). Passive waiting
# removes that and costs nothing measurable for our kernels. Only effective when sparkv is imported
# before torch; an explicit OMP_WAIT_POLICY in the environment wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
