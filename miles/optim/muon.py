"""Muon for the hidden 2-D matrices and AdamW for everything else, behind one torch optimizer.

``torch.optim.Muon`` refuses any parameter that is not a 2-D matrix, and Muon is not meant for embeddings or the
output head either, so a model needs two optimizers. This class keeps them as ``.optimizers`` and exposes one
face: ``param_groups`` (the children's own group dicts, so LR schedulers and ``group["lr"] = ...`` reach them),
``state`` (a read-only merged view), ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict``.
"""

from __future__ import annotations

from collections import ChainMap

import torch


class MuonWithAdamW(torch.optim.Optimizer):
    """Two torch optimizers stepped as one.

    opt = MuonWithAdamW(matrices, others, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99))
    loss.backward(); opt.step(); opt.zero_grad()
    sd = opt.state_dict()            # {"muon": ..., "adamw": ...}
    opt.load_state_dict(sd)

    Muon uses ``adjust_lr_fn="match_rms_adamw"`` so one learning rate and weight decay serve both groups.
    """

    def __init__(self, muon_params, adamw_params, *, lr: float, weight_decay: float, betas: tuple[float, float]):
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        self.children: dict[str, torch.optim.Optimizer] = {}
        if muon_params:
            self.children["muon"] = torch.optim.Muon(
                muon_params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"
            )  # momentum: torch's default 0.95 (Nesterov); betas are AdamW's
        if adamw_params:
            self.children["adamw"] = torch.optim.AdamW(adamw_params, lr=lr, weight_decay=weight_decay, betas=betas)
        if not self.children:
            raise ValueError("MuonWithAdamW got no parameters; pass the model's parameters")
        super().__init__(muon_params + adamw_params, {"lr": lr})
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]
        self.state = ChainMap(*(opt.state for opt in self.optimizers))

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.children.values())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.children.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != set(self.children):
            raise ValueError(f"state_dict holds optimizers {sorted(state_dict)}, this one has {sorted(self.children)}")
        for name, opt in self.children.items():
            opt.load_state_dict(state_dict[name])
