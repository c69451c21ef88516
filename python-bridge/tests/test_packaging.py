"""tzip installed outside the repository (issue 14, item 7), and how the Python package finds the daemon's CLI.

The install test packs the npm package (``npm pack``), installs it globally into a fresh prefix with a PATH that has
no C/C++ compiler, make or cmake (so nothing can be compiled), builds the Python wheel (``pip wheel``, setuptools
as pinned in pyproject.toml) and installs it, and ``pip install ./python-bridge``, each into a fresh venv; then,
outside the repository, ``tzip --version`` runs, the installed Python package starts a daemon through its discovery
(which must say it used ``tzip`` on PATH) and a round trip of real trained weights comes back bit for bit. Both
installs carry ``tzip-attach.pth``: ``TZIP_ATTACH=1`` loads tzip.attaching at interpreter start-up.

The venvs are made without torch: a ``.pth`` line puts the test interpreter's site-packages (torch, pyzmq,
msgpack, ... as pinned) after the venv's own, so the installed ``tzip`` is imported from the venv while torch
is not downloaded again. Only that directory's modules are visible: its ``.pth`` files (the editable install of
the checkout) are not run, and the test checks that ``tzip`` comes from the venv and no repository folder is on
``sys.path``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import textwrap
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tzip import _spawn
from tzip._errors import DaemonSpawnError

from test_client_support import MAIN, ROOT, ensure_built, sock_dir  # noqa: F401

VERSION = json.loads((ROOT / "package.json").read_text())["version"]

#: Programs that compile or drive a compile; left out of the install's PATH.
_COMPILERS = re.compile(r"^(cc|c\+\+|c89|c99|cpp(-[0-9.]+)?|gcc.*|g\+\+.*|clang.*|.*-linux-gnu(eabi(hf)?)?-.*|"
                        r"make|gmake|cmake|ninja|ld|ld\..*|as|nvcc|tcc|icx|icpx)$")


# --------------------------------------------------------------------------------------------- discovery (unit)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No TZIP_CLI / TZIP_NODE, and a PATH of only a folder for this test's `tzip` plus node's folder."""
    monkeypatch.delenv("TZIP_CLI", raising=False)
    monkeypatch.delenv("TZIP_NODE", raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    node = shutil.which("node")
    assert node, "node is needed"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.path.dirname(node)}")
    if shutil.which("tzip"):  # node's own folder holds a tzip (a global npm install): hide it behind a link farm
        only_node = tmp_path / "node-bin"
        only_node.mkdir()
        (only_node / "node").symlink_to(node)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{only_node}")
    return bin_dir


def _js_link(bin_dir: Path) -> Path:
    """``bin_dir/tzip``: a link to an executable JavaScript file that runs the checkout's CLI, as npm's bin link to
    an installed dist/src/cli/main.js is (the checkout's own main.js is not executable: tsc does not mark it)."""
    runner = bin_dir.parent / "tzip-cli.mjs"
    runner.write_text(f"#!/usr/bin/env node\nimport {json.dumps(MAIN.as_uri())};\n")
    runner.chmod(0o755)
    link = bin_dir / "tzip"
    link.symlink_to(runner)
    return link


def test_the_checkout_is_used_when_nothing_else_is_found(clean_env):
    choice = _spawn.find_cli()
    assert choice.source == "checkout" and choice.path == str(MAIN)
    assert choice.command == [shutil.which("node"), str(MAIN)]
    assert choice.describe() == f"the repository checkout ({MAIN})"


def test_tzip_on_path_wins_over_the_checkout(clean_env):
    link = _js_link(clean_env)
    choice = _spawn.find_cli()
    assert choice.source == "PATH" and choice.path == str(link)
    # a JavaScript CLI runs through node, so TZIP_NODE is honoured
    assert choice.command == [shutil.which("node"), str(link)]
    assert choice.describe() == f"`tzip` on PATH ({link})"


def test_tzip_node_runs_a_javascript_cli(clean_env, monkeypatch):
    _js_link(clean_env)
    monkeypatch.setenv("TZIP_NODE", "/opt/node20/bin/node")
    assert _spawn.find_cli().command == ["/opt/node20/bin/node", str(clean_env / "tzip")]


