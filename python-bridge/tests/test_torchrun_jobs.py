"""The ranks of one ``torchrun`` launch are one job in ``tzip jobs`` with no $TZIP_JOB (issue 36): a launch with a
run id (``--standalone``: a fresh uuid) is named by it; a launch without one (torchrun's default static rendezvous
gives its ranks $TORCHELASTIC_RUN_ID "none") is named by what its ranks agree on in the store torchrun's agent hosts
for them, so two launches one after the other on the same port are two jobs. A single process keeps
``<script>-<pid>``; $TZIP_JOB still wins.

Real launches: ``python -m torch.distributed.run --nproc-per-node 2`` of a small script whose two ranks connect to
one real daemon (`tzip serve` on a private socket; their clients can never start one of their own: $TZIP_CLI names
no file), read back with ``tzip jobs --json``. torchrun and its ranks run in a process group of their own, killed
when a run overstays its timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tzip._job as _job
from test_client_support import shared_daemon as daemon  # noqa: F401  (one daemon for the module)

ROOT = Path(__file__).resolve().parents[2]

#: The launched script: rank 0 connects before init_process_group and rank 1 after it (the job's name must not
#: depend on when a rank asks), each names its job to the daemon (set_job: what tzip.attach() sends), round-trips a
#: tensor, prints its rank and job name as one JSON line and waits for the other rank before leaving, so both
#: sessions are open together.
SCRIPT = r'''
import json, os
import torch, torch.distributed as dist
import tzip

rank = int(os.environ["RANK"])
if rank == 1:
    dist.init_process_group("gloo")
c = tzip.connect(os.environ["TZIP_SOCKET"], spawn=False, strict=True)
c.set_job(True)
if rank == 0:
    dist.init_process_group("gloo")
x = torch.randn(4096)
assert torch.equal(c.decompress(c.compress(x)), x)
print(json.dumps({"rank": rank, "job": c.job["name"], "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}), flush=True)
dist.barrier()
c.close()
dist.destroy_process_group()
'''

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TZIP_JOB",
               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(daemon, script: Path, *launch_args: str, timeout: float = 180.0) -> list[dict]:
    """``python -m torch.distributed.run --nproc-per-node 2 LAUNCH_ARGS script`` with its clients on the module's
    daemon; returns what each rank printed (sorted by rank). Fails the test on a non-zero exit or a timeout."""
    with tempfile.TemporaryDirectory(prefix="tzip-nocli-") as d:
        env = dict(os.environ)
        bridge = str(ROOT / "python-bridge")
        env.update({"TZIP_SOCKET": daemon.socket, "TZIP_CLI": os.path.join(d, "no-cli.js"), "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join([bridge, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
        if os.path.exists("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        for k in LAUNCH_VARS:
            env.pop(k, None)  # torchrun sets them for its ranks; the test names no job
        p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *launch_args,
                              str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            pytest.fail(f"torchrun not done within {timeout} s; killed:\n{out[-3000:]}\n{err[-3000:]}")
    assert p.returncode == 0, f"exit {p.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
    lines = sorted((json.loads(ln) for ln in out.splitlines() if ln.startswith('{"rank"')), key=lambda r: r["rank"])
    assert [r["rank"] for r in lines] == [0, 1], (out[-3000:], err[-3000:])
    return lines


def tzip_jobs(daemon) -> list[dict]:
    """``tzip jobs --json --socket SOCKET`` (the CLI a user runs): the daemon's jobs."""
    cp = subprocess.run(["node", str(ROOT / "dist" / "src" / "cli" / "main.js"), "jobs", "--json", "--socket",
                         daemon.socket], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)["jobs"]


def listed(daemon, name: str) -> dict:
    found = [j for j in tzip_jobs(daemon) if j["name"] == name]
    assert len(found) == 1, (name, [j["name"] for j in tzip_jobs(daemon)])
    return found[0]


@pytest.fixture(scope="module")
def script():
    with tempfile.TemporaryDirectory(prefix="tzip-torchrun-") as d:
        path = Path(d) / "two_ranks.py"
        path.write_text(SCRIPT)
        yield path


