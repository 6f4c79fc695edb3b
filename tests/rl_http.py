"""The RL routes as a trainer without a transfer backend drives them: one weight update with the local backend over HTTP."""

from __future__ import annotations

import torch


def local_update_over_http(http, weights: dict[str, torch.Tensor], version: str) -> None:
    """pause(wait) -> init local -> start -> update (tensors in the body) -> finish(version) -> resume; every answer 200."""
    from weight_transfer.local import make_update_info

    for path, body, answer in [
        ("/pause?mode=wait", None, {"status": "paused"}),
        ("/init_weight_transfer_engine", {"init_info": {"backend": "local"}}, {"message": "Weight transfer initialized"}),
        ("/start_weight_update", None, {"message": "Weight update started"}),
        ("/update_weights", {"update_info": make_update_info(weights.items(), encoding="b64")},
         {"message": "Weights updated"}),
        ("/finish_weight_update", {"weight_version": version}, {"message": "Weight update finished"}),
        ("/resume", None, {"status": "resumed"}),
    ]:
        r = http.post(path, json=body) if body is not None else http.post(path)
        assert r.status_code == 200, (path, r.text)
        assert r.json() == answer, path  # vLLM 0.33's answers