def test_an_executable_that_is_not_javascript_runs_as_it_is(clean_env):
    wrapper = clean_env / "tzip"
    wrapper.write_text(f'#!/bin/sh\nexec node {MAIN} "$@"\n')
    wrapper.chmod(0o755)
    choice = _spawn.find_cli()
    assert choice.source == "PATH" and choice.command == [str(wrapper)]


def test_tzip_cli_wins_over_path(clean_env, monkeypatch):
    _js_link(clean_env)
    monkeypatch.setenv("TZIP_CLI", str(MAIN))
    choice = _spawn.find_cli()
    assert choice.source == "TZIP_CLI" and choice.path == str(MAIN)
    assert choice.describe() == f"$TZIP_CLI ({MAIN})"


def test_a_tzip_cli_that_does_not_exist_is_an_error_not_a_fallback(clean_env, monkeypatch, tmp_path):
    _js_link(clean_env)
    monkeypatch.setenv("TZIP_CLI", str(tmp_path / "nowhere.js"))
    with pytest.raises(DaemonSpawnError, match=r"TZIP_CLI=.*nowhere\.js does not exist"):
        _spawn.find_cli()


def test_no_node_is_a_clear_error(clean_env, monkeypatch):
    monkeypatch.setenv("PATH", str(clean_env))  # no node anywhere
    with pytest.raises(DaemonSpawnError, match="no `node` on PATH"):
        _spawn.find_cli()


def test_spawn_daemon_says_it_used_tzip_on_path(clean_env, sock_dir, caplog):  # noqa: F811
    ensure_built()
    link = _js_link(clean_env)
    sock = os.path.join(sock_dir, "s", "tzip.sock")
    caplog.set_level("INFO", logger="tzip")
    pid = _spawn.spawn_daemon(sock)
    try:
        assert _spawn.last_spawn_cli is not None and _spawn.last_spawn_cli.source == "PATH"
        assert _spawn.last_spawn_cli.path == str(link)
        assert f"with `tzip` on PATH ({link})" in caplog.text
        with open(sock + ".log") as f:
            assert f"starts a daemon with `tzip` on PATH ({link})" in f.read()
    finally:
        _stop(pid)


def _stop(pid: int | None) -> None:
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _spawn.pid_alive(pid):
        time.sleep(0.05)
    if _spawn.pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


# --------------------------------------------------------------------------------------------- the install test


def _no_compiler_path(farm: Path) -> str:
    """A folder of links to every program on this PATH except compilers, make and cmake: the PATH of a machine of
    this kind without a compiler."""
    farm.mkdir()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not d or not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            src = os.path.join(d, name)
            if _COMPILERS.match(name) or (farm / name).exists() or not os.access(src, os.X_OK) or os.path.isdir(src):
                continue
            (farm / name).symlink_to(src)
    for tool in ("cc", "gcc", "g++", "c++", "make", "cmake"):
        assert shutil.which(tool, path=str(farm)) is None, tool
    return str(farm)


def _env(path: str, **extra: str) -> dict[str, str]:
    """This environment without npm's per-run variables, TZIP_* and PYTHON*, with ``path`` as PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("npm_", "TZIP_", "PYTHON", "VIRTUAL_ENV")) and k not in ("INIT_CWD", "NODE_PATH")}
    env["PATH"] = path
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], cwd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _venv(where: Path) -> Path:
    """A fresh venv without pip that sees this interpreter's site-packages after its own (see the module docstring)."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(where)], os.environ.copy(), str(where.parent))
    py = where / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "zz-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def _pip(py: Path, *args: str, cwd: str) -> None:
    _run([sys.executable, "-m", "pip", "--python", str(py), "--disable-pip-version-check", "--no-input", *args],
         _env(os.environ["PATH"]), cwd)


