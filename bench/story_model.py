"""What the in-process context-service benches start from (``density_tax.py``,
``import_context.py``, ``read_handoff.py``): SmolLM2 on 2 torch threads and the bundled story."""

from __future__ import annotations

from typing import Any


def story_model(tokens: int) -> tuple[Any, Any, list[int]]:
    """The bundled model (2 torch threads), the story's question set and its first ``tokens``
    token ids."""
    import torch

    from sparkv.bench.qa import DATA_DIR, load_qa_set
    from sparkv.runtime.model import load_model

    torch.set_num_threads(2)
    lm = load_model(None, progress=False)
    qa = load_qa_set(DATA_DIR / "qa_story.json")
    return lm, qa, lm.encode_text(qa.text(qa.items[0].slice))[:tokens]
