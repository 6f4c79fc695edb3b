"""The RL control plane's vocabulary: pause modes, scheduler pause states, sleep levels, wake-up tags.

Plain Python (no torch), shared by the scheduler, the EngineCore and the frontends; the Literal
types are the one source of truth for what is valid (validation reads them with get_args).
"""

from __future__ import annotations

import enum
from typing import Literal, get_args

PauseMode = Literal["abort", "wait", "keep"]
"""abort: end in-flight requests (finish reason abort) and refuse new ones; wait: refuse new
requests, let in-flight ones finish; keep: freeze in-flight requests with their KV cache and queue
new ones, until resume()."""

WakeUpTag = Literal["weights", "kv_cache", "scheduling"]
"""The parts that sleep() puts to sleep and wake_up(tags) brings back."""

SleepLevel = Literal[0, 1, 2]
"""0: scheduling stops; 1: also weights offloaded to host memory and KV cache freed;
2: also weights discarded (re-loaded from the checkpoint on wake-up)."""

MEMORY_TAGS = frozenset({"weights", "kv_cache"})


class PauseState(enum.IntEnum):
    """What the scheduler may do; also the value of the `rollout:engine_paused` gauge."""

    UNPAUSED = 0
    PAUSED_NEW = 1  # new requests are refused; everything already admitted is scheduled as usual
    PAUSED_ALL = 2  # nothing is scheduled; new requests queue and run after the pause ends


def check_pause_mode(mode: object) -> PauseMode:
    choices = get_args(PauseMode)
    if mode not in choices:
        raise ValueError(f"mode must be one of {choices}, got {mode!r}")
    return mode  # type: ignore[return-value]


def check_sleep_level(level: object) -> int:
    choices = get_args(SleepLevel)
    if isinstance(level, bool) or level not in choices:
        raise ValueError(f"level must be one of {choices}, got {level!r}")
    return int(level)  # type: ignore[arg-type]


def check_wake_up_tags(tags: object) -> set[str]:
    """None means every tag; a single string is one tag."""
    choices = get_args(WakeUpTag)
    if tags is None:
        return set(choices)
    if isinstance(tags, str):
        tags = [tags]
    if not isinstance(tags, (list, tuple, set, frozenset)):
        raise ValueError(f"tags must be a list of {choices} or None, got {tags!r}")  # noqa: TRY004 (bad input is ValueError here)
    unknown = [t for t in tags if t not in choices]
    if unknown:
        raise ValueError(f"tags: unknown wake-up tag(s) {unknown}; expected some of {choices}")
    return set(tags)


def tags_put_to_sleep(level: int) -> set[str]:
    return {"scheduling"} if level == 0 else {"scheduling", *MEMORY_TAGS}
