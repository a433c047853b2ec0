"""An online value probe: a replay buffer of earlier steps' rollouts and a linear probe refit on it.

``ReplayBuffer`` keeps, for the newest ``capacity`` rollouts of earlier steps, the reward, the mean reward of the
rollout's siblings (the other rollouts of its prompt in its step), the prompt id, the step, the prompt feature and
the trajectory feature. The trainer adds a step's rollouts AFTER their baselines were computed, so an estimator
reading the buffer never sees the current batch. Its ``state_dict`` holds only tensors, ints and a list of strings,
so the checkpoint can store it without pickling objects, and a resumed run refits exactly the same probe.

``fit_probe`` is a deterministic function of its inputs (no random initialisation, no SGD):

1. per feature block (``prompt`` and ``hidden``), optionally the top principal components of the block over the
   buffer rows (an eigendecomposition on whichever side of the block is smaller);
2. every column standardised by its buffer mean and standard deviation (constant columns become 0);
3. ridge regression with an unpenalised intercept (closed form), or L2-regularised logistic regression
   (Newton's method from zero); the ridge strength fixed, or chosen over a grid by grouped leave-one-out error:
   rows of the same prompt are left out together, in closed form (e_g = (I - H_gg)^-1 (y_g - yhat_g)).

Everything is computed in float64 on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .base import leave_one_out_mean

BLOCK_ORDER = ("prompt", "hidden", "stats", "reward")


class ReplayBuffer:
    """The newest ``capacity`` rollouts of earlier steps, with rewards and features (see the module docstring)."""

    def __init__(self, capacity: int):
        if int(capacity) < 1:
            raise ValueError(f"replay capacity must be >= 1, got {capacity!r}")
        self.capacity = int(capacity)
        self.reward = torch.zeros(0, dtype=torch.float32)
        self.sibling = torch.zeros(0, dtype=torch.float32)  # nan for a prompt with one rollout
        self.step = torch.zeros(0, dtype=torch.long)
        self.prompt_ids: list[str] = []
        self.prompt_features: Tensor | None = None  # [N, Dp] float32
        self.trajectory: Tensor | None = None  # [N, Dt] float32
        self.added = 0  # rollouts ever added (the buffer keeps the newest `capacity`)

    @property
    def rows(self) -> int:
        return int(self.reward.numel())

    def add(self, step: int, prompt_ids: list, rewards: Tensor, prompt_features: Tensor | None = None,
            trajectory: Tensor | None = None) -> None:
        """One step's rollouts: rewards [B, G], prompt features [B, Dp], trajectory features [B, G, Dt]."""
        r = torch.as_tensor(rewards, dtype=torch.float32).detach().cpu()
        if r.dim() != 2 or r.shape[0] != len(prompt_ids):
            raise ValueError(f"rewards must be [B, G] with B = {len(prompt_ids)} prompt ids, got {tuple(r.shape)}")
        B, G = r.shape
        sib = leave_one_out_mean(r.double(), dim=1, empty=float("nan")).float()
        pf = None if prompt_features is None else \
            torch.as_tensor(prompt_features).detach().float().cpu().repeat_interleave(G, dim=0)
        tr = None if trajectory is None else torch.as_tensor(trajectory).detach().float().cpu().reshape(B * G, -1)
        if self.rows and (pf is None) != (self.prompt_features is None):
            raise ValueError("replay buffer: prompt features present in some steps and missing in others")
        if self.rows and (tr is None) != (self.trajectory is None):
            raise ValueError("replay buffer: trajectory features present in some steps and missing in others")
        keep = self.capacity

        def cat(old, new):
            out = new if old is None or old.shape[0] == 0 else torch.cat([old, new])
            return out[-keep:]

        self.reward = cat(self.reward, r.reshape(-1))
        self.sibling = cat(self.sibling, sib.reshape(-1))
        self.step = cat(self.step, torch.full((B * G,), int(step), dtype=torch.long))
        self.prompt_ids = (self.prompt_ids + [str(p) for p in prompt_ids for _ in range(G)])[-keep:]
        if pf is not None:
            self.prompt_features = cat(self.prompt_features, pf)
        if tr is not None:
            self.trajectory = cat(self.trajectory, tr)
        self.added += B * G

    def groups(self) -> Tensor:
        """[N] long: rows of the same prompt share a group (the unit grouped cross-validation leaves out)."""
        index: dict[str, int] = {}
        return torch.tensor([index.setdefault(p, len(index)) for p in self.prompt_ids], dtype=torch.long)

    def state_dict(self) -> dict:
        """Plain tensors, ints and a list of str (no objects): survives weights-only loading and JSON manifests."""
        return {"capacity": self.capacity, "added": self.added, "reward": self.reward.clone(),
                "sibling": self.sibling.clone(), "step": self.step.clone(), "prompt_ids": list(self.prompt_ids),
                "prompt_features": None if self.prompt_features is None else self.prompt_features.clone(),
                "trajectory": None if self.trajectory is None else self.trajectory.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.capacity = int(state["capacity"])
        self.added = int(state.get("added", 0))
        self.reward = state["reward"].to(torch.float32).clone()
        self.sibling = state["sibling"].to(torch.float32).clone()
        self.step = state["step"].to(torch.long).clone()
        self.prompt_ids = [str(p) for p in state["prompt_ids"]]
        pf, tr = state.get("prompt_features"), state.get("trajectory")
        self.prompt_features = None if pf is None else pf.to(torch.float32).clone()
        self.trajectory = None if tr is None else tr.to(torch.float32).clone()

    @classmethod
    def from_state_dict(cls, state: dict) -> "ReplayBuffer":
        buf = cls(int(state["capacity"]))
        buf.load_state_dict(state)
        return buf


def blocks_of(prompt_features: Tensor | None, trajectory: Tensor | None, reward: Tensor | None,
              names, n_stats: int) -> dict:
    """{block: [N, d] float64} for the requested blocks that the inputs hold (rows aligned across blocks)."""
    out = {}
    for name in BLOCK_ORDER:
        if name not in names:
            continue
        if name == "prompt" and prompt_features is not None:
            out[name] = prompt_features.double()
        elif name == "hidden" and trajectory is not None:
            out[name] = trajectory[:, :-n_stats].double()
        elif name == "stats" and trajectory is not None:
            out[name] = trajectory[:, -n_stats:].double()
        elif name == "reward" and reward is not None:
            out[name] = reward.double().reshape(-1, 1)
    return out


def _pca(x: Tensor, k: int) -> Tensor:
    """[d, k] the top-k principal directions of centred rows x [N, d] (eigenvectors of the smaller Gram side)."""
    n, d = x.shape
    if d <= n:
        s, v = torch.linalg.eigh(x.T @ x)
        return v[:, torch.argsort(s, descending=True)[:k]]
    s, u = torch.linalg.eigh(x @ x.T)
    order = torch.argsort(s, descending=True)[:k]
    s, u = s[order].clamp_min(1e-12), u[:, order]
    return (x.T @ u) / s.sqrt()[None, :]


@dataclass
class Probe:
    """A fitted probe: its transform (PCA per block, standardisation) and its linear / logistic head."""

    names: tuple
    centre: dict
    proj: dict  # block -> [d, k] or None
    mean: Tensor
    std: Tensor
    w: Tensor
    b: float
    kind: str
    ridge: float
    rows: int
    cv_error: dict = field(default_factory=dict)

    def design(self, blocks: dict) -> Tensor:
        cols = []
        for name in self.names:
            x = blocks[name].double() - self.centre[name]
            cols.append(x if self.proj[name] is None else x @ self.proj[name])
        z = torch.cat(cols, dim=1)
        return (z - self.mean) / self.std

    def predict(self, blocks: dict) -> Tensor:
        """[M] float64 predictions for rows given as {block: [M, d]} (the blocks the probe was fitted on)."""
        eta = self.design(blocks) @ self.w + self.b
        return torch.sigmoid(eta) if self.kind == "logistic" else eta


def _transform_fit(blocks: dict, pca: dict) -> tuple[tuple, dict, dict, Tensor, Tensor, Tensor]:
    names = tuple(n for n in BLOCK_ORDER if n in blocks)
    centre, proj, cols = {}, {}, []
    for name in names:
        x = blocks[name].double()
        c = x.mean(0)
        xc = x - c
        k = int(pca.get(name, 0) or 0)
        p = _pca(xc, k) if 0 < k < min(xc.shape) else None
        centre[name], proj[name] = c, p
        cols.append(xc if p is None else xc @ p)
    z = torch.cat(cols, dim=1)
    mean, std = z.mean(0), z.std(0, unbiased=False)
    std = torch.where(std > 1e-12, std, torch.ones_like(std))
    return names, centre, proj, mean, std, (z - mean) / std


def _grouped_loo_error(z: Tensor, yc: Tensor, groups: Tensor, lams: list[float]) -> list[float]:
    """Mean squared grouped leave-one-out error of ridge (intercept included) for each strength, in closed form."""
    n, d = z.shape
    if d <= n:
        s, v = torch.linalg.eigh(z.T @ z)
        q = z @ v  # hat = q diag(1 / (s + lam)) q^T
    else:
        s, u = torch.linalg.eigh(z @ z.T)
        s = s.clamp_min(0.0)
        q = u * s.sqrt()[None, :]
    qty = q.T @ yc
    uniq, inv = torch.unique(groups, return_inverse=True)
    sizes = torch.bincount(inv, minlength=uniq.numel())
    m = int(sizes.max())
    order = torch.argsort(inv, stable=True)
    pos = torch.arange(n) - torch.cumsum(torch.cat([sizes.new_zeros(1), sizes[:-1]]), 0)[inv[order]]
    idx = torch.full((uniq.numel(), m), -1, dtype=torch.long)
    idx[inv[order], pos] = order
    valid = idx >= 0
    qg = torch.where(valid[..., None], q[idx.clamp_min(0)], torch.zeros(()))  # [n_g, m, r]
    out = []
    for lam in lams:
        inv_s = 1.0 / (s + lam)
        yhat = q @ (inv_s * qty)
        e = yc - yhat
        hb = torch.einsum("gar,r,gbr->gab", qg, inv_s, qg) + valid[:, :, None] * valid[:, None, :] / n
        eg = torch.where(valid, e[idx.clamp_min(0)], torch.zeros(()))
        loo = torch.linalg.solve(torch.eye(m, dtype=z.dtype) - hb, eg[..., None])[..., 0]
        out.append(float((loo[valid] ** 2).mean()))
    return out


def _ridge(z: Tensor, yc: Tensor, lam: float) -> Tensor:
    n, d = z.shape
    if d <= n:
        return torch.linalg.solve(z.T @ z + lam * torch.eye(d, dtype=z.dtype), z.T @ yc)
    return z.T @ torch.linalg.solve(z @ z.T + lam * torch.eye(n, dtype=z.dtype), yc)


def _logistic(z: Tensor, y: Tensor, lam: float, iters: int = 50) -> tuple[Tensor, float]:
    """L2-regularised logistic regression (soft targets in [0, 1]) by Newton's method from zero; intercept free."""
    n, d = z.shape
    x = torch.cat([z, torch.ones(n, 1, dtype=z.dtype)], 1)
    reg = torch.full((d + 1,), lam, dtype=z.dtype)
    reg[-1] = 1e-8
    w = torch.zeros(d + 1, dtype=z.dtype)
    for _ in range(iters):
        p = torch.sigmoid(x @ w)
        g = x.T @ (p - y) + reg * w
        h = (x * (p * (1 - p))[:, None]).T @ x + torch.diag(reg)
        step = torch.linalg.solve(h, g)
        w = w - step
        if float(step.abs().max()) < 1e-10:
            break
    return w[:-1], float(w[-1])


def fit_probe(blocks: dict, y: Tensor, groups: Tensor | None = None, *, kind: str = "ridge", ridge=100.0,
              ridge_grid=(1.0, 10.0, 100.0, 1000.0, 10000.0), pca: dict | None = None) -> Probe:
    """Fit a probe on rows {block: [N, d]} with targets y [N] (rows with a nan target are dropped).

    ``ridge`` is the L2 strength on the standardised inputs, or "cv" to pick it from ``ridge_grid`` by grouped
    leave-one-out error (``groups`` [N]: rows of one prompt; default every row its own group).
    """
    y = torch.as_tensor(y).double()
    ok = ~torch.isnan(y)
    if not bool(ok.all()):
        blocks = {k: v[ok] for k, v in blocks.items()}
        y = y[ok]
        groups = None if groups is None else groups[ok]
    if not blocks:
        raise ValueError("fit_probe: no feature block to fit on")
    names, centre, proj, mean, std, z = _transform_fit(blocks, pca or {})
    n = z.shape[0]
    groups = torch.arange(n) if groups is None else groups
    ybar = y.mean()
    cv_err = {}
    if ridge == "cv":
        grid = [float(v) for v in ridge_grid]
        errs = _grouped_loo_error(z, y - ybar, groups, grid)
        cv_err = dict(zip(grid, errs))
        lam = grid[min(range(len(grid)), key=lambda i: (errs[i], -grid[i]))]
    else:
        lam = float(ridge)
    if kind == "logistic":
        w, b = _logistic(z, y.clamp(0.0, 1.0), lam)
    else:
        w, b = _ridge(z, y - ybar, lam), float(ybar)
    return Probe(names, centre, proj, mean, std, w, b, kind, lam, n, cv_err)
