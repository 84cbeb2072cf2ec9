"""Two torchrun agents on this machine acting as two nodes of one job (tests/test_nodes.py and
benchmarks/elastic_membership.py): each agent in its own session, meeting in a c10d rendezvous at
127.0.0.1 as the nodes of a real multi-node job meet at the first node's address. The two agents
together are one multi-process job: they hold the machine-wide lock of testing/local.py."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from testing.local import DEVICE, REPO, child_env, multiprocess_lock, need_gpus, torchrun_argv, worker_pids

# Rendezvous knobs (--rdzv-conf), set for a fast run: with --nnodes=1:2 a round that has its
# minimum waits last_call_timeout for more nodes; a round must complete within join_timeout; a
# node counts as dead once it missed keep_alive_max_attempt heartbeats keep_alive_interval apart
# (torch's default 3 x 5 s made the survivor wait 15 s before it could form a round without the
# lost node).
RDZV_CONF = "join_timeout=90,last_call_timeout=6,keep_alive_interval=1,keep_alive_max_attempt=5"
LAUNCH_TIMEOUT_S = 240  # a whole two-node job, start-up and restarts included


@contextmanager
def reserved_port():
    """A free port of 127.0.0.1, held until the block ends: bound (SO_REUSEADDR, not listening), so no
    other bind of this machine is given it, while the rendezvous store binds it too (TCPStore's
    listening socket sets SO_REUSEADDR; Linux lets both bind while neither of the other listens).
    A port found free and released at once could be taken before torchrun binds it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = worker_pids(todo.pop())
        out += kids
        todo += kids
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything under it. torchrun starts each worker in a session of its own,
    so killing the agent's process group would leave the workers running."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Node:
    """One torchrun agent ("node"), its output in a log file."""

    def __init__(self, name: str, log: Path, cmd: list[str], env: dict):
        self.name, self.log = name, log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL the agent and its workers: the node is gone."""
        kill_tree(self.proc.pid)
        self.proc.wait(timeout=30)


@contextmanager
def two_nodes(logs: Path, args: list[str], nnodes: str = "2", max_restarts: int = 0):
    """Start two agents of one job running `main.py *args`; yield (A, B); SIGKILL whatever is left
    of both in the end. Holds the machine-wide lock throughout: the two agents together are one
    multi-process job.

    Node A hosts the rendezvous store, so it is the node that must survive. Each node has its own
    loopback address (--local-addr), and the rendezvous orders nodes by address: B gets global
    rank 0 (the rank that holds the run folder's lock and writes metrics and outputs), so losing
    B also moves rank 0 and the lock to the other node. (Ordered by the agents' pids otherwise,
    which wrap around.) On cuda (MINGPT_TEST_DEVICE, testing/local.py) each node sees a GPU of its own,
    as separate machines would: B GPU 0, A GPU 1."""
    need_gpus(2)  # on cuda each node has a GPU of its own
    job = f"job{os.getpid()}-{time.monotonic_ns()}"
    env = child_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)  # the README's multi-node setting
    nodes = []
    with multiprocess_lock(), reserved_port() as port:
        try:
            for name, host, addr, gpu in (("A", "true", "127.0.0.2", "1"), ("B", "false", "127.0.0.1", "0")):
                cmd = torchrun_argv(1, ["main.py", *args], standalone=False, extra_torchrun=[
                    f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                    f"--rdzv-id={job}", f"--rdzv-conf=is_host={host},{RDZV_CONF}", f"--local-addr={addr}",
                    f"--max-restarts={max_restarts}", "--monitor-interval=0.2"])
                node_env = {**env, "CUDA_VISIBLE_DEVICES": gpu} if DEVICE == "cuda" else env
                nodes.append(Node(name, logs / f"node{name}.log", cmd, node_env))
            yield nodes
        finally:
            for node in nodes:
                if node.proc.poll() is None:
                    node.kill()


def wait_all(nodes, timeout: float = LAUNCH_TIMEOUT_S) -> list[int]:
    deadline = time.time() + timeout
    codes = []
    for node in nodes:
        try:
            codes.append(node.proc.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {node.name} still running after {timeout} s:\n"
                                 + "\n".join(n.output()[-3000:] for n in nodes)) from None
    return codes


def wait_for(cond, nodes, what: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline or any(n.proc.poll() is not None for n in nodes):
            raise AssertionError(f"never saw {what}:\n" + "\n".join(n.output()[-3000:] for n in nodes))
        time.sleep(0.02)


def snapshot_steps(run_dir: Path) -> set[int]:
    snaps = run_dir / "snapshots"
    return {int(p.name[len("step_"):]) for p in snaps.glob("step_*")} if snaps.is_dir() else set()


def lose_node_after_snapshot(a: Node, b: Node, run_dir: Path, min_step: int = 1) -> int:
    """Wait until the two nodes have written a snapshot together at a step >= min_step, then
    SIGKILL node B whole. Returns the newest snapshot step at that moment. (Should B join the first
    round late under --nnodes=1:2, A trains alone first and the two re-form at world size 2 when
    B comes: only snapshots that appear after a world-2 start-up line count.)"""
    before: list[set] = []

    def ready() -> bool:
        steps = snapshot_steps(run_dir)
        if not before:
            if "layout: world 2 " not in a.output() + b.output():
                return False
            before.append(steps)
        return any(s >= min_step for s in steps - before[0])
    wait_for(ready, (a, b), f"a snapshot at step >= {min_step} written by the two nodes")
    newest = max(snapshot_steps(run_dir))
    b.kill()
    return newest
