"""An expert-parallel follower process: rank N of the group its leader
started (``llm_core.ep_engine.launch_local_group``), building its own ``LLM``
and following the leader's calls until told to stop."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import torch

from llm_core.ep_engine import _rank_device, follow, handshake
from llm_core.model.expert_parallel import ExpertParallelError, init_expert_parallel
from llm_core.llm import LLM

log = logging.getLogger(__name__)


def follower_main(argv: Sequence[str]) -> int:
    """Rank ``argv[0]`` of the group ``argv[1]`` (the leader's JSON spec) describes."""
    rank, spec = int(argv[0]), json.loads(argv[1])
    logging.basicConfig(level=logging.INFO, format=f"[ep rank {rank}] %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec["threads"])
    device = _rank_device(spec["device"], rank)
    ep = init_expert_parallel(spec["size"], rank, spec["init_method"], spec["backend"], device)
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["engine_options"].items()}
    try:
        llm = LLM(spec["model"], device=device, dtype=spec["dtype"], ep=ep, quantization=spec["quantization"],
                  **options)
    except Exception:  # noqa: BLE001 - reported to the leader, which refuses to start
        log.exception("building the engine failed")
        handshake(ep, False)
        return 1
    try:
        if handshake(ep, True):
            return 1  # another rank failed: the leader gives up
        follow(llm)
    except ExpertParallelError as exc:
        log.error("%s", exc)
        return 1
    return 0