ROUND_TRIP = textwrap.dedent('''
    import json, logging, os, sys
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    import torch
    from safetensors import safe_open
    import tzip
    from tzip import _spawn
    from tzip.demo_data import source_weights_path

    venv, repo = sys.argv[1], sys.argv[2]
    assert tzip.__file__.startswith(venv), tzip.__file__
    bad = [p for p in sys.path if p in ("", ".", repo) or p.startswith(os.path.join(repo, "python-bridge"))]
    assert not bad and not os.getcwd().startswith(repo), (bad, os.getcwd())
    tensors = {}
    with safe_open(str(source_weights_path()), framework="pt") as f:  # all-MiniLM-L6-v2's trained weights
        for name in sorted(f.keys()):
            if name.startswith("encoder.layer.0."):
                tensors[name] = f.get_tensor(name)
    tensors.update({n + ".bf16": t.to(torch.bfloat16) for n, t in list(tensors.items())})
    with tzip.connect(spawn=True, strict=True) as c:  # TZIP_SOCKET names a folder with no daemon yet
        cli = _spawn.last_spawn_cli
        names = list(tensors)
        cts = c.compress([tensors[n] for n in names])
        back = c.decompress(cts)
        same = []
        for n, t, b in zip(names, [tensors[n] for n in names], back):
            iv = torch.int16 if t.dtype == torch.bfloat16 else torch.int32
            same.append(b.dtype == t.dtype and b.shape == t.shape and torch.equal(b.view(iv), t.view(iv)))
        out = {"source": cli.source, "path": cli.path, "daemon_pid": c.daemon_info["pid"], "tensors": len(names),
               "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
               "compressed_bytes": sum(ct.compressed_nbytes for ct in cts),
               "codecs": sorted({ct.codec for ct in cts}), "all_equal": all(same)}
    print("RESULT " + json.dumps(out))
''')

NO_CLI = textwrap.dedent('''
    import sys
    import tzip
    from tzip import _spawn
    from tzip._errors import DaemonSpawnError
    assert tzip.__file__.startswith(sys.argv[1]), tzip.__file__
    try:
        _spawn.find_cli()
    except DaemonSpawnError as e:
        print("ERROR " + str(e))
    else:
        print("FOUND " + repr(_spawn.find_cli()))
''')


def _registries_unreachable(npm: str) -> str | None:
    """Why the npm registry or the Python package index cannot be reached (the installs fetch the npm dependencies
    and pip's pinned setuptools from them), or None when both answer. A GPU host without network access is one."""
    registry = subprocess.run([npm, "config", "get", "registry"], capture_output=True, text=True,
                              env=_env(os.environ["PATH"])).stdout.strip() or "https://registry.npmjs.org/"
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/")
    for url in (registry, index.rstrip("/") + "/setuptools/"):
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                r.read(1)
        except (OSError, ValueError) as e:
            return f"{url}: {e}"
    return None


