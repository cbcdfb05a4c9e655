"""`epibus up`, exactly as a user runs it, with the scale bench's sampled embedding model in place of the model
(bench.sampled): `python -m bench.scale_node up --json ...`."""

from __future__ import annotations

import epibus.node.mirror
from bench.sampled import SampledEmbedder
from epibus.cli import main

if __name__ == "__main__":
    epibus.node.mirror.FastEmbedder = SampledEmbedder  # type: ignore[attr-defined]
    main()
