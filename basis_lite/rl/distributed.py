"""Data-parallel training on torch.distributed: N ranks share one global batch, BASIS pools over all of it.

    torchrun --nproc_per_node N -m basis_lite train --preset ... [--set ...]

    ranks = start(cfg)                      # Ranks(): one process alone; ProcessGroupRanks under torchrun
    mine = ranks.shard(batch)               # this rank's contiguous slice of the global batch
    step = Step.of_rank(...).gathered(ranks)   # rewards, features, ... of the GLOBAL batch (basis_lite.rl.step)
    adv_mine = ranks.shard(adv)             # every rank computed the same global baselines; it trains on its rows

What travels, and when:

- per step, one all-gather of a float64 vector per rank (basis_lite.rl.step): its rewards, prompt features, correctness
  and format flags, completion lengths, generation time and reward-warning count; and one max of the peak memory.
  Every rank then holds the global batch's per-prompt quantities in global order and computes the same baselines
  (prompt ids, the prior, the history and an estimator's own state, such as the basis mix's value tracker, are
  functions of the global batch, which every rank draws from the same seeded sampler; data.value_sampling's tracker
  likewise);
- per optimizer step, one all-reduce (SUM) of a flat fp32 buffer of the LoRA gradients and one of the loss
  statistics. Each rank's loss is divided by the completion-token count of the GLOBAL batch, so the sum is the
  gradient of the single-process loss over the whole batch; every rank then clips and steps on identical gradients,
  so parameters and optimizer state stay identical (checked at every checkpoint);
- at setup, the trainable parameters are broadcast from rank 0; the held-out eval is split across ranks and its
  counts summed; the prior (per-prompt streams) is split across ranks and its counts gathered.

Rank 0 alone writes the run folder (config, metrics, checkpoints, adapter, summary). Collectives use gloo on CPUs and
nccl on GPUs (cuda:LOCAL_RANK). When a rank dies, the others stop at their next collective, or when the launcher
ends them, with a message that names the dead rank (found by process id on this host) and the last good checkpoint.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch

from ..errors import ConfigError, TrainingAborted

log = logging.getLogger("basis_lite")

TIMEOUT = timedelta(minutes=30)  # a collective waits this long for a slow rank (model conversion, a long eval)
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """True inside a process that torchrun (or another torch.distributed launcher) started."""
    return all(v in os.environ for v in LAUNCHER_VARS)


def exit_finished_rank(code: int) -> NoReturn:
    """End a torchrun rank whose run has finished and whose process group is closed: flush what Python buffers, then
    leave through os._exit, skipping the interpreter's teardown. There a gloo group's C++ threads can abort a rank
    that has finished ("terminate called without an active exception", no Python frame left), and torchrun then
    reports the finished run as failed and stops the other ranks."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(code)


def env_rank() -> int:
    """This process's rank as the launcher set it (0 without a launcher); usable before `start`."""
    return int(os.environ.get("RANK", "0")) if launched() else 0


