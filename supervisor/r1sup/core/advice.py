"""What r1sup would do with a log (``r1sup diagnose``): the search's next step as one sentence. Pure.

The box, the model and the flags come from what the log printed (the reader's figures, vLLM's
"non-default args", the failure's numbers); the decision is :class:`r1sup.core.search.Search`'s own, never
another one.
"""

from __future__ import annotations

from collections.abc import Mapping

from r1sup.core import bounds as B
from r1sup.core import failure as F
from r1sup.core import memmodel as M
from r1sup.core import modelarch
from r1sup.core.failure import Failure
from r1sup.core.figures import EMPTY as NO_FIGURES
from r1sup.core.figures import Figures
from r1sup.core.flags import flags_from_log
from r1sup.core.search import Facts, GiveUp, Outcome, Search


def advise(
    failure: Failure,
    engine_args: Mapping[str, object] | None = None,
    engine_version: str | None = None,
    device: str | None = None,
    figures: Figures = NO_FIGURES,
) -> str:
    """What r1sup's search does next after this failure, from what the log shows.

    The search decides with the default ``[search]`` bounds, the box as the log printed it (one GPU of its
    total and free memory) and the model when the log names one r1sup's catalog knows; without the model
    it takes the blind branch's per-class steps. The advice is the change r1sup would make, or its reason
    to stop, never another one.
    """
    from r1sup.core import catalog

    n = failure.numbers
    flags = flags_from_log(engine_args or {}, n.figures.max_model_len, n.figures.gpu_memory_utilization)
    total = n.figures.total_gib or n.device_total_gib or n.figures.node_total_gib
    backend = "cpu" if device == "cpu" else "cuda"
    lf = B.BlindFacts(
        backend=backend,
        total_gib=total,
        free_gib=n.figures.free_gib,
        model_max_len=int(n.derived_max_model_len) if n.derived_max_model_len else None,
        block_size=M.block_size(backend),
        vllm_version=engine_version,
    )
    if failure.cls == F.NONE:
        tokens, conc = n.figures.kv_cache_tokens, n.figures.max_concurrency
        held = f" The KV cache holds {int(tokens)} tokens" if tokens else ""
        held += (
            f" ({conc:g}x requests of the full context at once)."
            if tokens and conc
            else "."
            if tokens
            else ""
        )
        return "Nothing failed: r1sup would keep these flags, run its load probe and save them." + held
    model = (engine_args or {}).get("model")
    arch = None
    if isinstance(model, str) and model in catalog.MODELS and total and backend == "cuda":
        arch = modelarch.arch_from_config(catalog.MODELS[model])
    search = Search(
        Facts(
            arch=arch,
            device=lf.device(),
            user=flags,
            version=lf.version(),
            ladder_facts=lf,
        )
    )
    decision = search.after(Outcome(flags, failure, figures, None))
    if isinstance(decision, GiveUp):
        why = f"r1sup would stop (exit {decision.exit_code}): {decision.reason}."
        if decision.ways_out:
            why += " Ways out: " + "; ".join(decision.ways_out) + "."
        return why
    if decision.retry:
        return f"r1sup would relaunch with the same flags once: {decision.reason}."
    changed = [a for a in decision.flags.to_argv() if a not in flags.to_argv()]
    change = flags.describe_change(decision.flags)
    return (
        f"r1sup would relaunch with {change} ({decision.reason})"
        + (f"; vLLM flags now: {' '.join(decision.flags.to_argv())}" if changed else "")
        + "."
    )
