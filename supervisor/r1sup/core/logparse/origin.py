"""Whether a line is vLLM's own output: the strict test behind ``diagnose``'s exit 6.

Pure. A line is vLLM's when it is in one of vLLM's formats, never because it holds a keyword:

* vLLM's logger stamp: ``LEVEL MM-DD HH:MM:SS [file.py:123]`` (older releases without the brackets), or a
  logging configuration that keeps its ``[file.py:123]`` after the level and a pid;
* one of vLLM's process tags: ``(EngineCore_DP0 pid=..)``, ``(VllmWorker rank=1 pid=..)``,
  ``(APIServer pid=..)``, ``(RayWorkerWrapper pid=..)`` ...;
* a traceback frame in vLLM's package (``File ".../vllm/..."``);
* one of vLLM's own messages at the start of a line (after its wrappers and an exception's name): the
  KV-cache and free-memory checks, the engine's death notices, an exception class of the ``vllm``
  package; and the success path's messages the figures read (``r1sup.core.logparse.figures``);
* a relayed line of r1sup's own event log (``r1sup.core.logparse.events``).

Another program's traceback is no vLLM log even where it names a cause: frames of another serving
package (SGLang, TGI's ``text_generation_server``, LMDeploy, TensorRT-LLM; SGLang imports parts of vLLM, so
a vLLM frame among them does not count) or TGI's launcher log, and an exception line whose traceback runs
through a script and never through vLLM (a training script's ``torch.OutOfMemoryError``).

Uvicorn's ``INFO:`` access log, torch's and NCCL's own records, a Markdown table that quotes a vLLM
message, a note that says "out of memory", another program's log that names vLLM: none is vLLM output.
"""

from __future__ import annotations

import re

# The level word followed by vLLM's date ("INFO 05-02 10:00:01"), or by a pid and vLLM's [file.py:line]
_VLLM_AFTER_LEVEL_RE = re.compile(r" \d\d-\d\d \d\d:\d\d:\d\d| \d+ \[[\w./-]{1,120}\.py:\d+\]")
_LEVEL_WORDS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# vLLM's process names (the multiprocessing and Ray workers, the engine core, the API servers)
VLLM_PROCESS_RE = re.compile(
    r"(?i:vllm)|EngineCore|APIServer|ApiServer|RayWorker|^Worker(?:_\w+)?$|^VllmWorker|^LLMRayActor$"
)
# vLLM's own messages, matched at the start of a line's text (an exception's name may come first)
VLLM_MESSAGE_RE = re.compile(
    # a quote or the tail of vLLM's stamp left by a paste ("model_runner_base.py:120] "), an exception's
    # name or pydantic's "Value error, " may come first
    r"[\"']?(?:[\w.-]{1,120}\.py:\d+\] )?(?:[\w.]{0,120}(?:Error|Exception): |Value error, )?(?:"
    r"User-specified max_model_len \(\d+\) is greater than the derived max_model_len|"
    r"To serve at least one request with the models?(?:'s)? max seq len|"
    r"The model's max seq len \(\d+\) is larger than the maximum number of tokens|"
    r"No available memory for the cache blocks|"
    r"Free memory on device|Error in memory profiling|"
    r"Engine core initialization failed|Engine process failed to start|EngineCore failed to start|"
    r"EngineCore encountered (?:a fatal error|an issue)|MQLLMEngine is already dead|"
    r"Engine loop is not running|"
    r"Engine loop has died|Background loop has errored already|Engine background task failed|"
    r"Task finished unexpectedly\. This should never happen|"
    r"CUDA out of memory occurred when warming up|Failed to load model - not enough GPU memory|"
    r"Failed to pickle inputs of failed execution|Writing input of failed execution|Error in model execution|"
    r"Exception in worker \w+ while processing method|Error executing method|"
    r"Worker proc \S+ died unexpectedly|Engine core proc \S+ died"
    r")"
    # vLLM's command line refusing its arguments (argparse: "api_server.py: error: argument ...")
    r"|(?:usage: )?(?:api_server\.py|vllm(?: serve)?|python3? -m vllm\.entrypoints\S*)(?:: error: | \[-h\])"
    r"|vllm(?:\.\w+)+(?:Error|Exception)\b"  # an exception class of the vllm package
)


def vllm_stamp(stamp: re.Match[str]) -> bool:
    """Whether a level stamp found by ``heads.STAMP_RE`` is vLLM's logger's (not uvicorn's ``INFO:``)."""
    text = stamp.string
    start = stamp.start()
    for word in _LEVEL_WORDS:
        if text.startswith(word, start):
            return _VLLM_AFTER_LEVEL_RE.match(text, start + len(word)) is not None
    return False


# vLLM's stamp anywhere in a line's head (behind wrappers the stamp search of heads.py does not know)
_VLLM_STAMP_SEARCH_RE = re.compile(
    r"(?<![^\s|>)\]])(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)"
    r"(?: \d\d-\d\d \d\d:\d\d:\d\d| \d+ \[[\w./-]{1,120}\.py:\d+\])"
)


def vllm_stamp_in(text: str, window: int = 320) -> bool:
    """Whether vLLM's stamp is in the first ``window`` characters of a line."""
    return _VLLM_STAMP_SEARCH_RE.search(text, 0, window) is not None


def vllm_process(name: str | None) -> bool:
    """Whether a process tag names one of vLLM's processes."""
    return name is not None and VLLM_PROCESS_RE.search(name) is not None


def vllm_frame(file: str) -> bool:
    """Whether a traceback frame's file is in vLLM's package."""
    return "vllm/" in file or "vllm\\" in file


def vllm_message(stripped: str) -> bool:
    """Whether a message (a line's text after its wrappers) starts with one of vLLM's own messages."""
    return VLLM_MESSAGE_RE.match(stripped) is not None


# Another serving engine's package in a frame's path (SGLang's frames may pass through vLLM's utilities)
_FOREIGN_PACKAGE_RE = re.compile(
    r"[/\\](?:sglang|text_generation_server|lmdeploy|tensorrt_llm)[/\\]|[/\\]text-generation-server$"
)
# An installed package or the standard library (or a frame with no real path: "<frozen runpy>", "...")
_LIBRARY_RE = re.compile(r"(?i)site-packages|dist-packages|[/\\]lib(?:64)?[/\\]|\.egg[/\\]|^<|^\.\.\.$")
FOREIGN_SERVER = "foreign_server"
SCRIPT = "script"


def foreign_frame(file: str) -> str | None:
    """What a traceback frame outside vLLM's package says of the log's origin: ``FOREIGN_SERVER`` (another
    serving engine's code), ``SCRIPT`` (a Python file outside any installed package: someone's script), or
    None (a library's frame, which any program has)."""
    if _FOREIGN_PACKAGE_RE.search(file) is not None:
        return FOREIGN_SERVER
    if file.endswith(".py") and _LIBRARY_RE.search(file) is None:
        return SCRIPT
    return None


def foreign_line(text: str) -> bool:
    """Whether a line is another serving engine's own log record (TGI's launcher and shard manager)."""
    return "text_generation_launcher:" in text