class Ranks:
    """One process alone, no launcher: every collective is the identity and nothing is sent."""

    rank = 0
    world = 1
    local_world = 1
    active = False
    backend = "none"
    last_allreduce_s = 0.0  # the latest gradient all-reduce: seconds and bytes per rank
    last_allreduce_bytes = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, device: torch.device) -> torch.device:
        return device

    def bounds(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's contiguous share of n items (sizes differ by at most one)."""
        return n * self.rank // self.world, n * (self.rank + 1) // self.world

    def shard(self, items):
        lo, hi = self.bounds(len(items))
        return items[lo:hi]

    # collectives: identities here, real in ProcessGroupRanks
    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[n, ...] per rank, the same n everywhere -> [world * n, ...] in rank order."""
        return t

    def gather_ragged(self, values: list[float], total: int) -> list[float]:
        """Each rank's slice `bounds(total)` of a list -> the whole list, in order."""
        return list(values)

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def max(self, values: list[float]) -> list[float]:
        return list(values)

    def broadcast_text(self, text: str) -> str:
        return text

    def broadcast_floats(self, values: list[float]) -> list[float]:
        return list(values)

    def broadcast_params(self, params) -> None:
        return None

    def reduce_update(self, params, stats: dict) -> None:
        return None

    def check_in_sync(self, params, optimizer) -> None:
        return None

    def seed_step(self, seed: int, step: int) -> None:
        return None

    def barrier(self) -> None:
        """Wait until every rank got here (one process: returns at once)."""
        return None

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (a download, a cache conversion), the others after it finished."""
        yield

    def watch(self, run_dir: Path) -> None:
        """The run folder whose last checkpoint a failure message names."""
        return None

    def close(self) -> None:
        return None


def gather_items(ranks: Ranks, items: list, total: int) -> list:
    """Each rank's share (`bounds(total)`) of a list whose entries are lists of floats or None -> the whole list,
    in order, on every rank (one process: the list itself). The floats travel as float64 (token ids and float32
    values arrive exactly)."""
    if not ranks.active:
        return list(items)
    width = 2 + int(ranks.max([float(max((len(x) for x in items if x is not None), default=0))])[0])
    per = -(-total // ranks.world)  # the largest share
    rows = torch.zeros(per, width, dtype=torch.float64)
    for k, x in enumerate(items):
        if x is not None:
            rows[k, 0], rows[k, 1] = 1.0, float(len(x))
            rows[k, 2:2 + len(x)] = torch.tensor(x, dtype=torch.float64)
    got = ranks.gather_rows(rows)
    out: list = []
    for r in range(ranks.world):
        for k in range(total * (r + 1) // ranks.world - total * r // ranks.world):
            row = got[r * per + k]
            out.append(row[2:2 + int(row[1])].tolist() if row[0] else None)
    return out


def evaluate_sharded(ranks: Ranks, examples: list, evaluate_fn) -> dict:
    """`evaluate_fn(examples)` on this rank's share, the counts summed over ranks (one process: a plain call)."""
    if not ranks.active:
        return evaluate_fn(examples)
    res = evaluate_fn(ranks.shard(examples))
    levels = sorted({ex.meta["level"] for ex in examples if "level" in ex.meta})
    mine = res.get("by_level", {})
    vec = [res["accuracy"] * res["n"], float(res["n"])]
    for lvl in levels:
        v = mine.get(str(lvl), {"accuracy": 0.0, "n": 0})
        vec += [v["accuracy"] * v["n"], float(v["n"])]
    tot = ranks.sum(vec)
    correct, n = round(tot[0]), int(round(tot[1]))
    out = {"accuracy": correct / max(1, n), "n": n}
    if levels:
        out["by_level"] = {}
        for i, lvl in enumerate(levels):
            c, k = round(tot[2 + 2 * i]), int(round(tot[3 + 2 * i]))
            out["by_level"][str(lvl)] = {"accuracy": c / k if k else 0.0, "n": k}
    return out


class NullMetrics:
    """The metrics writer of a rank other than 0: it writes nothing."""

    def start(self) -> None: ...
    def resume(self, last_step: int) -> None: ...
    def step(self, rec: dict) -> None: ...
    def eval(self, step: int, ev: dict, final: bool = False) -> None: ...
    def close(self) -> None: ...


def _host_id() -> int:
    return int.from_bytes(hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest(), "little")


def _pid_alive(pid: int) -> bool:
    """False once the process has exited (also while it is a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ProcessGroupRanks(Ranks):
    """A torch.distributed process group started by torchrun: gloo on CPUs, nccl on GPUs."""

    active = True

    def __init__(self, rank: int, world: int, local_rank: int, local_world: int, device: torch.device):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world = rank, world
        self.local_rank, self.local_world = local_rank, local_world
        self.comm_device = device if device.type == "cuda" else torch.device("cpu")
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self._device = device
        self.run_dir: Path | None = None
        self.last_allreduce_s = 0.0
        self.last_allreduce_bytes = 0
        self._closed = False
        self._stopping = False  # set while the failure message is being written: a SIGTERM then changes nothing
        if not dist.is_initialized():
            kw = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(self.backend, timeout=TIMEOUT, **kw)
        me = torch.tensor([[os.getpid(), _host_id()]], dtype=torch.int64)
        self.peers = [tuple(int(x) for x in row) for row in self.gather_rows(me).tolist()]  # rank -> (pid, host)
        self._old_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    # --- failure handling -----------------------------------------------------------------------------------------

    def watch(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def dead_ranks(self, wait_s: float = 2.0) -> list[int]:
        """Ranks on this host whose process has exited (polled up to `wait_s` while none is found)."""
        me_host = self.peers[self.rank][1]
        deadline = time.time() + wait_s
        while True:
            dead = [r for r, (pid, host) in enumerate(self.peers)
                    if r != self.rank and host == me_host and not _pid_alive(pid)]
            if dead or time.time() >= deadline:
                return dead
            time.sleep(0.1)

    def failure_message(self, cause: str) -> str:
        from ..runs.checkpoint import latest_checkpoint

        # torchrun sends SIGTERM to the ranks left once one has died, often while this message is being written;
        # raising from the handler then would break the checkpoint check below half-way (a good checkpoint
        # reported as damaged), so from here on the handler only lets this message finish
        self._stopping = True
        dead = self.dead_ranks()
        if dead:
            who = ", ".join(f"rank {r} (pid {self.peers[r][0]})" for r in dead)
            head = f"{who} died; rank {self.rank} of {self.world} stops too ({cause})"
        else:
            head = (f"rank {self.rank} of {self.world} stops: {cause}; no rank on this host has exited, so the "
                    "failed one is on another host or still exiting (torchrun's report names it)")
        if self.run_dir is None:
            return head
        last = latest_checkpoint(self.run_dir)
        if last is None:
            return f"{head}. No checkpoint was written yet in {self.run_dir}"
        return (f"{head}. The last good checkpoint is {last}; continue with `torchrun --nproc_per_node "
                f"{self.local_world} -m basis_lite train --resume {self.run_dir}` ({self.world} ranks in all)")

    def _on_sigterm(self, signum, frame):
        if self._stopping:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        raise TrainingAborted(self.failure_message("the launcher ended this rank"))

    def _call(self, what: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except TrainingAborted:
            raise
        except RuntimeError as e:  # gloo / nccl: a peer closed its connection, a timeout
            first = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip().splitlines()[0]) if str(e).strip() else ""
            first = first.split(". ")[0] or type(e).__name__  # gloo: "[file:line] Connection closed by peer [ip]:port"
            raise TrainingAborted(self.failure_message(f"{what} failed: {first}")) from None

    # --- collectives ----------------------------------------------------------------------------------------------

    def device(self, device: torch.device) -> torch.device:
        return self._device if device.type == "cuda" else device

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        src = t.contiguous().to(self.comm_device)
        out = [torch.empty_like(src) for _ in range(self.world)]
        self._call("all_gather", self.dist.all_gather, out, src)
        return torch.cat(out).cpu()

    def gather_ragged(self, values: list[float], total: int) -> list[float]:
        width = -(-total // self.world)  # ceil: the largest share
        row = torch.zeros(1, width, dtype=torch.float64)
        row[0, :len(values)] = torch.tensor(values, dtype=torch.float64)
        rows = self.gather_rows(row)
        out: list[float] = []
        for r in range(self.world):
            lo, hi = total * r // self.world, total * (r + 1) // self.world
            out += rows[r, :hi - lo].tolist()
        return out

    def _reduce(self, values: list[float], op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        self._call("all_reduce", self.dist.all_reduce, t, op=op)
        return t.cpu().tolist()

    def sum(self, values: list[float]) -> list[float]:
        return self._reduce(values, self.dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._reduce(values, self.dist.ReduceOp.MAX)

    def broadcast_floats(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.comm_device)
        self._call("broadcast", self.dist.broadcast, t, src=0)
        return t.cpu().tolist()

    def broadcast_text(self, text: str) -> str:
        data = text.encode() if self.is_main else b""
        n = int(self.broadcast_floats([float(len(data))])[0])
        buf = torch.zeros(n, dtype=torch.uint8, device=self.comm_device)
        if self.is_main:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._call("broadcast", self.dist.broadcast, buf, src=0)
        return bytes(buf.cpu().tolist()).decode()

    def broadcast_params(self, params) -> None:
        for p in params:
            t = p.data.to(self.comm_device)
            self._call("broadcast", self.dist.broadcast, t, src=0)
            if t is not p.data:
                p.data.copy_(t)

    def reduce_update(self, params, stats: dict) -> None:
        """Sum the gradients (zeros where this rank trained nothing) and every value of `stats` over the ranks."""
        t0 = time.time()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads]).to(self.comm_device)
        self._call("gradient all_reduce", self.dist.all_reduce, flat, op=self.dist.ReduceOp.SUM)
        flat = flat.to(params[0].device) if params else flat
        off = 0
        for p in params:
            n = p.numel()
            g = flat[off:off + n].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            off += n
        keys = list(stats)
        for k, v in zip(keys, self.sum([float(stats[k]) for k in keys])):
            stats[k] = v
        self.last_allreduce_s = time.time() - t0
        self.last_allreduce_bytes = flat.numel() * flat.element_size()

    def check_in_sync(self, params, optimizer) -> None:
        """Raise when the ranks' parameters or optimizer state differ (they must be bitwise equal)."""
        sums = [float(sum(p.detach().double().sum() for p in params)),
                float(sum(p.detach().double().pow(2).sum() for p in params))]
        state = [t for s in optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.is_floating_point()]
        sums.append(float(sum(t.detach().double().sum() for t in state)) if state else 0.0)
        hi, lo = self.max(sums), [-x for x in self.max([-x for x in sums])]
        if hi != lo:
            raise TrainingAborted(f"the ranks' adapters or optimizer states differ (checksums from {lo} to {hi}); "
                                  "every rank must load the same model and take the same steps")

    def seed_step(self, seed: int, step: int) -> None:
        """Seed the global RNG from (seed, step, rank): what else draws from it (dropout) resumes exactly."""
        from ..engines.seeded import stream_seed

        torch.manual_seed(stream_seed(seed, f"global/{step}", self.rank))

    def barrier(self) -> None:
        self.sum([0.0])  # a collective every rank joins, through _call's failure handling

    @contextlib.contextmanager
    def main_first(self):
        if not self.is_main:
            self.barrier()
        yield  # an error on rank 0 leaves the others waiting: the launcher ends them when rank 0 exits
        if self.is_main:
            self.barrier()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        signal.signal(signal.SIGTERM, self._old_sigterm or signal.SIG_DFL)
        try:
            self.dist.destroy_process_group()
        except Exception as e:  # a group left alive is torn down at exit, where gloo may abort the process
            log.warning("rank %d: destroy_process_group failed (%s: %s)", self.rank, type(e).__name__, e)


def start(cfg) -> Ranks:
    """The ranks of this run: `Ranks()` without a launcher, else the process group (initialised here)."""
    if not launched():
        return Ranks()
    from ..model.dtypes import resolve_device

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    b = cfg.train.batch_size
    if b % world:
        fits = [m for m in range(1, b + 1) if b % m == 0]
        raise ConfigError(f"train.batch_size={b} is the global batch (prompts per step over all ranks) and must "
                          f"divide by the {world} ranks; use a multiple of {world} (e.g. {world * max(1, b // world)}) "
                          f"or a rank count among {fits}")
    if cfg.generation.rng == "global" and world > 1:
        raise ConfigError("generation.rng: global (one torch RNG per process) would give every rank the same random "
                          "stream; use per_prompt or auto with more than one rank")
    device = resolve_device(cfg.device)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    ranks = ProcessGroupRanks(rank, world, local_rank, local_world, device)
    if rank != 0:
        logging.getLogger("basis_lite").setLevel(logging.WARNING)
    log.info("data-parallel: %d ranks (%s), %d prompts per rank of a global batch of %d", world, ranks.backend,
             b // world, b)
    return ranks