def test_torchrun_without_run_id_is_one_job_per_launch(daemon, script):
    """torchrun's default rendezvous (no --standalone, no --rdzv-id: run id "none"), launched twice on the same
    master port: each launch's two ranks (one asking before init_process_group, one after) name the same job,
    listed by `tzip jobs` with ranks [0, 1], world size 2 and two pids; the second launch is another job."""
    port = str(free_port())
    names = []
    for _ in range(2):
        ranks = torchrun(daemon, script, "--master-addr", "127.0.0.1", "--master-port", port)
        assert {r["run_id"] for r in ranks} == {"none"}
        assert ranks[0]["job"] == ranks[1]["job"], ranks
        name = ranks[0]["job"]
        assert re.fullmatch(r"two_ranks\.py-[0-9a-f]{12}", name), name  # from the agent's store, not the endpoint
        job = listed(daemon, name)
        assert job["ranks"] == [0, 1] and job["world_size"] == 2 and len(job["pids"]) == 2, job
        names.append(name)
    assert names[0] != names[1], names


def test_torchrun_standalone_is_named_by_its_run_id(daemon, script):
    """``--standalone``: torchrun gives the launch a fresh uuid as its run id; both ranks are the job of that name."""
    ranks = torchrun(daemon, script, "--standalone")
    run_id = ranks[0]["run_id"]
    assert run_id not in (None, "none") and ranks[1]["run_id"] == run_id
    assert [r["job"] for r in ranks] == [run_id, run_id]
    job = listed(daemon, run_id)
    assert job["ranks"] == [0, 1] and job["world_size"] == 2 and len(job["pids"]) == 2, job


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variable, and no launch name found earlier in this process."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(_job, "_launch_name", None)
    return monkeypatch


def test_a_single_process_keeps_its_script_and_pid(clean_env):
    assert _job.job_info()["name"] == f"{_job._script_name()}-{os.getpid()}"
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", "29500")
    assert _job.job_info()["name"] == f"{_job._script_name()}-{os.getpid()}"  # no world of 2 or more
    clean_env.setenv("WORLD_SIZE", "1")
    assert _job.job_info()["name"] == f"{_job._script_name()}-{os.getpid()}"


def test_ranks_agree_through_the_agent_store_and_tzip_job_wins(clean_env):
    """Two "ranks" of one launch (this process, the cache cleared between them) asking the same agent store get
    one name, the first one's; another store (another launch) gives another; $TZIP_JOB and a name passed win."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    clean_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(server.port))
    first = _job.job_info()["name"]
    clean_env.setattr(_job, "_launch_name", None)
    assert _job.job_info()["name"] == first
    assert server.get(_job.LAUNCH_STORE_KEY).decode() == first
    other = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    clean_env.setenv("MASTER_PORT", str(other.port))
    assert _job.job_info()["name"] not in (first, None)
    clean_env.setenv("TZIP_JOB", "night-run")
    assert _job.job_info()["name"] == "night-run"
    assert _job.job_info("given")["name"] == "given"


def test_without_a_reachable_store_the_endpoint_names_the_job(clean_env):
    """A store that does not answer (within LAUNCH_STORE_TIMEOUT_S), or ranks that do not use torchrun's agent
    store, or another launcher's ranks with a shared endpoint: ``<script>-<MASTER_ADDR>:<MASTER_PORT>``."""
    clean_env.setattr(_job, "LAUNCH_STORE_TIMEOUT_S", 0.2)
    port = str(free_port())  # nothing listens there
    clean_env.setenv("TORCHELASTIC_RUN_ID", "none")
    clean_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", port)
    want = f"{_job._script_name()}-127.0.0.1:{port}"
    assert _job.job_info()["name"] == want
    clean_env.setattr(_job, "_launch_name", None)
    clean_env.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert _job.job_info()["name"] == want
    clean_env.setattr(_job, "_launch_name", None)
    clean_env.delenv("TORCHELASTIC_RUN_ID")
    clean_env.delenv("TORCHELASTIC_USE_AGENT_STORE")
    clean_env.setenv("WORLD_SIZE", "2")
    assert _job.job_info()["name"] == want
