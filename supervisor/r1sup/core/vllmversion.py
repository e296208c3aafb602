"""The vLLM version r1sup sizes for, and how each release accounts for memory (:class:`Rules`, read
from each release's source): the first of the memory model's three parts (:mod:`r1sup.core.memmodel`
puts the terms together; :mod:`r1sup.core.modelarch` reads the model's ``config.json``). Pure.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Version:
    """A vLLM release, ``major.minor.patch`` (pre-release and local parts ignored), and what the memory
    model must know of how that release is installed and started (not part of equality or order: two
    starts of one release compare equal):

    * ``flashinfer_sampler``: whether the sampler uses FlashInfer's top-k/top-p kernels (vLLM's
      ``VLLM_USE_FLASHINFER_SAMPLER``, and before 0.11.1 whether ``flashinfer`` is installed at all);
      None: the release's default as ``pip install vllm`` sets it up
      (:func:`r1sup.core.memmodel.sampler_backend`).
    * ``compile_cache``: ``"warm"`` when vLLM's ``torch.compile`` cache already holds this model's
      graphs, ``"cold"`` when it does not; None: not known, sized as cold
      (:func:`r1sup.core.memmodel.compile_note`).
    """

    major: int
    minor: int
    patch: int = 0
    flashinfer_sampler: bool | None = field(default=None, compare=False)
    compile_cache: str | None = field(default=None, compare=False)

    def started(self, flashinfer_sampler: bool | None = None, compile_cache: str | None = None) -> Version:
        """This release with what is known of its installation and cache (see the class)."""
        if compile_cache not in (None, "warm", "cold"):
            raise ValueError(f"compile_cache must be 'warm', 'cold' or None, got {compile_cache!r}")
        return dataclasses.replace(self, flashinfer_sampler=flashinfer_sampler, compile_cache=compile_cache)

    @classmethod
    def parse(cls, text: str) -> Version:
        """``"0.19.0"``, ``"v0.32.1"``, ``"0.7.3.dev233+gad5a35c2"``, ``"0.33"``; ValueError otherwise."""
        m = re.fullmatch(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+\-]?[A-Za-z0-9.+\-]*)?\s*", str(text))
        if m is None:
            raise ValueError(f"not a vLLM version: {text!r} (expected X.Y.Z)")
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


NEWEST_KNOWN = Version(0, 33, 0)  # the newest release whose source this model was checked against
FIRST_V1 = Version(0, 8, 0)  # the V1 engine is the default from here (V0 removed in 0.11.0)
SUPPORTED = (FIRST_V1, NEWEST_KNOWN)


def as_version(version: Version | str | None) -> Version:
    """A :class:`Version` from a version, its text, or None (the newest this model knows)."""
    if version is None:
        return NEWEST_KNOWN
    return version if isinstance(version, Version) else Version.parse(version)


def version_note(version: Version) -> str | None:
    """What a user must know when the version is outside the supported range (None inside it)."""
    low, high = SUPPORTED
    if version < low:
        return (
            f"vLLM {version} runs the V0 engine: r1sup sizes it with V0's accounting (CUDA graphs outside "
            f"the budget, a profile run of max(max_model_len, 2048) tokens, no null block), checked against "
            f"a few V0 logs only; the supported range is the V1 engine, vLLM {low.major}.{low.minor} to "
            f"{high.major}.{high.minor}"
        )
    if (version.major, version.minor) > (high.major, high.minor):
        return (
            f"vLLM {version} is newer than the newest release this model knows ({high}): it is sized with "
            f"{high}'s rules"
        )
    return None


@dataclass(frozen=True)
class Rules:
    """How one vLLM version accounts for memory (each field names the code it was read from)."""

    version: Version
    engine: str  # "V1" from 0.8.0 (VLLM_USE_V1 default), "V0" before
    # cudagraph_mode default (vllm/config/vllm.py, per optimization level): FULL_AND_PIECEWISE from 0.11.0,
    # PIECEWISE before; V0 captured decode graphs of up to 256 sequences after the KV cache
    cudagraph_mode: str
    # cudagraph_capture_sizes (VllmConfig._set_cudagraph_sizes): 1, 2, 4, then steps of 8 up to 256 and steps
    # of 16 above it from 0.12.0; steps of 8 all the way before
    capture_step16_above_256: bool
    # default max capture size min(2 x max_num_seqs, 512); 1024 on data-center Blackwell from 0.28.0
    blackwell_capture_1024: bool
    # GPUModelRunner.profile_cudagraph_memory exists from 0.18.0 ("Estimated CUDA graph memory: X GiB total")
    graph_estimate_profiled: bool
    # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS defaults to 1 from 0.20.0 (vllm/envs.py; vLLM's own messages
    # say "default since v0.21.0", the 0.20.0 code already has it): the estimate comes out of the KV budget
    graph_estimate_charged: bool
    # the sampler warm-up's top-k/top-p: a Triton kernel that filters in place from 0.17.0
    # (vllm/v1/sample/ops/topk_topp_triton.py, batches of 8 and more); a full sort before
    triton_top_k_top_p: bool
    # EngineArgs.get_batch_defaults: A100 excluded from the large defaults from 0.9.0; the >= 160 GiB tier
    # (16384 tokens for the API server) from 0.28.0; the token default capped at max_num_seqs x
    # max_model_len from 0.12.0
    a100_small_defaults: bool
    tier_160_gib: bool
    tokens_capped_by_seqs_x_len: bool
    # the sampler warm-up runs FlashInfer's top-k/top-p alone when the sampler uses it: V1 from its start
    # up to 0.11.0 (vllm/v1/sample/ops/topk_topp_sampler.py: on whenever flashinfer imports, unless
    # VLLM_USE_FLASHINFER_SAMPLER=0). From 0.11.1 FlashInfer sampling is opt-in (vLLM PR 26859), and once it
    # is the default again the warm-up runs the native path too (gpu_model_runner._dummy_sampler_run:
    # "Also warm forward_native"), so the native path sets the peak there either way.
    flashinfer_warmup_alone: bool

    @property
    def v0(self) -> bool:
        return self.engine == "V0"

    @property
    def null_block(self) -> bool:
        """V1's BlockPool holds one block back (vllm/v1/core/block_pool.py); V0 did not."""
        return not self.v0


def rules(version: Version) -> Rules:
    """The accounting rules of ``version`` (read from each release's source, see :class:`Rules`)."""
    v = version
    return Rules(
        version=v,
        engine="V1" if v >= FIRST_V1 else "V0",
        cudagraph_mode=(
            "FULL_AND_PIECEWISE" if v >= Version(0, 11) else "PIECEWISE" if v >= FIRST_V1 else "V0_DECODE"
        ),
        capture_step16_above_256=v >= Version(0, 12),
        blackwell_capture_1024=v >= Version(0, 28),
        graph_estimate_profiled=v >= Version(0, 18),
        graph_estimate_charged=v >= Version(0, 20),
        triton_top_k_top_p=v >= Version(0, 17),
        a100_small_defaults=v >= Version(0, 9),
        tier_160_gib=v >= Version(0, 28),
        tokens_capped_by_seqs_x_len=v >= Version(0, 12),
        flashinfer_warmup_alone=FIRST_V1 <= v < Version(0, 11, 1),
    )