def test_npm_pack_and_pip_install_outside_the_repository():
    ensure_built()
    npm = shutil.which("npm")
    assert npm, "npm is needed"
    unreachable = _registries_unreachable(npm)
    if unreachable:
        pytest.skip(f"needs the npm registry and the Python package index: {unreachable}")
    work = Path(tempfile.mkdtemp(prefix="tzip-pk-"))
    sock = str(work / "s" / "tzip.sock")
    daemon_pid = None
    try:
        farm = _no_compiler_path(work / "no-compiler-bin")
        prefix = work / "npm-prefix"
        # Two copies: pip builds in the source tree (build/, egg-info), and two builds of one tree race on
        # build/bdist.*/wheel (CI once failed with "File exists: .../tzip-0.1.0.dist-info").
        src_wheel, src_dir = work / "python-bridge-wheel", work / "python-bridge"
        wheels = work / "wheels"
        venv_wheel, venv_dir = work / "venv-wheel", work / "venv-dir"

        def npm_package() -> Path:
            # npm pack in the checkout: the built addon and the compiled CLI, no sources.
            out = _run([npm, "pack", "--json", "--pack-destination", str(work)], _env(os.environ["PATH"]), str(ROOT))
            tgz = work / json.loads(out.stdout)[0]["filename"]
            # npm install -g into a fresh prefix, nothing compilable: the dependencies come from the npm registry
            # (npm's cache first) as prebuilt binaries, the addon is the one built here.
            _run([npm, "install", "-g", "--prefix", str(prefix), str(tgz), "--no-audit", "--no-fund", "--prefer-offline",
                  "--no-update-notifier"], _env(farm), str(work), timeout=300)
            return tgz

        def python_wheel() -> Path:
            # pip wheel (setuptools as pyproject.toml pins it, in pip's isolated build env), installed into a venv
            _run([sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--no-deps", "-w", str(wheels),
                  str(src_wheel)], _env(os.environ["PATH"]), str(work), timeout=300)
            (wheel,) = wheels.glob("tzip-*.whl")
            _pip(_venv(venv_wheel), "install", "--no-deps", "--no-index", str(wheel), cwd=str(work))
            return wheel

        def python_folder() -> None:
            # `pip install ./python-bridge` as users type it (build isolation: pip fetches the pinned setuptools)
            _pip(_venv(venv_dir), "install", "--no-deps", str(src_dir), cwd=str(work))

        # Built from a copy of python-bridge, so the checkout gets no build/ or egg-info. The three installs are
        # independent: run side by side (mostly waiting on unpacking and npm's and pip's caches).
        for src in (src_wheel, src_dir):
            shutil.copytree(ROOT / "python-bridge", src, ignore=shutil.ignore_patterns(
                "tests", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
        with ThreadPoolExecutor(3) as pool:
            jobs = [pool.submit(f) for f in (npm_package, python_wheel, python_folder)]
            tgz, wheel, _ = (j.result() for j in jobs)
        py_wheel, py_dir = venv_wheel / "bin" / "python", venv_dir / "bin" / "python"

        assert tgz.name == f"tzip-{VERSION}.tgz"
        with tarfile.open(tgz) as tf:
            members = set(tf.getnames())
        assert {"package/package.json", "package/build/Release/tzip.node", "package/dist/src/cli/main.js"} <= members
        assert not [m for m in members if m.endswith((".ts", ".map")) and not m.endswith(".d.ts")]
        assert not [m for m in members if m.startswith(("package/cuda/", "package/python-bridge/", "package/test/",
                                                        "package/node_modules/", "package/src/"))]
        tzip_bin = prefix / "bin" / "tzip"
        path = f"{prefix / 'bin'}{os.pathsep}{farm}"
        assert _run([str(tzip_bin), "--version"], _env(path), str(work)).stdout.strip() == VERSION
        addon = prefix / "lib" / "node_modules" / "tzip" / "build" / "Release" / "tzip.node"
        needed = _run(["ldd", str(addon)], _env(os.environ["PATH"]), str(work)).stdout
        assert "not found" not in needed and "libcudart" not in needed, needed  # the CUDA runtime is static
        assert wheel.name == f"tzip-{VERSION}-py3-none-any.whl"
        # TZIP_ATTACH=1 (tzip.attaching): the wheel's root carries tzip-attach.pth, python-bridge/setup.py's one job
        from tzip.attaching import PTH_LINE, PTH_NAME

        with zipfile.ZipFile(wheel) as zf:
            assert zf.read(PTH_NAME).decode() == PTH_LINE
        probe = "import sys; print('tzip.attaching' in sys.modules, 'torch' in sys.modules)"
        for py in (py_wheel, py_dir):
            assert _run([str(py), "-I", "-c", probe], _env(str(farm)), str(work)).stdout.split() == ["False", "False"]
            attached = _run([str(py), "-I", "-c", probe], _env(str(farm), TZIP_ATTACH="1"), str(work)).stdout.split()
            assert attached == ["True", "False"], (py, attached)  # started at start-up, torch left to the job

        # The folder install, without `tzip` on PATH: no CLI to be found (it is not in a checkout).
        r = _run([str(py_dir), "-I", "-c", NO_CLI, str(venv_dir)], _env(str(farm)), str(work))
        assert "ERROR cannot start the tzip daemon: no tzip CLI found" in r.stdout, r.stdout
        assert "`tzip` on PATH (none)" in r.stdout

        # The wheel install with the npm prefix on PATH: starts the daemon with `tzip` on PATH, round trip.
        env = _env(path, TZIP_SOCKET=sock)
        r = _run([str(py_wheel), "-I", "-c", ROUND_TRIP, str(venv_wheel), str(ROOT)], env, str(work), timeout=180)
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
        result = json.loads(line[len("RESULT "):])
        daemon_pid = result["daemon_pid"]
        assert result["source"] == "PATH" and result["path"] == str(tzip_bin), result
        assert f"tzip: starting a daemon on {sock} with `tzip` on PATH ({tzip_bin})" in r.stderr, r.stderr
        assert result["tensors"] >= 32 and result["all_equal"] is True, result
        assert result["codecs"] != ["raw"], result  # the installed addon compressed them
        with open(sock + ".log") as f:
            log = f.read()
        assert f"starts a daemon with `tzip` on PATH ({tzip_bin})" in log
        assert str(prefix / "lib" / "node_modules" / "tzip") in log or str(tzip_bin) in log
    finally:
        _stop(daemon_pid if daemon_pid is not None else _spawn.daemon_pid(sock))
        shutil.rmtree(work, ignore_errors=True)
