"""WeightRollback: the values a weight update overwrote, kept (on the device, on the CPU, or not at all) to put back when a call or the update fails."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class WeightRollback:
    """Rollback copies of one model's weights during one update (start_update .. finish or abort).

    Before a weight is first overwritten in the update, save() keeps its value; so
      - undo_call() puts back what the current update_weights call changed (a call rejected midway),
        including weights an earlier call of the update had changed already (their values at the
        start of this call, kept when this call first overwrote them);
      - undo_update() puts back everything changed since start (a failed transfer, an abort).
    Mode "none" keeps no copies, only which weights were touched: once one was, both report False (not restored).
    Copies are written back in place, so parameter addresses (and CUDA graphs that recorded them) stay valid.
    """

    def __init__(self, mode: str, view: Callable[[str], torch.Tensor]) -> None:
        self.mode = mode  # FaultToleranceConfig.weight_update_rollback: "device", "cpu" or "none"
        self._view = view  # hf name -> the weight's current view in the model (read when used: the layout may change)
        self._saved: dict[str, torch.Tensor | None] = {}  # values before the update, flat (None in mode "none")
        self._call_first: list[str] = []  # weights this call saved first
        self._call_resaved: dict[str, torch.Tensor] = {}  # this call's start values of weights an earlier call changed

    def start_call(self) -> None:
        """The next update_weights call begins: undo_call() undoes only what follows."""
        self._call_first, self._call_resaved = [], {}

    def save(self, names: Iterable[str]) -> None:
        """Keeps the current value of each weight about to be overwritten, unless this update (for an
        earlier call's weight: this call) already did."""
        fresh = []
        for name in dict.fromkeys(names):  # a tied pair lands in its owner twice
            if name not in self._saved:
                fresh.append(name)
            elif self.mode != "none" and name not in self._call_first and name not in self._call_resaved:
                self._call_resaved[name] = self._view(name).clone()
        self._keep(fresh)
        self._call_first += fresh

    def _keep(self, names: list[str]) -> None:
        """One allocation and one multi-tensor copy per (dtype, device), not one clone per weight; the copies are flat."""
        if self.mode == "none":
            self._saved.update(dict.fromkeys(names))  # touched, nothing kept
            return
        groups: dict[tuple[torch.dtype, torch.device], list[tuple[str, torch.Tensor]]] = {}
        for name in names:
            current = self._view(name)
            groups.setdefault((current.dtype, current.device), []).append((name, current))
        for (dtype, device), group in groups.items():
            where = torch.device("cpu") if self.mode == "cpu" else device
            flat = torch.empty(sum(t.numel() for _, t in group), dtype=dtype, device=where)
            copies = flat.split([t.numel() for _, t in group])
            currents = [t.view(-1) if t.is_contiguous() else t.reshape(-1) for _, t in group]
            with torch.no_grad():
                if where == device:
                    torch._foreach_copy_(copies, currents)
                else:  # device to host: plain copies (multi-tensor copies stay on one device)
                    for c, t in zip(copies, currents):
                        c.copy_(t)
            self._saved.update((name, c) for (name, _), c in zip(group, copies))

    def undo_call(self) -> bool:
        """Puts back what the current call changed; False when no copies were kept (mode "none")."""
        restored = self._put_back(self._call_first, self._call_resaved)
        self.start_call()
        return restored

    def undo_update(self) -> bool:
        """Puts back everything changed since start and forgets it; False when the weights stay a mix (mode "none")."""
        restored = self._put_back(list(self._saved), {})
        self.clear()
        return restored

    def clear(self) -> None:
        """The update is over (its weights serve, or were put back): nothing to keep."""
        self._saved = {}
        self.start_call()

    def _put_back(self, first_saved: list[str], resaved: dict[str, torch.Tensor]) -> bool:
        if self.mode == "none" and first_saved:
            return False
        with torch.no_grad():
            for name in first_saved:
                dst = self._view(name)
                dst.copy_(self._saved.pop(name).view(dst.shape))  # kept flat
            for name, value in resaved.items():
                self._view(name).copy_(value)
        return True
