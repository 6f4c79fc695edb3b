"""The RL routes as a trainer without a transfer backend drives them: one weight update with the local backend over HTTP."""

from __future__ import annotations

import torch


def local_update_over_http(http, weights: dict[str, torch.Tensor], version: str) -> None:
    """pause(wait) -> init local -> start -> update (tensors in the body) -> finish(version) -> resume; every answer 200."""
    from weight_transfer.local import make_update_info

    for path, body in [
        ("/pause?mode=wait", None),
        ("/init_weight_transfer_engine", {"init_info": {"backend": "local"}}),
        ("/start_weight_update", None),
        ("/update_weights", {"update_info": make_update_info(weights.items(), encoding="b64")}),
        ("/finish_weight_update", {"weight_version": version}),
        ("/resume", None),
    ]:
        r = http.post(path, json=body) if body is not None else http.post(path)
        assert r.status_code == 200, (path, r.text)
