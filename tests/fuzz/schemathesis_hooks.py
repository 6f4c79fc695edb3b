"""Schemathesis hooks for the fuzz tier: undo the RL controls a fuzzed call switched on, so generation keeps being exercised.

Loaded by schemathesis through SCHEMATHESIS_HOOKS; the server's URL and key come from
ROLLOUT_FUZZ_URL and ROLLOUT_FUZZ_API_KEY. After a call that paused, slept or opened a weight
update, the engine is resumed, woken or the update aborted, so the next operation meets a
serving engine (a fuzzer that leaves it asleep would only ever see 503s afterwards).
"""

from __future__ import annotations

import os

import httpx
import schemathesis

# What undoes each control a fuzzed call may have switched on.
_UNDO = {
    "/pause": ["/resume"],
    # After sleep(2) the weights were discarded: reload_weights reads the checkpoint, or nothing serves.
    "/sleep": ["/wake_up?reload_weights=true", "/resume"],
    "/start_weight_update": ["/abort_weight_update"],
    "/start_draft_weight_update": ["/abort_weight_update"],
    "/release_kv_cache_memory": ["/wake_up", "/resume"],
    "/init_weight_transfer_engine": ["/abort_weight_update"],
}


@schemathesis.hook
def after_call(context, case, response) -> None:
    undo = _UNDO.get(case.path)
    if not undo:
        return
    url, key = os.environ["ROLLOUT_FUZZ_URL"], os.environ.get("ROLLOUT_FUZZ_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for path in undo:
        httpx.post(url + path, headers=headers, timeout=30)
